"""One way from command-line flags, the environment and ``ftmesh.connect()`` arguments to the
configs of a member (``NodeConfig``, ``MeshConfig``, ``StartConfig``).

Theory of operation: a :class:`Settings` holds what a user can set; a field is ``None`` when
it was not given, and every other value, the empty string included, is a value (and is
checked). Layers are laid over each other, a later one winning wherever it gives a value:
a command's defaults (``ftmesh worker`` finds its peers by mDNS, ``ftmesh launch`` in a
private registry) < the environment (``FTMESH_*``, :meth:`Settings.from_env`) < explicit
values (flags, ``connect()`` arguments: :meth:`Settings.replace`). :meth:`Settings.to_env`
writes the given values back as ``FTMESH_*``: what ``ftmesh worker`` and ``ftmesh launch``
hand to the training script, whose ``ftmesh.connect()`` reads them.

:meth:`Settings.node_config` resolves what depends on the host and checks everything, raising
:class:`~ftmesh.errors.ConfigError` with a message that names the setting (its flag and
variable) and the fix:

* ``discovery``: ``seeds`` when seeds (``join``) are given, else the command's default
  (``local`` for ``connect()``).
* Addresses. With ``mdns`` the member announces one interface: ``interface``, by default the
  one behind the default route (or the only candidate; several and no default route is an
  error naming them, see ``ftmesh.discovery.interfaces``); gossip, the data plane and the
  state server bind to it, or to ``0.0.0.0`` while advertising it. With ``seeds`` the
  address must be one the seeds can reach: loopback only when every seed is loopback, else
  the LAN address chosen as for mDNS. ``local`` binds loopback. A member never advertises an
  address its peers cannot reach: a loopback address towards remote seeds, or another one
  than the interface mDNS announces, is refused. Binding and advertising are separate: with
  ``seeds`` or ``local`` discovery ``advertise`` may be an address this machine does not own
  (a NAT's, a port forward's); the listeners still bind ``bind``.
* Ports: ``port`` (gossip, UDP and TCP), ``data_port`` (the data plane) and ``state_port``
  (the state server), each 0 (any free one) by default; fixed ones are what a port forward,
  a firewall rule or a Kubernetes NetworkPolicy can name.
* The secret: ``secret_file`` (one per line), else ``secret`` (``$FTMESH_SECRET``).

Only the CLI and ``connect()`` call :meth:`Settings.from_env`: library constructors never read
the environment.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .discovery.base import check_mesh_name
from .discovery.interfaces import (
    candidates,
    check_local_address,
    default_interface_ip,
    interface_address,
    is_loopback,
)
from .discovery.seeds import parse_seed
from .errors import ConfigError
from .membership.config import PRESETS, MembershipConfig
from .membership.messages import Meta, MetaValue
from .mesh.core import MeshConfig
from .net.node import NodeConfig
from .security import MeshAuth, load_secrets
from .training.start import StartConfig

DEFAULT_MESH = "default"
DEFAULT_PRESET = "lan"
DISCOVERY_KINDS = ("local", "seeds", "mdns", "none")
EXPECT_KEY = "expect"
"""Member metadata key: the ``start_peers`` a member was told to expect (``ftmesh status``
warns when a mesh holds fewer)."""

ENV = {
    "mesh": "FTMESH_MESH",
    "discovery": "FTMESH_DISCOVERY",
    "join": "FTMESH_JOIN",
    "interface": "FTMESH_INTERFACE",
    "bind": "FTMESH_BIND",
    "advertise": "FTMESH_ADVERTISE",
    "port": "FTMESH_PORT",
    "data_port": "FTMESH_DATA_PORT",
    "state_port": "FTMESH_STATE_PORT",
    "site": "FTMESH_SITE",
    "preset": "FTMESH_PRESET",
    "secret_file": "FTMESH_SECRET_FILE",
    "secret": "FTMESH_SECRET",
    "encrypt": "FTMESH_ENCRYPT",
    "registry_dir": "FTMESH_REGISTRY_DIR",
    "name": "FTMESH_NAME",
    "meta": "FTMESH_META",
    "start_peers": "FTMESH_START_PEERS",
    "start_timeout": "FTMESH_START_TIMEOUT",
    "join_running": "FTMESH_JOIN_RUNNING",
    "metrics_port": "FTMESH_METRICS_PORT",
    "log_level": "FTMESH_LOG_LEVEL",
    "log_format": "FTMESH_LOG_FORMAT",
}
"""The environment variable of every setting. Lists (``join``, ``meta``) are comma-separated;
booleans are ``1/true/yes/on`` or ``0/false/no/off``."""
PORT_SETTINGS = ("port", "data_port", "state_port", "metrics_port")
"""A member's TCP listeners' port settings (gossip first): fixed ones must differ."""
_NO_FLAG = ("secret", "join_running")  # set through the environment (or connect()) only


def label(name: str) -> str:
    """How a message names setting ``name``: ``port (--port, $FTMESH_PORT)``."""
    flag = "" if name in _NO_FLAG else f"--{name.replace('_', '-')}, "
    return f"{name} ({flag}${ENV[name]})"


def parse_meta(items: Sequence[str], setting: str = "meta") -> Meta:
    """``["k=v", "n=3"]`` as member metadata (digits become ints)."""
    meta: Meta = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{label(setting)} expects KEY=VALUE, got {item!r}")
        value: MetaValue = raw
        if raw.lstrip("-").isdigit():
            value = int(raw)
        meta[key] = value
    return meta


def _parse_bool(name: str, raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"${ENV[name]} must be 1/true/yes/on or 0/false/no/off, got {raw!r}")


def _parse_number(name: str, raw: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"${ENV[name]} must be {what}, got {raw!r}") from None


@dataclass(frozen=True, slots=True)
class Settings:
    """What a user can set for a member; ``None`` = not given. See the module docstring."""

    mesh: str | None = None
    """Mesh name (default ``default``): members of different meshes never merge."""
    discovery: str | None = None
    """``local``, ``seeds``, ``mdns`` or ``none``."""
    join: tuple[str, ...] | None = None
    """Seeds: ``HOST:PORT`` of members, or DNS names resolving to several."""
    interface: str | None = None
    """For ``mdns``: the interface (IPv4 address or name) to announce and browse on; for the
    others, the address to bind when ``bind`` is not given."""
    bind: str | None = None
    """Address gossip, the data plane and the state server bind (``0.0.0.0``: all)."""
    advertise: str | None = None
    """Address peers reach this member on (default: the bound one); with ``seeds`` or
    ``local`` discovery it may be one this machine does not own (NAT, port forwarding)."""
    port: int | None = None
    """Gossip port, UDP and TCP (0: any free one)."""
    data_port: int | None = None
    """Data-plane (collectives) TCP port (0, the default: any free one)."""
    state_port: int | None = None
    """State-transfer server TCP port (0, the default: any free one)."""
    site: str | None = None
    """This member's site (``eu-west-1a``, ``lab``): members with the same label are kept
    adjacent on the ring and reduce together first (``ftmesh.collective.topology``); labels
    win over measured round trips. Unset: the sites are measured."""
    preset: str | None = None
    """Membership timing: ``local``, ``lan`` (default) or ``wan``."""
    secret_file: str | None = None
    """File holding the mesh secret(s), one per line; the first signs, all verify."""
    secret: str | None = field(default=None, repr=False)
    """The mesh secret itself (``$FTMESH_SECRET``), when there is no file."""
    encrypt: bool | None = None
    """Also encrypt gossip and the data plane (needs a secret)."""
    registry_dir: str | None = None
    """For ``local``: the registry directory (default ``/tmp/ftmesh-$UID``)."""
    name: str | None = None
    """Human name of the member (default ``hostname-pid``)."""
    meta: Meta | None = None
    """Extra member metadata."""
    start_peers: int | None = None
    """A fresh mesh takes its first step once this many members are ready (1: no wait)."""
    start_timeout: float | None = None
    """Seconds to wait for them (default 60); see ``ftmesh.training.start``."""
    join_running: bool | None = None
    """Only join a mesh that is training; never start one (``ftmesh launch`` sets it for the
    workers it adds to a running mesh)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics at ``http://BIND:PORT/metrics`` (0: any free port); unset:
    off (``ftmesh.metrics``)."""
    log_level: str | None = None
    """Level of ftmesh's own log on stderr: debug, info, warning (default), error."""
    log_format: str | None = None
    """``text`` (default) or ``json``, one object per line (``ftmesh.logs``)."""

    # ------------------------------------------------------------------ layers

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        """The settings ``FTMESH_*`` variables give (a variable that is set, even to the
        empty string, gives a value)."""
        values: dict[str, Any] = {}
        for name, var in ENV.items():
            raw = environ.get(var)
            if raw is None:
                continue
            if name == "join":
                values[name] = tuple(j.strip() for j in raw.split(",") if j.strip())
            elif name == "meta":
                values[name] = parse_meta([m for m in raw.split(",") if m], name)
            elif name in ("encrypt", "join_running"):
                values[name] = _parse_bool(name, raw)
            elif name in ("port", "data_port", "state_port", "start_peers", "metrics_port"):
                values[name] = _parse_number(name, raw, int)
            elif name == "start_timeout":
                values[name] = _parse_number(name, raw, float)
            else:
                values[name] = raw
        return cls(**values)

    def replace(self, **explicit: Any) -> Settings:
        """These settings with the given values laid over them (``None``: not given)."""
        given = {k: v for k, v in explicit.items() if v is not None}
        if isinstance(given.get("join"), str):
            raise ConfigError(f"{label('join')} must be a list of HOST:PORT, not one string")
        if "join" in given:
            given["join"] = tuple(given["join"])
        if "meta" in given:
            given["meta"] = dict(given["meta"])
        try:
            return dataclasses.replace(self, **given)
        except TypeError as exc:
            raise ConfigError(f"unknown setting: {exc}") from None

    def over(self, other: Settings) -> Settings:
        """``other``'s values laid over these."""
        return self.replace(**{f.name: getattr(other, f.name) for f in dataclasses.fields(other)})

    def to_env(self) -> dict[str, str]:
        """The ``FTMESH_*`` variables that give these settings (given ones only)."""
        out = {}
        for name, var in ENV.items():
            value = getattr(self, name)
            if value is None:
                continue
            if name == "join":
                out[var] = ",".join(value)
            elif name == "meta":
                out[var] = ",".join(f"{k}={v}" for k, v in value.items())
            elif isinstance(value, bool):
                out[var] = "1" if value else "0"
            else:
                out[var] = str(value)
        return out

    # ------------------------------------------------------------------ resolved values

    def discovery_kind(self, default: str = "local") -> str:
        """The discovery to use: the one given, else ``seeds`` with seeds, else ``default``."""
        if self.discovery is not None:
            if self.discovery not in DISCOVERY_KINDS:
                raise ConfigError(
                    f"{label('discovery')} must be one of {', '.join(DISCOVERY_KINDS)}, "
                    f"got {self.discovery!r}"
                )
            return self.discovery
        return "seeds" if self.join else default

    def auth(self) -> MeshAuth:
        """Authentication (and encryption) from the secret file or the secret."""
        if self.secret_file == "":
            raise ConfigError(f"{label('secret_file')} is empty; give a file or leave it unset")
        return load_secrets(self.secret_file, bool(self.encrypt), self.secret)

    def start_config(self) -> StartConfig:
        """How this member starts: the values given laid over ``StartConfig``'s defaults
        (``ftmesh.training.start`` owns them); a bad one raises ``ConfigError`` naming the
        flag or variable."""
        if self.start_peers is not None and self.start_peers < 0:
            raise ConfigError(f"{label('start_peers')} must be 0 or more, got {self.start_peers}")
        if self.start_timeout is not None and not self.start_timeout > 0:
            raise ConfigError(
                f"{label('start_timeout')} must be positive, got {self.start_timeout}"
            )
        return StartConfig().overlay(self.start_peers, self.start_timeout, bool(self.join_running))

    def seeds(self) -> tuple[str, ...]:
        """The seeds, each checked."""
        for j in self.join or ():
            try:
                parse_seed(j)
            except ConfigError as exc:
                raise ConfigError(f"{label('join')}: {exc}") from None
        return self.join or ()

    def node_config(self, default_discovery: str = "local") -> NodeConfig:
        """The member's node config; raises ``ConfigError`` naming the setting at fault."""
        for name in ("mesh", "interface", "bind", "advertise", "registry_dir", "name"):
            if getattr(self, name) == "":
                raise ConfigError(f"{label(name)} is empty; give a value or leave it unset")
        mesh = DEFAULT_MESH if self.mesh is None else self.mesh
        try:
            check_mesh_name(mesh)
        except ConfigError as exc:
            raise ConfigError(f"{label('mesh')}: {exc}") from None
        preset = DEFAULT_PRESET if self.preset is None else self.preset
        if preset not in PRESETS:
            raise ConfigError(
                f"{label('preset')} must be one of {', '.join(PRESETS)}, got {preset!r}"
            )
        port = self._ports()
        kind = self.discovery_kind(default_discovery)
        join = self.seeds()
        auth = self.auth()
        start = self.start_config()
        interface, bind, advertise = self._addresses(kind, join)  # what depends on the host last
        meta = dict(self.meta or {})
        if start.start_peers > 1:
            meta[EXPECT_KEY] = start.start_peers
        return NodeConfig(
            mesh=mesh,
            name=self.name or "",
            bind=bind,
            port=port,
            advertise=advertise,
            discovery=kind,
            join=join,
            interface=interface,
            membership=MembershipConfig.preset(preset),
            auth=auth,
            meta=meta,
            registry_dir=self.registry_dir or "",
            metrics_port=self.metrics_port,
        )

    def configure_logging(self, default_level: str | int = "warning") -> None:
        """Set up ftmesh's log (``ftmesh.logs``) as these settings say."""
        from .logs import configure

        level = default_level if self.log_level is None else self.log_level
        try:
            configure(level, "text" if self.log_format is None else self.log_format)
        except ConfigError as exc:
            name = "log_format" if "format" in str(exc) else "log_level"
            raise ConfigError(f"{label(name)}: {exc}") from None

    def mesh_config(self, role: str = "train", default_discovery: str = "local") -> MeshConfig:
        """The member's mesh config (its node config, its data and state ports, ``role``)."""
        return MeshConfig(
            node=self.node_config(default_discovery),
            role=role,
            data_port=self.data_port or 0,
            state_port=self.state_port or 0,
            site=self.site or "",
        )

    def _ports(self) -> int:
        """Check every port setting; the gossip port (0 when not given)."""
        names = PORT_SETTINGS
        given: dict[str, int] = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        for name, value in given.items():
            if not 0 <= value < 65536:
                raise ConfigError(f"{label(name)} must be within 0..65535, got {value}")
        fixed = [n for n in names if given.get(n)]  # 0 picks a free port: never a clash
        for i, a in enumerate(fixed):
            for b in fixed[i + 1 :]:
                if given[a] == given[b]:
                    raise ConfigError(
                        f"{label(a)} and {label(b)} are both {given[a]}: each listener needs "
                        "a port of its own"
                    )
        return given.get("port", 0)

    # ------------------------------------------------------------------ addresses

    def _interface_ip(self) -> str | None:
        if self.interface is None:
            return None
        return interface_address(self.interface, label("interface"))

    def _bind_ip(self) -> str | None:
        if self.bind is not None and self.bind != "0.0.0.0":
            check_local_address(self.bind, label("bind"))
        return self.bind

    def _advertise_ip(self) -> str | None:
        if self.advertise is not None:
            try:
                ipaddress.IPv4Address(self.advertise)
            except ValueError:
                raise ConfigError(
                    f"{label('advertise')} must be an IPv4 address, got {self.advertise!r}"
                ) from None
        return self.advertise

    def mdns_interface(self) -> str:
        """The address mDNS announces and browses on (see the module docstring)."""
        iface = self._interface_ip()
        ip = iface if iface is not None else default_interface_ip(label("interface"))
        if ipaddress.IPv4Address(ip).is_loopback:
            raise ConfigError(
                f"{label('interface')} {ip} is loopback: mDNS cannot reach other hosts "
                "through it; use 'local' discovery on one host, or pass a LAN address"
            )
        return ip

    def _addresses(self, kind: str, join: tuple[str, ...]) -> tuple[str, str, str]:
        """(mDNS interface or "", bind, advertise) for discovery ``kind``."""
        bind, advertise = self._bind_ip(), self._advertise_ip()
        if kind == "mdns":
            ip = self.mdns_interface()
            bind = ip if bind is None else bind
            if bind not in (ip, "0.0.0.0"):
                raise ConfigError(
                    f"{label('bind')} {bind} differs from the mDNS interface address {ip}: "
                    "peers would be told an address this member does not listen on; drop "
                    f"--bind, or pass --interface {bind}"
                )
            if advertise not in (None, ip):
                raise ConfigError(
                    f"{label('advertise')} {advertise} differs from the mDNS interface address "
                    f"{ip}, the one mDNS announces; drop --advertise"
                )
            return ip, bind, ip
        iface = self._interface_ip()
        if kind == "local":
            bind = (iface or "127.0.0.1") if bind is None else bind
            return "", bind, advertise or ("127.0.0.1" if bind == "0.0.0.0" else bind)
        remote = [s for s in join if not is_loopback(parse_seed(s)[0])]
        if bind is None:
            bind = iface if iface is not None else self._reachable(join, remote)
        if advertise is None:
            advertise = self._reachable(join, remote) if bind == "0.0.0.0" else bind
        if remote and is_loopback(advertise):
            raise ConfigError(
                f"{label('bind')} {advertise} is loopback, but seeds such as {remote[0]} are "
                "on other hosts and could not reach this member; bind (or --advertise) this "
                "host's LAN address"
            )
        return "", bind, advertise

    @staticmethod
    def _reachable(join: tuple[str, ...], remote: list[str]) -> str:
        """The address seeds reach us on: loopback when every seed is loopback, else the LAN
        address (the interface behind the default route)."""
        if join and not remote:
            return "127.0.0.1"
        if not remote and not candidates():
            return "127.0.0.1"  # the first member on a host without a LAN: nothing else
        return default_interface_ip(label("bind"))
