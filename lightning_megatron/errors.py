"""The project's error types: a bad setting (:class:`MegatronConfigError`, raised before any process blocks in a
collective) apart from a transport called wrongly at run time (:class:`TransportUsageError`)."""

from __future__ import annotations


class MegatronConfigError(ValueError):
    """A setting the strategy cannot run with. The message names the parameter and the fix.

    Every check that raises it runs on every rank with the same inputs, so all ranks fail together
    instead of one rank failing while its peers wait for it.
    """


class TransportUsageError(ValueError):
    """A transport called wrongly while running: a tag out of range, a peer not connected, keys that are not
    ``(peer, tag)`` pairs, a tensor it cannot carry. The message names the argument and the fix.

    Not a setting: the code that calls the transport (a schedule) has a bug, which a user cannot fix in the
    strategy's arguments. A subclass of ``ValueError`` like :class:`MegatronConfigError`, and not one of it."""
