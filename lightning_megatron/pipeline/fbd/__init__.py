"""MegaFBD's rank split (``schedule="fbd"``): forward replicas run forwards, backward replicas run backwards.

``roles`` (which data-parallel replicas do what, who feeds whom), ``wiring`` (message tags, who talks to whom, the
link's calibration), ``schedule`` (the session: both roles' loops), ``replay`` (ship mode: capture saved tensors, rebuild the graph without GEMMs), ``perfmodel`` (the
step time predicted from measured parts), ``options`` (the ``schedule_options`` the strategy takes).

When to use it, and when the weight-gradient split on the same GPUs (``schedule="zb-h1"``) is the better
decoupling, is in the README's MegaFBD section: on the same number of GPUs the rank split cannot beat coupled
training (its backward replicas recompute, or wait for shipped activations); it pays when the forwards run on
devices that would not train anyway, or for forward-heavy work.
"""

from __future__ import annotations

from lightning_megatron.pipeline.fbd.options import MODES, FbdOptions, parse_options
from lightning_megatron.pipeline.fbd.roles import data_shard
from lightning_megatron.pipeline.registry import ScheduleContext, register_schedule

__all__ = ["MODES", "FbdOptions"]


def _open(context: ScheduleContext):  # noqa: ANN202
    from lightning_megatron.pipeline.fbd.schedule import FbdSession  # megatron-core and transports load here

    return FbdSession(context)


register_schedule(
    "fbd",
    open_session=_open,
    virtual_stages=False,
    parse_options=parse_options,
    data_shard=data_shard,
    description="MegaFBD rank split: forward replicas run forwards, backward replicas the backwards (mode=...)",
)
