"""``ucx``: ranks on one host or many, over UCX (Unified Communication X), which picks the fabric itself.

The engine (``native/src/ucx_channel.*``) drives one UCP worker per transport from one progress thread and sends
every message as a UCP *active message*: the tag, a per-peer sequence number and the header travel in the AM
header, the payload straight from the tensor; the receiver files arrivals in the mailbox every native transport
shares (eager data copied into a pooled buffer, rendezvous data received straight into one). Workers exchange
their addresses through the job's rendezvous store (no ports); endpoints use UCX's peer error handling, so a
dead peer raises :class:`~lightning_megatron.transport.base.PeerLost`.

UCX is optional (the ``ucx`` extra: ``pip install 'lightning-megatron[ucx]'``, the ``libucx`` wheel). The native
extension is built against vendored UCP headers and loads ``libucp`` at run time (``dlopen``), so it builds
and imports without UCX; without it, creating this transport raises :class:`MegatronConfigError` naming the
extra. A system UCX (``libucp.so.0`` on the library path) is used where the wheel is not installed.

UCX chooses its transports from ``UCX_TLS`` and friends, which are left to the user (unset: UCX's own choice --
POSIX shared memory within a host, TCP across hosts, InfiniBand/RoCE where its libraries and devices exist;
``transports_to(peer)`` says what it chose). This transport changes two UCX defaults, each overridden by the
``UCX_*`` variable of the same name or a ``ucx_config`` entry: ``POSIX_ERROR_HANDLING=y`` (see
:data:`UCX_DEFAULTS`: without it UCX would use TCP loopback between ranks of one host) and ``KEEPALIVE_INTERVAL``
(20 s in UCX, ``keepalive_interval`` = 1 s here, so a dead peer on another host is noticed within seconds; a
peer on this host is also watched by its pid, noticed within ~0.1 s).

Host memory only (``devices = ("cpu",)``): UCX can move CUDA memory (the ``libucx-cu12`` wheel has its CUDA
transports), but the receive side here lands in host buffers, and no GPU path is written or tested yet.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.transport import find_libucp
from lightning_megatron.transport.base import TransportError, TransportTimeout
from lightning_megatron.transport.native import NativeTransport, _native, node_identity

__all__ = ["EXTRA", "UcxTransport", "load_ucx"]

EXTRA = "pip install 'lightning-megatron[ucx]'"

UCX_DEFAULTS = {
    # Peer error handling (needed to raise PeerLost instead of hanging) makes UCX drop shared memory unless the
    # transport says it supports it, and POSIX shared memory does when asked: its segments are files that stay
    # mapped after the peer dies. Without this, ranks on one host would talk over TCP loopback. (CMA's zero-copy
    # rendezvous stays off under error handling unless UCX_CMA_MEMORY_INVALIDATE=y; on the 2-core machine of
    # benchmarks/results/transport_cpu_ucx.json POSIX's pipelined copy-in/copy-out was the faster of the two.)
    "POSIX_ERROR_HANDLING": "y",
}
"""UCX settings this transport changes (a ``UCX_*`` environment variable or ``ucx_config`` entry wins)."""


def load_ucx() -> str:
    """Load UCX into this process once (the wheel's loader first: it honours RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY)
    and return its version; :class:`MegatronConfigError` naming the extra where there is none."""
    candidates = []
    try:
        import libucx

        loaded = [lib for lib in libucx.load_library() if lib is not None]
        candidates += [lib._name for lib in loaded if os.path.basename(lib._name).startswith("libucp.")]
    except ImportError:
        pass
    except OSError as exc:  # the wheel is there but its libraries do not load (wrong platform, say)
        candidates.append(f"<libucx: {exc}>")
    system = find_libucp()
    if system is not None:
        candidates.append(system)
    errors = []
    for path in candidates:
        if path.startswith("<"):
            errors.append(path)
            continue
        try:
            return _native.ucx_load(path)
        except TransportError as exc:
            errors.append(str(exc))
    raise MegatronConfigError(
        f"transport 'ucx' needs the UCX libraries: {EXTRA} (or a system UCX >= 1.18 with libucp.so.0 on the "
        f"library path). Tried: {'; '.join(errors)}"
    )


class UcxTransport(NativeTransport):
    """UCX active messages between ranks (one UCP worker and progress thread per transport, C++).

    ``ucx_config``: UCX settings for this transport's context, as ``{"TLS": "tcp"}`` or ``{"UCX_TLS": "tcp"}``
    (an environment variable of the same name wins). ``keepalive_interval``: seconds between UCX's liveness
    checks of each peer (how soon a killed peer is noticed where no transport reports it). ``spin_seconds``: how
    long the progress thread polls after an event before sleeping. ``close_timeout``: how long ``close`` waits
    for its goodbyes to be flushed.
    """

    name = "ucx"
    devices = ("cpu",)

    def __init__(
        self,
        *,
        ucx_config: Optional[Mapping[str, str]] = None,
        keepalive_interval: float = 1.0,
        spin_seconds: float = 20e-6,
        close_timeout: float = 5.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if keepalive_interval <= 0 or spin_seconds < 0 or close_timeout <= 0:
            raise MegatronConfigError(
                f"transport 'ucx': keepalive_interval={keepalive_interval} and close_timeout={close_timeout} must be "
                f"> 0 and spin_seconds={spin_seconds} >= 0 (seconds)."
            )
        settings = {name: (value, False) for name, value in UCX_DEFAULTS.items()}
        settings["KEEPALIVE_INTERVAL"] = (f"{float(keepalive_interval)}s", False)
        for key, value in (ucx_config or {}).items():
            if not isinstance(key, str) or not isinstance(value, (str, int, float)):
                raise MegatronConfigError(
                    f"transport 'ucx': ucx_config entry {key!r}: {value!r} must map a UCX setting name to a value, "
                    'e.g. {"TLS": "tcp"}.'
                )
            settings[key.upper().removeprefix("UCX_")] = (str(value), True)
        self.ucx_version = load_ucx()
        try:
            self._engine = _native.UcxEngine(
                self.label,
                self.rank,
                self.world_size,
                self.pool_bytes,
                float(spin_seconds),
                float(close_timeout),
                [(name, value, required) for name, (value, required) in sorted(settings.items())],
            )
        except ValueError as exc:  # a UCX setting UCX refused (unknown name or bad value)
            raise MegatronConfigError(f"{exc} (see `ucx_info -c` for UCX's settings)") from None

    def transports_to(self, peer: int) -> list[str]:
        """What UCX chose for the endpoint to ``peer``: ``"transport/device"`` per lane, e.g. ``["posix/memory"]``
        on one host, ``["tcp/eth0"]`` between hosts (empty where libucp cannot tell)."""
        self._check_peer(peer)
        return list(self._engine.transports(peer, self.timeout))

    def _connect(self, peers: list[int]) -> None:
        prefixes = {}
        for peer in peers:
            prefixes[peer] = prefix = self._pair_prefix(peer)
            self._publish(prefix, {"address": self._engine.address.hex(), "node": node_identity(), "pid": os.getpid()})
        for peer in peers:
            info = self._fetch(prefixes[peer], peer)
            pid = int(info["pid"]) if info["node"] == node_identity() else -1  # same host: watch its pid too
            self._engine.connect_peer(peer, bytes.fromhex(info["address"]), pid, self.timeout)
        for peer in peers:
            if not self._engine.wait_connected(peer, self.timeout):
                raise TransportTimeout(
                    f"{self.label}: no greeting from rank {peer} within {self.timeout:.1f} s (call connect([{self.rank}]) "
                    f"on rank {peer} too; can UCX reach it? check UCX_TLS / UCX_NET_DEVICES)."
                )
