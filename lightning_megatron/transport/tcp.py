"""``tcp``: ranks on any hosts, over TCP connections (one per pair of ranks).

Each transport listens on port 0 of the address peers can reach -- ``ifaddr``, else ``LM_TRANSPORT_IFADDR``,
else the local address of the route to ``MASTER_ADDR`` (127.0.0.1 when that is this host or unset), never the
unspecified (all-interfaces) address -- and publishes ``address:port`` and a random 32-byte token through the rendezvous store. The lower
rank of a pair connects and presents the token; connections without it are dropped.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
from typing import Any, Optional

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.transport.native import NativeTransport, _native

__all__ = ["TcpTransport", "default_ifaddr"]


def default_ifaddr(master_addr: Optional[str] = None) -> str:
    """The local address used to reach ``master_addr`` (default: env ``MASTER_ADDR``); 127.0.0.1 if none."""
    override = os.environ.get("LM_TRANSPORT_IFADDR")
    if override:
        return override
    master = master_addr if master_addr is not None else os.environ.get("MASTER_ADDR", "")
    if not master:
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)
    except OSError:
        return "127.0.0.1"
    for family, _, _, _, addr in infos:
        if ipaddress.ip_address(addr[0]).is_loopback:
            return addr[0]
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)  # UDP: no packet is sent; the kernel only picks the route and source address
                return s.getsockname()[0]
        except OSError:
            continue
    return "127.0.0.1"


class TcpTransport(NativeTransport):
    """Non-blocking TCP between ranks (epoll progress thread in C++).

    ``ifaddr``: address to listen on (see module docs). ``socket_buffer``: SO_SNDBUF/SO_RCVBUF bytes.
    """

    name = "tcp"
    devices = ("cpu",)

    def __init__(
        self,
        *,
        ifaddr: Optional[str] = None,
        socket_buffer: int = 4 << 20,
        handshake_timeout: float = 10.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.ifaddr = ifaddr or default_ifaddr()
        try:
            ip = ipaddress.ip_address(self.ifaddr)
        except ValueError:
            raise MegatronConfigError(
                f"transport 'tcp': ifaddr={self.ifaddr!r} is not an IP address: pass an address of this host that the "
                "other ranks can reach (argument `ifaddr` or env LM_TRANSPORT_IFADDR)."
            ) from None
        if ip.is_unspecified:
            raise MegatronConfigError(
                f"transport 'tcp': ifaddr={self.ifaddr!r} would listen on every interface: pass the address of the "
                "interface the other ranks reach this host on."
            )
        self._token = secrets.token_bytes(32)
        self._engine = _native.TcpEngine(
            self.label,
            self.rank,
            self.world_size,
            self.ifaddr,
            self._token,
            self.pool_bytes,
            int(socket_buffer),
            float(handshake_timeout),
        )

    @property
    def address(self) -> tuple[str, int]:
        """``(ip, port)`` this transport listens on."""
        return self.ifaddr, self._engine.port

    @property
    def rejected_connections(self) -> int:
        """Connections dropped for a wrong token, a bad hello or a handshake timeout."""
        return self._engine.rejected

    def _connect(self, peers: list[int]) -> None:
        prefixes = {}
        for peer in peers:
            prefixes[peer] = prefix = self._pair_prefix(peer)
            if peer < self.rank:
                self._engine.expect(peer)  # before publishing: the peer may connect as soon as it reads this
            self._publish(prefix, {"ip": self.ifaddr, "port": self._engine.port, "token": self._token.hex()})
        for peer in peers:
            if peer > self.rank:
                info = self._fetch(prefixes[peer], peer)
                self._engine.connect_peer(
                    peer, info["ip"], int(info["port"]), bytes.fromhex(info["token"]), self.timeout
                )
        for peer in peers:
            if peer < self.rank and not self._engine.wait_connected(peer, self.timeout):
                from lightning_megatron.transport.base import TransportTimeout

                raise TransportTimeout(
                    f"{self.label}: rank {peer} did not connect within {self.timeout:.1f} s (call connect([{self.rank}]) "
                    f"on rank {peer} too; can it reach {self.ifaddr}:{self._engine.port}? set LM_TRANSPORT_IFADDR otherwise)."
                )
