"""``rdma``: ranks on hosts with InfiniBand/RoCE NICs, over ibverbs RC queue pairs (one per pair of ranks).

Queue-pair numbers, LIDs/GIDs and the address of each side's credit word are exchanged through the
rendezvous store. Buffers are pre-registered slots; a sender posts only with a receive credit, and credits
return by RDMA WRITE (see native/src/rdma_channel.h). Needs rdma-core's headers at build time
(``apt-get install libibverbs-dev``) and an RDMA device at run time: without one, the constructor raises
:class:`TransportError` saying so. Off unless asked for by name.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.transport.native import NativeTransport, _native, env_int

__all__ = ["RdmaTransport"]


class RdmaTransport(NativeTransport):
    """ibverbs RC transport. ``device`` (env ``LM_RDMA_DEVICE``; default: the first), ``port`` (1),
    ``gid_index`` (env ``LM_RDMA_GID_INDEX``; default 0 on InfiniBand, the first non-zero GID on RoCE),
    ``slot_bytes``/``slots``: registered buffer slots per peer and direction (slots = receive credits)."""

    name = "rdma"
    devices = ("cpu",)

    def __init__(
        self,
        *,
        device: Optional[str] = None,
        port: int = 1,
        gid_index: Optional[int] = None,
        slot_bytes: int = 256 << 10,
        slots: int = 32,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if slot_bytes < 4096 or slots < 2:
            raise MegatronConfigError(
                f"transport 'rdma': slot_bytes={slot_bytes} must be >= 4096 and slots={slots} >= 2."
            )
        device = device if device is not None else os.environ.get("LM_RDMA_DEVICE", "")
        gid_index = gid_index if gid_index is not None else env_int("LM_RDMA_GID_INDEX", -1)
        self._engine = _native.RdmaEngine(
            self.label,
            self.rank,
            self.world_size,
            self.pool_bytes,
            device,
            int(port),
            int(gid_index),
            int(slot_bytes),
            int(slots),
        )

    @property
    def device_name(self) -> str:
        return self._engine.device_name

    def _connect(self, peers: list[int]) -> None:
        prefixes = {}
        for peer in peers:
            prefixes[peer] = prefix = self._pair_prefix(peer)
            self._publish(prefix, {"qp": self._engine.local_info(peer).hex()})
        for peer in peers:
            info = self._fetch(prefixes[peer], peer)
            self._engine.connect_peer(peer, bytes.fromhex(info["qp"]))
            self.store.set(f"{prefixes[peer]}/{self.rank}/ready", "1")
        # Both queue pairs must be ready to receive before either side sends.
        for peer in peers:
            self._fetch(prefixes[peer], peer, what="ready")  # noqa
