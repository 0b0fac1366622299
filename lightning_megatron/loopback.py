"""Loopback helpers shared by the rendezvous and the transports: what a job on one node binds to."""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["is_loopback", "loopback_interface"]


def loopback_interface() -> str:
    """The name of the network interface holding 127.0.0.1 ("lo" on Linux, "lo0" on macOS)."""
    try:
        import psutil

        for name, addresses in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
                return name
    except Exception:  # noqa: BLE001  (no psutil, or no permission: the usual name)
        pass
    return "lo"


def is_loopback(address: str) -> bool:
    """Whether ``address`` (IPv4, IPv6, IPv4-mapped IPv6, or "localhost") is a loopback address."""
    if address == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
