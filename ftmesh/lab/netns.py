"""A virtual LAN of Linux network namespaces, for multicast, partition and loss tests.

Theory of operation: ``VirtualLan(hosts=N)`` creates N namespaces ``<prefix>h<i>``, each with a
veth pair whose other end is a port of a Linux bridge living in its own namespace
``<prefix>br``. Every interface is created directly inside a lab namespace (``ip link add ...
netns ...``), so nothing is ever created in, attached to or changed on the host's root
namespace: traffic between lab hosts cannot leave the lab. Each host gets ``lo`` up, one
address from ``subnet`` on ``eth0``, a default route and a 224.0.0.0/4 route through ``eth0``
(so mDNS and :func:`ftmesh.discovery.default_interface_ip` work with zero configuration); the
bridge has multicast snooping off so multicast floods to every port.

Faults are injected on host ``i``'s link: ``link(i, up=False)`` takes the bridge port down
(both ends lose carrier, like a pulled cable); ``set_rate`` installs tbf on the egress of *both*
ends of the veth pair, so each direction passes through exactly one of them; ``set_loss`` drops
frames to and from host ``i``'s port at random with nftables in the bridge's forward hook
(invisible to senders, like loss on a real LAN), because not every kernel has ``sch_netem``.
``set_lan_loss`` does the same for every frame the bridge forwards (end-to-end loss between any
two hosts), ``partition`` drops every frame between hosts of different groups (unicast,
multicast and ARP alike), ``one_way`` drops the IPv4 packets from one host to another (not
ARP, not the other direction: a one-way link, where UDP still flows the other way and gossip
reaches both through a third host, but no TCP connection can open either way) and
``block_port`` drops the TCP segments to one port of one host (a firewall in front of a port),
all in the same nftables table, so one atomic ``nft -f`` script always describes the whole
fault state. Slowness of the host itself (``ftmesh.lab.slowness``):
``set_cpu`` throttles host ``i``'s processes to a CPU share with a cgroup quota (those started
later with ``popen``/``run`` too); ``set_fail_slow`` freezes them with SIGSTOP for ``stop_s``
every ``every_s`` seconds (a pulser process); ``cpu_stats``/``fail_slow_stats`` say what the
kernel and the pulser did, so a test can check that the fault fired.

Two sites (``sites=(2, 2)``, ``wan=WanLink(rate="20mbit", delay_ms=40)``): the hosts are split
over two bridges, site 0's in namespace ``<prefix>br`` and site 1's in ``<prefix>br1``, each
site on its half of ``subnet``. Each site has a router namespace ``<prefix>r<s>`` with a leg on
its bridge (the site's gateway, the last address of its half: the hosts' default route) and a
TUN device; the only path between the sites is the WAN link, a user-space forwarder process
between the two TUNs that gives it a rate, a one-way delay, loss and a drop-tail queue
(``ftmesh.lab.wan``, which also says why not netem). ``site_of(i)`` says where host ``i`` is,
``set_wan`` changes the link at run time, ``wan_stats`` counts what crossed it each way. mDNS
stays within a site (multicast is not routed), as between real sites: across them, members
find each other with seeds. Host faults act on the host's own bridge; a partition or one-way
link between hosts of different sites drops their IPv4 packets at the sender's bridge;
``set_lan_loss`` applies on each bridge (a path across the WAN crosses two).

Persistent labs (``ftmesh lab up``): ``VirtualLan(name=...)`` uses a fixed prefix instead of
the pid-bound one, :meth:`VirtualLan.detach` keeps it alive after this process exits, and
:meth:`VirtualLan.to_state` / :meth:`VirtualLan.attach` carry it to a later process.

Cleanup: ``down()`` signals every process left in the namespaces and deletes them; it is
idempotent and runs on ``__exit__``, on a failed construction and at interpreter exit. A run
killed with SIGKILL cannot clean up, so the creating pid is part of every name
(``<base><pid>x<n>``) and :func:`cleanup_stale` removes namespaces whose creator is dead; the
constructor calls it for its own base prefix. Pids are reused (``pid_max`` may be 32768), so a
killed creator's leftovers can carry the pid of a live process: those carrying this process's
own pid but made by none of its labs are stale too, and are removed before this process names
a lab (else its ``<base><pid>x0`` could be taken). Two labs alive at once never share a name:
their creators' pids differ, or their counters do.

Requires root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's ``ip``; ``tc`` and ``sch_tbf``
for ``set_rate``; ``nft`` (package ``nftables``) and ``nft_numgen`` for ``set_loss``; TUN
devices (``/dev/net/tun``) and ``sysctl`` for two sites.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from .errors import LabError
from .wan import (
    TUN_DEV,
    WanLink,
    WanStats,
    control_request,
    start_forwarder,
    stop_forwarder,
)

DEFAULT_BASE = "ftm"
"""Default base of lab names. :func:`cleanup_stale` only touches names under a given base."""

MAX_HOSTS = 200
"""Hosts in one lab. Each costs a namespace and about eight ``ip`` calls to set up."""

CMD_TIMEOUT = 15.0
"""Seconds allowed for one ``ip``/``tc`` call. They normally take milliseconds."""

_BASE_RE = re.compile(r"[a-z][a-z0-9]{0,7}")
_NAME_RE = re.compile(r"[a-z][a-z0-9]{0,11}")
_HOST_IF = "eth0"  # inside each host namespace
_BRIDGE_IF = "br0"  # inside the bridge namespace
_NFT_TABLE = "ftmlab"  # nftables table holding loss rules, inside the bridge namespace
_ROUTER_PORT = "gw"  # a router's port on its site's bridge (two-site labs)
_KINDS = r"(?:br\d*|r\d+|h\d+)"  # namespaces of a lab: bridges, routers, hosts
_counter = itertools.count()
_made: set[str] = set()  # prefixes of the pid-bound labs this process named (never removed)
_live: set[VirtualLan] = set()  # strong refs: a lab dropped without down() is still cleaned
_live_lock = threading.Lock()


_RATE_RE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)")
_UNIT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def _burst_bytes(rate: str) -> int:
    """tbf bucket size: 10 ms worth of ``rate``, at least 2 full-size frames."""
    m = _RATE_RE.fullmatch(rate)
    assert m is not None
    bits = float(m.group(1)) * _UNIT[m.group(2)] * (8 if m.group(3) == "bps" else 1)
    return max(3200, int(bits / 8 / 100))


def _site_addresses(
    net: ipaddress.IPv4Network, sites: Sequence[int]
) -> list[ipaddress.IPv4Address]:
    """Host addresses of a two-site lab: site ``s``'s from the start of half ``s`` of ``net``
    (its last address is the site's gateway)."""
    if net.prefixlen > 29:
        raise LabError(f"subnet {net} is too small to split into two sites")
    addrs = []
    for half, count in zip(net.subnets(prefixlen_diff=1), sites, strict=True):
        got = list(itertools.islice(half.hosts(), count))
        if count + 1 > half.num_addresses - 2:
            raise LabError(f"site subnet {half} cannot hold {count} hosts and a gateway")
        addrs += got
    return addrs


def is_root() -> bool:
    """Whether this process runs as root (needed to create network namespaces)."""
    return os.geteuid() == 0


def _require_tools() -> None:
    if not is_root():
        raise LabError("creating network namespaces needs root (run the lab as root)")
    if shutil.which("ip") is None:
        raise LabError("the 'ip' command (iproute2) is not installed")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _cmd(["ip", *args], check=check)


def _cmd(
    argv: Sequence[str], *, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(
            list(argv),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=CMD_TIMEOUT,
            check=False,
        )
    except FileNotFoundError as e:
        raise LabError(f"{argv[0]} is not installed") from e
    except subprocess.TimeoutExpired as e:
        raise LabError(f"{' '.join(argv)} took over {CMD_TIMEOUT}s") from e
    if check and p.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _list_netns() -> list[str]:
    p = _ip("netns", "list", check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    p = _ip("netns", "pids", ns, check=False)
    return [int(t) for t in p.stdout.split() if t.isdigit()]


def _kill_netns(ns: str, sig: int) -> int:
    n = 0
    for pid in _netns_pids(ns):
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, sig)
            n += 1
        except ProcessLookupError:
            pass
    return n


def _delete_netns(ns: str) -> None:
    # A namespace only disappears once its last process has exited: kill them first.
    _kill_netns(ns, signal.SIGKILL)
    _ip("netns", "del", ns, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = DEFAULT_BASE) -> list[str]:
    """Delete lab namespaces under base ``prefix`` whose creating process is dead (or whose
    pid is this process's while none of its labs made them: an earlier process's, pid reused).

    Names look like ``<prefix><pid>x<n>h<i>`` / ``<prefix><pid>x<n>br`` (and ``br1``,
    ``r0``, ``r1`` for two sites); namespaces of live
    processes (other test workers) are left alone. Returns the names removed. Every interface of
    a lab lives inside its namespaces, so deleting them removes the links too, and the
    processes in them (a two-site lab's WAN forwarder lives in its router ``r0``).
    """
    _require_tools()
    pattern = re.compile(rf"({re.escape(prefix)}(\d+)x\d+){_KINDS}")
    me = os.getpid()
    removed = []
    for ns in _list_netns():
        m = pattern.fullmatch(ns)
        if m is None:
            continue
        pid = int(m.group(2))
        stale = m.group(1) not in _made if pid == me else not _pid_alive(pid)
        if stale:
            _delete_netns(ns)
            removed.append(ns)
    _remove_stale_cgroups(rf"{re.escape(prefix)}\d+x\d+h\d+")
    return removed


def _remove_stale_cgroups(pattern: str) -> None:
    """CPU cgroups (``set_cpu``) of host namespaces named like ``pattern`` that are gone."""
    from . import slowness  # (lazy: `-m ftmesh.lab.slowness` runs it)

    slowness.cleanup_stale_cgroups(_list_netns(), pattern)


def _owned_by(prefix: str, ns: str) -> bool:
    return re.fullmatch(rf"{re.escape(prefix)}{_KINDS}", ns) is not None


def cleanup_named(name: str) -> list[str]:
    """Delete every namespace of the persistent lab ``name`` (``VirtualLan(name=...)``),
    whatever state it was left in. Returns the names removed."""
    _require_tools()
    if not _NAME_RE.fullmatch(name):
        raise LabError(f"lab name {name!r} must match {_NAME_RE.pattern}")
    removed = []
    # Hosts and routers before the bridges (any order works: this one is the tidiest).
    for ns in sorted(_list_netns(), key=lambda n: re.search(r"br\d*$", n) is not None):
        if _owned_by(name, ns):
            _delete_netns(ns)
            removed.append(ns)
    _remove_stale_cgroups(rf"{re.escape(name)}h\d+")
    return removed


class VirtualLan:
    """N hosts on one bridged virtual LAN, or on two sites joined by a WAN link. See the
    module docstring.

    ``hosts``: number of host namespaces (default 2, or ``sum(sites)``). ``prefix``: base of
    the names (lowercase letter then up to 7 lowercase letters or digits; default ``"ftm"``);
    the creating pid and a counter are appended, giving :attr:`prefix`. ``subnet``: IPv4
    subnet; host ``i`` gets its ``i+1``-th address. ``name``: a fixed prefix instead
    (persistent labs, see :meth:`detach`); refused if a lab of that name exists.

    ``sites``: host counts of two sites, e.g. ``(2, 2)``: hosts ``0..sites[0]-1`` are on site
    0, the rest on site 1; each site gets one half of ``subnet`` (host addresses from the
    start of its half, the gateway at its end). ``wan``: the link between them
    (:class:`~ftmesh.lab.wan.WanLink`; default: no rate limit, no delay). Without ``sites``
    the lab is one bridge, as before, and ``wan`` must be left out.
    """

    def __init__(
        self,
        hosts: int | None = None,
        prefix: str | None = None,
        subnet: str = "10.77.0.0/24",
        *,
        name: str | None = None,
        sites: Sequence[int] | None = None,
        wan: WanLink | None = None,
    ) -> None:
        base = DEFAULT_BASE if prefix is None else prefix
        if not _BASE_RE.fullmatch(base):
            raise LabError(f"lab prefix {base!r} must match {_BASE_RE.pattern}")
        if name is not None and not _NAME_RE.fullmatch(name):
            raise LabError(f"lab name {name!r} must match {_NAME_RE.pattern}")
        if sites is not None:
            if len(sites) != 2 or min(sites) < 1:
                raise LabError(f"sites={sites}: give the host counts of two sites, like (2, 2)")
            if hosts is not None and hosts != sum(sites):
                raise LabError(f"hosts={hosts} but sites={sites} holds {sum(sites)}")
            hosts = sum(sites)
        elif wan is not None:
            raise LabError("a WAN link joins two sites: give sites=(A, B) too")
        hosts = 2 if hosts is None else hosts
        if not 1 <= hosts <= MAX_HOSTS:
            raise LabError(f"hosts={hosts} must be within 1..{MAX_HOSTS}")
        try:
            net = ipaddress.IPv4Network(subnet)
        except ValueError as e:
            raise LabError(f"subnet {subnet!r}: {e}") from e
        if sites is None:
            addrs = list(itertools.islice(net.hosts(), hosts))
            if len(addrs) < hosts:
                raise LabError(f"subnet {subnet} has fewer than {hosts} host addresses")
        else:
            addrs = _site_addresses(net, sites)
        _require_tools()
        if name is None:
            cleanup_stale(base)
            prefix_full = f"{base}{os.getpid()}x{next(_counter)}"
            _made.add(prefix_full)
        else:
            prefix_full = name
            taken = [ns for ns in _list_netns() if _owned_by(name, ns)]
            if taken:
                raise LabError(f"a lab named {name!r} already exists ({', '.join(taken[:3])})")
        self._init_fields(base, prefix_full, net, [str(a) for a in addrs], sites, wan)
        with _live_lock:
            _live.add(self)
        try:
            self._build()
        except BaseException:
            self.down()
            raise

    def _init_fields(
        self,
        base: str,
        prefix: str,
        net: ipaddress.IPv4Network,
        ips: list[str],
        sites: Sequence[int] | None = None,
        wan: WanLink | None = None,
    ) -> None:
        self.base = base
        self.prefix = prefix
        """Full prefix of this lab's names, e.g. ``ftm1234x0`` (or the ``name`` given)."""
        self.subnet = net
        self.bridge_ns = f"{self.prefix}br"
        self._ips = ips
        self._created: list[str] = []
        self._loss: dict[int, int] = {}  # host -> drop threshold out of 10000
        self._lan_loss = 0  # drop threshold out of 10000 for every forwarded frame
        self._groups: list[list[int]] = []  # partition: frames between groups are dropped
        self._one_way: set[tuple[int, int]] = set()  # (src, dst): IPv4 from src to dst dropped
        self._blocked: set[tuple[int, int]] = set()  # (host, port): TCP to it dropped
        self._rates: dict[int, str] = {}
        self._links_down: set[int] = set()
        self._cpu: dict[int, float] = {}  # host -> CPU share (cgroup quota)
        self._pulses: dict[int, dict[str, Any]] = {}  # host -> pulser pid, stop_s, every_s
        self._sites: tuple[int, ...] = (len(ips),) if sites is None else tuple(sites)
        self._wan: WanLink | None = None  # two sites: the link between them
        if sites is not None:
            self._wan = WanLink() if wan is None else wan
        self._wan_pid: int | None = None  # two sites: the forwarder's pid
        self._wan_proc: subprocess.Popen[bytes] | None = None  # ...when this process started it
        self._closed = False

    # --- persistence (labs that outlive the process that built them) ------------------------

    def to_state(self) -> dict[str, Any]:
        """Everything another process needs to drive this lab (JSON-serialisable)."""
        return {
            "base": self.base,
            "prefix": self.prefix,
            "subnet": str(self.subnet),
            "ips": list(self._ips),
            "namespaces": list(self._created),
            "loss": {str(k): v for k, v in self._loss.items()},
            "lan_loss": self._lan_loss,
            "groups": [list(g) for g in self._groups],
            "one_way": sorted(list(p) for p in self._one_way),
            "blocked": sorted(list(p) for p in self._blocked),
            "rates": {str(k): v for k, v in self._rates.items()},
            "links_down": sorted(self._links_down),
            "cpu": {str(k): v for k, v in self._cpu.items()},
            "pulses": {str(k): v for k, v in self._pulses.items()},
            "sites": list(self._sites),
            "wan": None if self._wan is None else self._wan.to_json(),
            "wan_pid": self._wan_pid,
        }

    @classmethod
    def attach(cls, state: dict[str, Any]) -> VirtualLan:
        """Drive a lab built by another process from its :meth:`to_state`. The lab is not
        torn down when this process exits (call :meth:`down` for that)."""
        _require_tools()
        self = cls.__new__(cls)
        try:
            self._init_fields(
                str(state["base"]),
                str(state["prefix"]),
                ipaddress.IPv4Network(state["subnet"]),
                [str(ip) for ip in state["ips"]],
            )
            self._created = [str(ns) for ns in state["namespaces"]]
            self._loss = {int(k): int(v) for k, v in state.get("loss", {}).items()}
            self._lan_loss = int(state.get("lan_loss", 0))
            self._groups = [[int(h) for h in g] for g in state.get("groups", [])]
            self._one_way = {(int(a), int(b)) for a, b in state.get("one_way", [])}
            self._blocked = {(int(h), int(p)) for h, p in state.get("blocked", [])}
            self._rates = {int(k): str(v) for k, v in state.get("rates", {}).items()}
            self._links_down = {int(h) for h in state.get("links_down", [])}
            self._cpu = {int(k): float(v) for k, v in state.get("cpu", {}).items()}
            self._pulses = {int(k): dict(v) for k, v in state.get("pulses", {}).items()}
            self._sites = tuple(int(n) for n in state.get("sites", [len(self._ips)]))
            wan = state.get("wan")
            self._wan = None if wan is None else WanLink.from_json(wan)
            pid = state.get("wan_pid")
            self._wan_pid = None if pid is None else int(pid)
            if sum(self._sites) != len(self._ips) or (self._wan is None) != (len(self._sites) == 1):
                raise ValueError(f"sites {self._sites} do not fit {len(self._ips)} hosts")
        except (KeyError, TypeError, ValueError, LabError) as e:
            raise LabError(f"lab state is damaged: {e!r}") from e
        existing = set(_list_netns())
        missing = [ns for ns in self._created if ns not in existing]
        if missing:
            raise LabError(f"lab {self.prefix!r} is gone (missing {', '.join(missing[:3])})")
        return self

    def detach(self) -> None:
        """Let this lab outlive the process: it is no longer torn down at interpreter exit."""
        with _live_lock:
            _live.discard(self)

    # --- construction -------------------------------------------------------------------------

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _build(self) -> None:
        for site in range(len(self._sites)):
            br = self._bridge(site)
            self._add_ns(br)
            _ip("-n", br, "link", "add", _BRIDGE_IF, "type", "bridge", "mcast_snooping", "0")
            _ip("-n", br, "link", "set", _BRIDGE_IF, "up")
            for i in self.site_hosts(site):
                self._build_host(i)
        if self._wan is not None:
            self._build_wan(self._wan)

    def _build_host(self, i: int) -> None:
        site = self.site_of(i)
        br, ns, port = self._bridge(site), self.ns_name(i), self._port(i)
        self._add_ns(ns)
        _ip("-n", br, "link", "add", port, "type", "veth", "peer", "name", _HOST_IF, "netns", ns)
        _ip("-n", br, "link", "set", port, "master", _BRIDGE_IF)
        _ip("-n", br, "link", "set", port, "up")
        plen = self.site_subnet(site).prefixlen
        _ip("-n", ns, "addr", "add", f"{self._ips[i]}/{plen}", "dev", _HOST_IF)
        _ip("-n", ns, "link", "set", _HOST_IF, "up", "multicast", "on")
        if self._wan is None:
            _ip("-n", ns, "route", "add", "default", "dev", _HOST_IF)
        else:
            _ip("-n", ns, "route", "add", "default", "via", self.gateway(site), "dev", _HOST_IF)
        _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", _HOST_IF)

    def _build_wan(self, link: WanLink) -> None:
        """Each site's router (a leg on its bridge, a TUN), the forwarder between the TUNs,
        then the routes through them (see :mod:`ftmesh.lab.wan`)."""
        for site in range(2):
            r, br = self._router(site), self._bridge(site)
            self._add_ns(r)
            sysctls = ["net.ipv4.ip_forward=1", "net.ipv6.conf.all.disable_ipv6=1"]
            sysctls += ["net.ipv6.conf.default.disable_ipv6=1"]  # (no stray v6 on the WAN)
            _cmd(["ip", "netns", "exec", r, "sysctl", "-qw", *sysctls])
            _ip("-n", br, "link", "add", _ROUTER_PORT, "type", "veth", "peer", "name", _HOST_IF,
                "netns", r)  # fmt: skip
            _ip("-n", br, "link", "set", _ROUTER_PORT, "master", _BRIDGE_IF)
            _ip("-n", br, "link", "set", _ROUTER_PORT, "up")
            plen = self.site_subnet(site).prefixlen
            _ip("-n", r, "addr", "add", f"{self.gateway(site)}/{plen}", "dev", _HOST_IF)
            _ip("-n", r, "link", "set", _HOST_IF, "up")
            _ip("-n", r, "tuntap", "add", "dev", TUN_DEV, "mode", "tun")
            _ip("-n", r, "link", "set", TUN_DEV, "up")
        self._wan_proc = start_forwarder(self.prefix, self._router(0), self._router(1), link)
        self._wan_pid = self._wan_proc.pid
        for site in range(2):
            other = str(self.site_subnet(1 - site))
            _ip("-n", self._router(site), "route", "add", other, "dev", TUN_DEV)

    @staticmethod
    def _port(i: int) -> str:
        return f"p{i}"

    def _bridge(self, site: int) -> str:
        """Namespace of site ``site``'s bridge (site 0's is :attr:`bridge_ns`)."""
        return self.bridge_ns if site == 0 else f"{self.prefix}br{site}"

    def _router(self, site: int) -> str:
        """Namespace of site ``site``'s router (two-site labs)."""
        return f"{self.prefix}r{site}"

    # --- queries ------------------------------------------------------------------------------

    @property
    def hosts(self) -> int:
        """Number of hosts."""
        return len(self._ips)

    def _check(self, i: int) -> None:
        if self._closed:
            raise LabError("the virtual LAN is down")
        if not 0 <= i < len(self._ips):
            raise LabError(f"host {i} out of range 0..{len(self._ips) - 1}")

    def ns_name(self, i: int) -> str:
        """Name of host ``i``'s namespace (``<prefix>h<i>``)."""
        return f"{self.prefix}h{i}"

    def host_ip(self, i: int) -> str:
        """IPv4 address of host ``i`` on the LAN."""
        self._check(i)
        return self._ips[i]

    def namespaces(self) -> list[str]:
        """Every namespace of this lab (hosts, bridges, routers) still existing."""
        return list(self._created)

    # --- sites and the WAN link ---------------------------------------------------------------

    @property
    def sites(self) -> tuple[int, ...]:
        """Hosts per site: ``(hosts,)`` for one bridge, ``(a, b)`` for two sites."""
        return self._sites

    def site_of(self, i: int) -> int:
        """The site of host ``i`` (0 or 1; always 0 on a one-bridge lab)."""
        self._check(i)
        return 0 if i < self._sites[0] else 1

    def site_hosts(self, site: int) -> list[int]:
        """The hosts of site ``site``, in index order."""
        if not 0 <= site < len(self._sites):
            raise LabError(f"site {site} out of range 0..{len(self._sites) - 1}")
        start = sum(self._sites[:site])
        return list(range(start, start + self._sites[site]))

    def site_subnet(self, site: int) -> ipaddress.IPv4Network:
        """Site ``site``'s subnet: all of :attr:`subnet` for one bridge, a half for two."""
        if len(self._sites) == 1:
            return self.subnet
        return list(self.subnet.subnets(prefixlen_diff=1))[site]

    def gateway(self, site: int) -> str:
        """Address of site ``site``'s router on its bridge (two-site labs)."""
        if self._wan is None:
            raise LabError("a one-bridge lab has no gateway")
        return str(self.site_subnet(site).broadcast_address - 1)

    @property
    def wan(self) -> WanLink | None:
        """The WAN link's settings (two sites), or ``None`` for a one-bridge lab."""
        return self._wan

    def set_wan(self, link: WanLink) -> None:
        """Change the WAN link (rate, delay, loss, queue) from the next packet on; packets
        already held keep the times they were given. E.g.
        ``lan.set_wan(dataclasses.replace(lan.wan, delay_ms=10))``."""
        self._require_wan()
        control_request(self.prefix, {"op": "set", "link": link.to_json()})
        self._wan = link

    def wan_stats(self) -> WanStats:
        """What crossed the WAN link each way since the lab started (packets and bytes
        delivered, drops by kind), from the forwarder."""
        self._require_wan()
        return WanStats.from_json(control_request(self.prefix, {"op": "stats"}))

    def _require_wan(self) -> None:
        if self._closed:
            raise LabError("the virtual LAN is down")
        if self._wan is None:
            raise LabError("this lab has one bridge and no WAN link (build it with sites=)")

    # --- processes ------------------------------------------------------------------------------

    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``i`` (``ip netns exec``); keyword args go to Popen.

        The process is killed by :meth:`down` if still running then.
        """
        self._check(i)
        return subprocess.Popen(self._exec_argv(i, argv), **kw)

    def _exec_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` inside host ``i``, in its CPU cgroup when it is throttled."""
        full = ["ip", "netns", "exec", self.ns_name(i), *argv]
        if i in self._cpu:
            from . import slowness  # (lazy: `-m ftmesh.lab.slowness` runs it)

            cg, _ = slowness.host_cgroup(self.ns_name(i))
            return slowness.throttled_argv(cg, full)
        return full

    def run(
        self, i: int, argv: Sequence[str], timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside host ``i`` to completion, capturing text output.

        Raises :class:`LabError` if it takes over ``timeout`` seconds (the process is killed).
        """
        self._check(i)
        full = self._exec_argv(i, argv)
        try:
            return subprocess.run(full, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise LabError(f"{' '.join(argv)} on host {i} took over {timeout}s") from e

    def host_pids(self, i: int) -> list[int]:
        """Pids of every process running inside host ``i``'s namespace."""
        self._check(i)
        return _netns_pids(self.ns_name(i))

    def kill_host(self, i: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to every process in host ``i``'s namespace; returns how many."""
        self._check(i)
        return _kill_netns(self.ns_name(i), sig)

    # --- faults ---------------------------------------------------------------------------------

    def link(self, i: int, up: bool) -> None:
        """Connect (``up=True``) or disconnect host ``i`` from the bridge."""
        self._check(i)
        _ip("-n", self._bridge(self.site_of(i)), "link", "set", self._port(i),
            "up" if up else "down")  # fmt: skip
        if up:
            self._links_down.discard(i)
        else:
            self._links_down.add(i)

    def set_loss(self, i: int, percent: float) -> None:
        """Drop ``percent`` % of frames in each direction of host ``i``'s link (0 clears).

        An nftables ``numgen random`` rule in the bridge's forward hook, for frames entering from
        and leaving towards host ``i``'s port (resolution 0.01 %). Dropping inside the switch,
        not in the host, keeps the loss invisible to senders, as on a real LAN (a drop in the
        host's output hook would fail ``sendto`` with EPERM). ARP is dropped too. Used instead
        of netem because many kernels lack ``sch_netem``; needs the ``nft`` tool (Debian package
        ``nftables``).
        """
        self._check(i)
        if not 0 <= percent <= 100:
            raise LabError(f"loss {percent}% must be within 0..100")
        threshold = round(percent * 100)
        if threshold:
            self._loss[i] = threshold
        else:
            self._loss.pop(i, None)
        self._apply_nft()

    def set_lan_loss(self, percent: float) -> None:
        """Drop ``percent`` % of every frame the bridge forwards (0 clears): end-to-end loss
        of exactly ``percent`` between any two hosts (per-host :meth:`set_loss` compounds over
        the two links of a path). Each copy of a flooded multicast frame is dropped
        independently, as each receiver's cable would."""
        self._check(0)
        if not 0 <= percent <= 100:
            raise LabError(f"loss {percent}% must be within 0..100")
        self._lan_loss = round(percent * 100)
        self._apply_nft()

    def partition(self, groups: Sequence[Sequence[int]]) -> None:
        """Split the LAN: frames between hosts of different groups are dropped (both ways,
        unicast, multicast and ARP). Hosts named in no group form one more group together.
        Replaces any earlier partition; :meth:`heal` removes it."""
        seen: set[int] = set()
        clean: list[list[int]] = []
        for g in groups:
            grp = sorted(set(g))
            for h in grp:
                self._check(h)
                if h in seen:
                    raise LabError(f"host {h} is in two partition groups")
            seen.update(grp)
            if grp:
                clean.append(grp)
        rest = [h for h in range(self.hosts) if h not in seen]
        if rest:
            clean.append(rest)
        self._groups = clean if len(clean) > 1 else []
        self._apply_nft()

    def heal(self) -> None:
        """Remove the partition (loss and rate limits stay)."""
        self._check(0)
        self._groups = []
        self._apply_nft()

    def one_way(self, src: int, dst: int, broken: bool = True) -> None:
        """Drop (``broken``) or pass again the IPv4 packets from host ``src`` to host ``dst``.
        ARP and the other direction pass: a one-way link. UDP from ``dst`` still reaches
        ``src``, but no TCP connection can open between them either way (each needs packets
        both ways)."""
        self._check(src)
        self._check(dst)
        if src == dst:
            raise LabError("a one-way link needs two different hosts")
        (self._one_way.add if broken else self._one_way.discard)((src, dst))
        self._apply_nft()

    def block_port(self, host: int, port: int, blocked: bool = True) -> None:
        """Drop (``blocked``) or pass again every TCP segment to ``port`` of ``host``, from
        any other host: a firewall in front of one port (connections already open stall too,
        as behind a stateless filter)."""
        self._check(host)
        if not 0 < port < 65536:
            raise LabError(f"port {port} out of range")
        (self._blocked.add if blocked else self._blocked.discard)((host, port))
        self._apply_nft()

    def faults(self) -> dict[str, Any]:
        """The fault state this object knows of: loss, partition, one-way links, blocked ports,
        rates, links down, CPU shares, fail-slow pulses, and the WAN link of two sites."""
        return {
            "loss_percent": {h: t / 100 for h, t in sorted(self._loss.items())},
            "lan_loss_percent": self._lan_loss / 100,
            "partition": [list(g) for g in self._groups],
            "one_way": sorted(self._one_way),
            "blocked_ports": sorted(self._blocked),
            "rates": dict(sorted(self._rates.items())),
            "links_down": sorted(self._links_down),
            "cpu": dict(sorted(self._cpu.items())),
            "fail_slow": {
                h: {"stop_s": p["stop_s"], "every_s": p["every_s"]}
                for h, p in sorted(self._pulses.items())
            },
            "wan": None if self._wan is None else self._wan.to_json(),
        }

    def _apply_nft(self) -> None:
        if shutil.which("nft") is None:
            raise LabError("loss and partitions need the 'nft' tool: install 'nftables'")
        for site in range(len(self._sites)):
            self._apply_site_nft(site)

    def _apply_site_nft(self, site: int) -> None:
        """The fault rules of one bridge: what its own hosts' ports send and receive."""
        # Declaring the table first makes the delete succeed whether or not it existed, and
        # "nft -f" applies the whole script atomically.
        script = f"table bridge {_NFT_TABLE} {{}}\ndelete table bridge {_NFT_TABLE}\n"
        local = set(self.site_hosts(site))

        def ports(hosts: Sequence[int]) -> str:
            return ", ".join(f'"{self._port(h)}"' for h in hosts)

        def ips(hosts: Sequence[int]) -> str:
            return ", ".join(self._ips[h] for h in hosts)

        rules = []
        for a, ga in enumerate(self._groups):
            src = [h for h in ga if h in local]
            for b, gb in enumerate(self._groups):
                if a == b or not src:
                    continue
                near = [h for h in gb if h in local]
                far = [h for h in gb if h not in local]  # across the WAN: by address
                if near:
                    rules.append(f"    iifname {{ {ports(src)} }} oifname {{ {ports(near)} }} drop")
                if far:
                    rules.append(f"    iifname {{ {ports(src)} }} ip daddr {{ {ips(far)} }} drop")
        for a, b in sorted(self._one_way):
            if a not in local:
                continue
            if b in local:
                rules.append(
                    f'    iifname "{self._port(a)}" oifname "{self._port(b)}" ether type ip drop'
                )
            else:
                rules.append(f'    iifname "{self._port(a)}" ip daddr {self._ips[b]} drop')
        for h, tcp_port in sorted(self._blocked):
            if h in local:
                rules.append(
                    f'    oifname "{self._port(h)}" ether type ip tcp dport {tcp_port} drop'
                )
        if self._lan_loss:
            t = self._lan_loss
            rules.append("    drop" if t >= 10000 else f"    numgen random mod 10000 < {t} drop")
        for host, t in sorted(self._loss.items()):
            if host not in local:
                continue
            verdict = "drop" if t >= 10000 else f"numgen random mod 10000 < {t} drop"
            port = self._port(host)
            rules += [f'    iifname "{port}" {verdict}', f'    oifname "{port}" {verdict}']
        if rules:
            script += (
                f"table bridge {_NFT_TABLE} {{\n"
                "  chain loss { type filter hook forward priority -300; policy accept;\n"
                + "\n".join(rules)
                + "\n  }\n}\n"
            )
        _cmd(["ip", "netns", "exec", self._bridge(site), "nft", "-f", "-"], stdin=script)

    def set_rate(self, i: int, rate: str | None) -> None:
        """Limit each direction of host ``i``'s link to ``rate`` (tc syntax: ``"10mbit"``).

        A tbf qdisc on the egress of both ends of the veth pair; ``None`` removes the limit.
        """
        self._check(i)
        if rate is not None and not _RATE_RE.fullmatch(rate):
            raise LabError(f"rate {rate!r} is not a tc rate like '10mbit'")
        for ns, dev in (
            (self._bridge(self.site_of(i)), self._port(i)),
            (self.ns_name(i), _HOST_IF),
        ):
            tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
            _cmd([*tc, "del", "dev", dev, "root"], check=False)
            if rate is not None:
                burst = str(_burst_bytes(rate))
                _cmd([*tc, "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                      "latency", "100ms"])  # fmt: skip
        if rate is None:
            self._rates.pop(i, None)
        else:
            self._rates[i] = rate

    def set_cpu(self, i: int, share: float | None) -> None:
        """Throttle host ``i`` to ``share`` CPUs (0.25: a quarter of one core; None lifts
        it): a cgroup CPU quota for every process of the host, including those started later
        (``ftmesh.lab.slowness``). Needs the cgroup ``cpu`` controller."""
        from . import slowness  # (lazy: `-m ftmesh.lab.slowness` runs it)

        self._check(i)
        if share is not None and not slowness.MIN_SHARE <= share <= slowness.MAX_SHARE:
            raise LabError(
                f"CPU share {share} must be within {slowness.MIN_SHARE}..{slowness.MAX_SHARE}"
            )
        cg, version = slowness.host_cgroup(self.ns_name(i))
        if share is None:
            slowness.release_cgroup(cg)
            self._cpu.pop(i, None)
            return
        slowness.set_quota(cg, version, share)
        self._cpu[i] = share
        for _ in range(2):  # a second pass catches processes forked during the first
            slowness.move_pids(cg, _netns_pids(self.ns_name(i)))

    def cpu_stats(self, i: int) -> dict[str, float]:
        """What the kernel did to host ``i``'s CPU cgroup: ``periods``, ``throttled``
        (periods that ran out of quota), ``throttled_s``. Zeros if it was never throttled."""
        from . import slowness  # (lazy: `-m ftmesh.lab.slowness` runs it)

        self._check(i)
        if i not in self._cpu:
            return {"periods": 0, "throttled": 0, "throttled_s": 0.0}
        return slowness.cpu_stats(slowness.host_cgroup(self.ns_name(i))[0])

    def set_fail_slow(self, i: int, stop_s: float | None, every_s: float = 1.0) -> None:
        """Freeze every process of host ``i`` (SIGSTOP) for ``stop_s`` seconds every
        ``every_s`` seconds, until called with ``stop_s=None`` (which thaws it). A pulser
        process in the root namespace does it; it outlives this object for a detached lab."""
        from . import slowness  # (lazy: `-m ftmesh.lab.slowness` runs it)

        self._check(i)
        old = self._pulses.pop(i, None)
        if old is not None:
            slowness.stop_pulser(int(old["pid"]))
        if stop_s is None:
            return
        proc = slowness.start_pulser(self.ns_name(i), stop_s, every_s, self._pulse_stats_path(i))
        self._pulses[i] = {"pid": proc.pid, "stop_s": stop_s, "every_s": every_s}

    def fail_slow_stats(self, i: int) -> dict[str, Any]:
        """What host ``i``'s pulser did: ``pulses`` and ``stopped_s`` (process-seconds kept
        stopped), with its ``stop_s``/``every_s``; empty before its first pulse or without
        one."""
        from . import slowness  # (lazy: `-m ftmesh.lab.slowness` runs it)

        self._check(i)
        if i not in self._pulses:
            return {}
        return slowness.read_pulse_stats(self._pulse_stats_path(i))

    def _pulse_stats_path(self, i: int) -> Path:
        return Path(tempfile.gettempdir()) / f"ftmesh-pulse-{self.ns_name(i)}.json"

    # --- teardown -------------------------------------------------------------------------------

    def down(self) -> None:
        """Kill every process in the lab and delete its namespaces. Idempotent."""
        from . import slowness  # (lazy: `-m ftmesh.lab.slowness` runs it)

        self._closed = True
        with _live_lock:
            _live.discard(self)
        for i, pulse in list(self._pulses.items()):
            slowness.stop_pulser(int(pulse["pid"]))
            self._pulse_stats_path(i).unlink(missing_ok=True)
        self._pulses.clear()
        if self._wan_pid is not None:  # (deleting router r0 would kill it too)
            stop_forwarder(self._wan_pid, self.prefix)
            if self._wan_proc is not None:
                self._wan_proc.wait()  # reaped already: this only sets its returncode
            self._wan_pid = self._wan_proc = None
        # Hosts first, bridge last: deleting a host namespace deletes its veth pair.
        for ns in reversed(self._created):
            _delete_netns(ns)
        for i in list(self._cpu):
            with contextlib.suppress(LabError):
                slowness.remove_cgroup(slowness.host_cgroup(self.ns_name(i))[0])
        self._cpu.clear()
        self._created.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    def __repr__(self) -> str:
        state = "down" if self._closed else f"{len(self._ips)} hosts"
        if len(self._sites) > 1 and not self._closed:
            state += f" on sites {'x'.join(map(str, self._sites))}, WAN {self._wan}"
        return f"<VirtualLan {self.prefix} {self.subnet} {state}>"


@atexit.register
def _down_all() -> None:
    with _live_lock:
        labs = list(_live)
    for lab in labs:
        lab.down()
