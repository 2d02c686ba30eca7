"""Zero-configuration LAN discovery over mDNS / DNS-SD (RFC 6762, RFC 6763).

Theory of operation: each node registers a ``_ftmesh._tcp.local.`` service named
``<name>-<node_id[:8]>`` whose SRV port is the gossip port, whose A record is the address of
the chosen interface, and whose TXT record carries ``mesh``, ``id``, ``name``, ``port`` and
``v`` (protocol version). Every node browses the same service type; each service that appears
or changes is resolved and, if its TXT record is well formed and names our mesh, reported to
the node, which joins it through SWIM. Departures are not reported: SWIM owns liveness.

Interface choice is always explicit or a documented default, never "all interfaces": with
``interface_ip`` given, mDNS runs on that address only and advertises it; with ``None``, the
address of the interface behind the default route, or the only candidate interface
(:func:`ftmesh.discovery.interfaces.default_interface_ip`). A host whose only interface is
loopback has no LAN to discover on, and one with several interfaces and no default route does
not say which is the LAN: both are a :class:`ConfigError` telling the user what to pass. We
never advertise an address that peers could not reach.

Threading: python-zeroconf runs its own asyncio loop in a thread, and the ``ServiceBrowser``
calls our handler from a second thread of its own. That handler only records the service name
in a bounded dict under a lock and wakes the trio side through the trio token
(``run_sync_soon``, which never blocks). Every blocking zeroconf call (open, register, resolve,
close) runs in ``trio.to_thread.run_sync`` with a timeout zeroconf itself enforces. On cancel we
unregister (goodbye packets), cancel the browser and close zeroconf, joining its threads.

Everything in a TXT record is input from the LAN: parsed by :func:`parse_txt` against named
caps, and malformed records and adverts of other meshes are dropped and counted.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import trio
from zeroconf import (
    EventLoopBlocked,
    IPVersion,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)

from ..errors import ConfigError, DeadlineExceeded, RemoteProtocolError
from .base import (
    Advert,
    DiscoveryStatistics,
    FoundCallback,
    _Counters,
    check_mesh_name,
    check_own_advert,
    check_remote_advert,
)
from .interfaces import check_local_address, default_interface_ip

SERVICE_TYPE = "_ftmesh._tcp.local."
"""DNS-SD service type every ftmesh node registers and browses."""

DEFAULT_REFRESH_INTERVAL = 5.0
"""Seconds after which known peers are reported again, so a join that failed is retried."""

RESOLVE_TIMEOUT_MS = 3000
"""Deadline for resolving one service (SRV, TXT, A), in milliseconds. Usually answered from
the cache filled by the peer's own announcement, in well under a millisecond."""

MAX_TRACKED_SERVICES = 1024
"""Service names queued for resolution or remembered as resolved. Bounds the memory a LAN
peer flooding fake service names can make us hold; beyond it new names are dropped and counted
(they are seen again on the browser's next query cycle once the flood stops)."""

MAX_CONCURRENT_RESOLVES = 8
"""Worker threads resolving services at once."""

MAX_RESOLVE_ATTEMPTS = 3
"""Lookups of one service that got no answer before we wait for the browser to report it again
(a lost packet should not hide a peer; a vanished one should not cost lookups forever)."""

MAX_TXT_VALUE_BYTES = 255
"""Longest TXT value accepted: one DNS character-string."""

CLOSE_TIMEOUT = 5.0
"""Seconds allowed for goodbye packets and joining zeroconf's threads on shutdown. zeroconf
bounds each step itself (about 0.4 s for goodbyes); this only guards against a stuck thread."""

_INSTANCE_MAX_BYTES = 63  # one DNS label
_INSTANCE_BAD = re.compile(r"[^A-Za-z0-9_-]+")


def _check_interface_ip(ip: str) -> str:
    try:
        addr = ipaddress.IPv4Address(ip)
    except ValueError:
        raise ConfigError(f"interface_ip {ip!r} is not an IPv4 address") from None
    if addr.is_loopback or addr.is_unspecified or addr.is_multicast:
        raise ConfigError(
            f"interface_ip {ip} cannot carry mDNS to other hosts; pass a LAN address, or use "
            "'local' discovery (same host) or 'seeds' discovery"
        )
    check_local_address(ip, "interface_ip")
    return ip


def instance_name(name: str, node_id: str) -> str:
    """DNS-SD instance label ``<name>-<node_id[:8]>``, sanitised and at most 63 bytes."""
    suffix = f"-{node_id[:8]}"
    clean = _INSTANCE_BAD.sub("-", name).strip("-") or "ftmesh"
    return clean[: _INSTANCE_MAX_BYTES - len(suffix)] + suffix


def advert_to_txt(a: Advert) -> dict[str, str]:
    """The TXT properties announcing ``a`` (see :func:`parse_txt` for the inverse)."""
    return {
        "mesh": a.mesh,
        "id": a.node_id,
        "name": a.name,
        "port": str(a.port),
        "v": str(a.version),
    }


def _txt_str(props: Mapping[bytes, bytes | None], key: bytes) -> str:
    value = props.get(key)
    if value is None:
        raise RemoteProtocolError("malformed", f"TXT has no value for {key.decode()!r}")
    if not isinstance(value, bytes) or len(value) > MAX_TXT_VALUE_BYTES:
        raise RemoteProtocolError("malformed", f"TXT {key.decode()!r} is not a short byte string")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise RemoteProtocolError("malformed", f"TXT {key.decode()!r} is not UTF-8") from None


def _txt_int(props: Mapping[bytes, bytes | None], key: bytes) -> int:
    text = _txt_str(props, key)
    if not (text.isascii() and text.isdigit()) or len(text) > 5:
        raise RemoteProtocolError("malformed", f"TXT {key.decode()!r}={text[:16]!r} not a number")
    return int(text)


def parse_txt(props: Mapping[bytes, bytes | None], host: str) -> Advert:
    """Build the advert of a peer from its TXT properties and resolved IPv4 ``host``.

    Raises :class:`RemoteProtocolError` ``"malformed"`` for a missing, oversized, non-UTF-8 or
    out-of-range field. The mesh is *not* checked here: that is a separate counter.
    """
    if not isinstance(props, Mapping):
        raise RemoteProtocolError("malformed", "TXT properties are not a mapping")
    advert = Advert(
        mesh=_txt_str(props, b"mesh"),
        node_id=_txt_str(props, b"id"),
        name=_txt_str(props, b"name"),
        host=host,
        port=_txt_int(props, b"port"),
        version=_txt_int(props, b"v"),
    )
    return check_remote_advert(advert)


@dataclass(frozen=True, slots=True)
class _Resolved:
    properties: dict[bytes, bytes | None]
    addresses: list[str]


class _Session:
    """One Zeroconf instance and browser, and the bridge from their threads into trio."""

    def __init__(
        self, counters: _Counters, refresh_interval: float, deadline: float | None = None
    ) -> None:
        self._counters = counters
        self._refresh = refresh_interval
        self._deadline = deadline  # trio time after which lookups are pointless (browse)
        self._token = trio.lowlevel.current_trio_token()
        self._lock = threading.Lock()
        self._pending: dict[str, ServiceStateChange] = {}
        self._overflow = 0
        self._wakeup = trio.Event()
        self._limiter = trio.CapacityLimiter(MAX_CONCURRENT_RESOLVES)
        self._unanswered: dict[str, int] = {}  # service name -> lookups that timed out
        self.zc: Zeroconf | None = None
        self._browser: ServiceBrowser | None = None
        self._registered: ServiceInfo | None = None

    # --- called in worker threads -------------------------------------------------------------

    def open(self, ip: str) -> None:
        try:
            self.zc = Zeroconf(interfaces=[ip], ip_version=IPVersion.V4Only)
        except OSError as e:
            raise ConfigError(f"cannot start mDNS on {ip}: {e}") from e

    def register(self, info: ServiceInfo) -> None:
        assert self.zc is not None
        try:
            self.zc.register_service(info, allow_name_change=True)
        except EventLoopBlocked as e:
            raise DeadlineExceeded(f"mDNS registration of {info.name} timed out") from e
        self._registered = info

    def start_browser(self) -> None:
        assert self.zc is not None
        self._browser = ServiceBrowser(self.zc, SERVICE_TYPE, handlers=[self._on_change])

    def _on_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        # ServiceBrowser thread: record and wake trio, never block.
        with self._lock:
            if name in self._pending or len(self._pending) < MAX_TRACKED_SERVICES:
                self._pending[name] = state_change
            else:
                self._overflow += 1
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._wake)

    def resolve(self, name: str, timeout_ms: int) -> _Resolved | None:
        zc = self.zc
        if zc is None or zc.done:
            return None
        info = zc.get_service_info(SERVICE_TYPE, name, timeout=timeout_ms)
        if info is None:
            return None
        return _Resolved(dict(info.properties), info.parsed_addresses(IPVersion.V4Only))

    def close(self) -> None:
        """Goodbyes, then stop the browser thread, then zeroconf's loop thread. Idempotent."""
        browser, self._browser = self._browser, None
        zc = self.zc
        if zc is not None and self._registered is not None:
            info, self._registered = self._registered, None
            try:
                zc.unregister_service(info)
            except Exception as e:  # EventLoopBlocked, NotRunningException...
                self._counters_from_thread("errors", f"mDNS unregister failed: {e!r}")
        if browser is not None:
            browser.cancel()
        if zc is not None:
            zc.close()

    def _counters_from_thread(self, reason: str, detail: str) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._counters.bump, reason, detail)

    # --- trio side ------------------------------------------------------------------------------

    def _wake(self) -> None:
        self._wakeup.set()

    async def pump(self, mesh: str, my_id: str | None, found: FoundCallback) -> None:
        """Resolve services as the browser reports them and report adverts of ``mesh``."""
        known: dict[str, tuple[Advert, float]] = {}  # service name -> (advert, last reported)
        while True:
            with trio.move_on_after(self._refresh):
                await self._wakeup.wait()
            self._wakeup = trio.Event()  # replace before draining: later wakes hit the new one
            with self._lock:
                batch, self._pending = self._pending, {}
                overflow, self._overflow = self._overflow, 0
            if overflow:
                self._counters.bump("malformed", f"{overflow} service names over the cap dropped")
            to_resolve = [n for n in self._unanswered if n not in batch]  # retries
            for name, change in batch.items():
                if change is ServiceStateChange.Removed:
                    known.pop(name, None)
                    self._unanswered.pop(name, None)
                elif name in known or len(known) < MAX_TRACKED_SERVICES:
                    to_resolve.append(name)
                else:
                    self._counters.bump("malformed", "too many services on the LAN; dropped")
            async with trio.open_nursery() as nursery:
                for name in to_resolve:
                    nursery.start_soon(self._resolve_one, name, mesh, my_id, found, known)
            now = trio.current_time()
            for name, (advert, last) in list(known.items()):
                if now - last >= self._refresh:
                    known[name] = (advert, now)
                    self._counters.bump("reported")
                    found(advert)

    async def _resolve_one(
        self,
        name: str,
        mesh: str,
        my_id: str | None,
        found: FoundCallback,
        known: dict[str, tuple[Advert, float]],
    ) -> None:
        # Bounded by timeout_ms inside zeroconf; not abandoned, so no thread outlives us.
        timeout_ms = RESOLVE_TIMEOUT_MS
        if self._deadline is not None:
            left = self._deadline - trio.current_time()
            timeout_ms = max(50, min(timeout_ms, int(left * 1000)))
        try:
            resolved = await trio.to_thread.run_sync(
                self.resolve, name, timeout_ms, limiter=self._limiter
            )
        except Exception as e:  # zeroconf closed under us, a bad record it could not handle...
            self._counters.bump("errors", f"resolving {name!r}: {e!r}")
            return
        if resolved is None:
            self._counters.bump("errors", f"no answer resolving {name!r}")
            attempts = self._unanswered.get(name, 0) + 1
            if attempts < MAX_RESOLVE_ATTEMPTS and len(self._unanswered) < MAX_TRACKED_SERVICES:
                self._unanswered[name] = attempts
            else:
                self._unanswered.pop(name, None)
            return
        self._unanswered.pop(name, None)
        if not resolved.addresses:
            self._counters.bump("malformed", f"{name!r} has no IPv4 address")
            return
        try:
            advert = parse_txt(resolved.properties, resolved.addresses[0])
        except RemoteProtocolError as e:
            known.pop(name, None)  # an update can turn a good advert bad
            self._counters.bump("malformed", f"{name!r}: {e}")
            return
        if advert.mesh != mesh:
            known.pop(name, None)
            self._counters.bump("other_mesh", f"{name!r} is in mesh {advert.mesh!r}")
            return
        if advert.node_id == my_id:
            return
        prev = known.get(name)
        if prev is None or prev[0] != advert:
            known[name] = (advert, trio.current_time())
            self._counters.bump("reported")
            found(advert)

    async def aclose(self) -> None:
        """Shut down from trio, even when cancelled, within :data:`CLOSE_TIMEOUT`."""
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT) as scope:
            await trio.to_thread.run_sync(self.close, abandon_on_cancel=True)
        if scope.cancelled_caught:
            self._counters.bump("errors", "mDNS shutdown did not finish in time; thread left")


class MdnsDiscovery:
    """mDNS / DNS-SD discovery on one interface. See the module docstring.

    ``interface_ip``: IPv4 address of the interface to use and advertise; ``None`` means
    :func:`default_interface_ip`. ``refresh_interval``: seconds after which known peers are
    reported again.
    """

    def __init__(
        self,
        interface_ip: str | None = None,
        *,
        refresh_interval: float = DEFAULT_REFRESH_INTERVAL,
    ) -> None:
        if interface_ip is not None:
            try:
                ipaddress.IPv4Address(interface_ip)
            except ValueError:
                raise ConfigError(f"interface_ip {interface_ip!r} is not an IPv4 address") from None
        if not 0.1 <= refresh_interval <= 3600:
            raise ConfigError(f"refresh_interval {refresh_interval!r} s must be in [0.1, 3600]")
        self.interface_ip = interface_ip
        self.refresh_interval = refresh_interval
        self._counters = _Counters()

    def statistics(self) -> DiscoveryStatistics:
        """Counters since construction (reports, malformed TXT, other meshes, lookup errors)."""
        return self._counters.snapshot()

    def advertised_ip(self) -> str:
        """The address this discovery announces (and listens for mDNS on).

        The node should bind gossip to it or to ``0.0.0.0``. Raises :class:`ConfigError` as
        described in :func:`default_interface_ip`.
        """
        if self.interface_ip is None:
            return default_interface_ip()
        return _check_interface_ip(self.interface_ip)

    async def run(
        self,
        me: Advert,
        found: FoundCallback,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Register ``me``, browse, and report other members of ``me.mesh`` until cancelled.

        ``me.host`` must be the advertised interface address or ``0.0.0.0`` (gossip bound to
        every interface); the address announced is always the interface address, because that
        is the one peers on this LAN can reach. ``started()`` comes after the registration
        (probing and announcements, about 1.5 s).
        """
        check_own_advert(me)
        ip = self.advertised_ip()
        if me.host not in (ip, "0.0.0.0"):
            raise ConfigError(
                f"gossip address {me.host} differs from the mDNS interface address {ip}; peers "
                "would be told an address the node does not listen on. Bind gossip to the "
                "interface address (or 0.0.0.0), or pass that interface's address as interface_ip"
            )
        info = ServiceInfo(
            SERVICE_TYPE,
            f"{instance_name(me.name, me.node_id)}.{SERVICE_TYPE}",
            port=me.port,
            properties=advert_to_txt(me),
            server=f"ftmesh-{me.node_id}.local.",
            addresses=[socket.inet_aton(ip)],
        )
        session = _Session(self._counters, self.refresh_interval)
        try:
            await trio.to_thread.run_sync(session.open, ip)
            await trio.to_thread.run_sync(session.register, info)
            await trio.to_thread.run_sync(session.start_browser)
            task_status.started()
            await session.pump(me.mesh, me.node_id, found)
        finally:
            await session.aclose()

    async def browse(self, mesh: str, timeout: float) -> list[Advert]:
        """Members of ``mesh`` answering within ``timeout`` seconds (shutdown adds < 1 s)."""
        check_mesh_name(mesh)
        ip = self.advertised_ip()
        seen: dict[str, Advert] = {}

        def collect(a: Advert) -> None:
            seen[a.node_id] = a

        deadline = trio.current_time() + timeout
        session = _Session(self._counters, self.refresh_interval, deadline)
        try:
            with trio.move_on_at(deadline):
                await trio.to_thread.run_sync(session.open, ip)
                await trio.to_thread.run_sync(session.start_browser)
                await session.pump(mesh, None, collect)
        finally:
            await session.aclose()
        return list(seen.values())
