"""Errors raised for bad configurations, before any process blocks in a collective."""

from __future__ import annotations


class MegatronConfigError(ValueError):
    """A setting the strategy cannot run with. The message names the parameter and the fix.

    Every check that raises it runs on every rank with the same inputs, so all ranks fail together
    instead of one rank failing while its peers wait for it.
    """
