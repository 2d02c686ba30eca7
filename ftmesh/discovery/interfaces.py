"""Which address of this host peers on the LAN can reach: the interface behind the default
route, or the only candidate there is.

Theory of operation: a member announces one address (mDNS) or tells it to its seeds, so that
address must be one the others can reach. The default is the IPv4 address of the interface
that holds the default route (read from ``/proc/net/route`` of this network namespace, the
lowest metric first): on a LAN machine that is the LAN. Without a default route, the single
non-loopback interface that is up is just as clear; several of them are not, and the user is
told which there are and how to pick one. A host with nothing but loopback has no LAN at all.

Interfaces are listed with two ``ioctl`` calls per interface (flags, primary IPv4 address),
so nothing is sent and no extra package is needed. Linux only, like the rest of ftmesh.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_IFNAMSIZ = 16
ROUTE_TABLE = Path("/proc/net/route")
"""The kernel's IPv4 routing table of this network namespace."""


@dataclass(frozen=True, slots=True)
class Interface:
    """One network interface of this host with an IPv4 address."""

    name: str
    ip: str
    up: bool
    loopback: bool

    def __str__(self) -> str:
        return f"{self.name} {self.ip}"


def _ioctl(sock: socket.socket, request: int, name: str) -> bytes | None:
    try:
        return fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None


def interfaces() -> list[Interface]:
    """Every interface of this host that has an IPv4 address, in kernel index order."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            addr = _ioctl(s, _SIOCGIFADDR, name)
            flags = _ioctl(s, _SIOCGIFFLAGS, name)
            if addr is None or flags is None:
                continue  # no IPv4 address (or it vanished meanwhile)
            bits = struct.unpack_from("H", flags, _IFNAMSIZ)[0]
            ip = socket.inet_ntoa(addr[20:24])
            out.append(Interface(name, ip, bool(bits & _IFF_UP), bool(bits & _IFF_LOOPBACK)))
    return out


def candidates() -> list[Interface]:
    """Interfaces other hosts could reach us on: up, not loopback."""
    return [i for i in interfaces() if i.up and not i.loopback]


def default_route_interface(table: Path = ROUTE_TABLE) -> str | None:
    """Name of the interface holding the IPv4 default route (lowest metric), or None."""
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        f = line.split()
        if len(f) < 8 or f[1] != "00000000" or f[7] != "00000000":
            continue  # not 0.0.0.0/0
        if not int(f[3], 16) & 0x1:  # RTF_UP
            continue
        metric = int(f[6])
        if best is None or metric < best[0]:
            best = (metric, f[0])
    return None if best is None else best[1]


def default_interface_ip(setting: str = "interface_ip") -> str:
    """The IPv4 address other hosts of the LAN reach us on (see the module docstring).

    ``setting`` names the knob the error messages tell the user to set. Raises
    :class:`ConfigError` when there is no such address or when several interfaces qualify
    and no default route says which.
    """
    found = candidates()
    route = default_route_interface()
    if route is not None:
        for i in found:
            if i.name == route:
                return i.ip
    if len(found) == 1:
        return found[0].ip
    if not found:
        raise ConfigError(
            "this host has no network interface but loopback, so there is no LAN to discover "
            f"members on; use 'local' discovery (same host) or 'seeds', or set {setting}"
        )
    names = ", ".join(str(i) for i in found)
    raise ConfigError(
        f"no default route to tell which interface is the LAN, and there are several "
        f"({names}); set {setting} to one of them"
    )


def interface_address(value: str, setting: str) -> str:
    """The IPv4 address ``value`` names: an address of this host, or an interface name.

    Raises :class:`ConfigError` naming ``setting`` when it is neither."""
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        for i in interfaces():
            if i.name == value:
                return i.ip
        names = ", ".join(str(i) for i in interfaces()) or "none"
        raise ConfigError(
            f"{setting} {value!r} is neither an IPv4 address nor an interface of this host "
            f"(interfaces: {names})"
        ) from None
    check_local_address(value, setting)
    return value


def check_local_address(ip: str, setting: str) -> None:
    """Raise :class:`ConfigError` naming ``setting`` unless ``ip`` is an IPv4 address of this
    host (or 0.0.0.0): one a socket can bind."""
    try:
        ipaddress.IPv4Address(ip)
    except ValueError:
        raise ConfigError(f"{setting} {ip!r} is not an IPv4 address") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError as e:
            names = ", ".join(str(i) for i in interfaces())
            raise ConfigError(
                f"{setting} {ip} is not an address of this host ({e.strerror}); "
                f"this host has {names}"
            ) from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IPv4 literal or a name) means this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        return False
