"""SeedDiscovery: host:port lists and multi-address DNS names, resolved without network
traffic (localhost from /etc/hosts, everything else through a fake trio resolver)."""

from __future__ import annotations

import socket
import uuid
from typing import Any

import pytest
import trio

from ftmesh.discovery import Advert, SeedDiscovery, make_discovery
from ftmesh.discovery.seeds import parse_seed
from ftmesh.errors import ConfigError

ME = Advert(mesh="m", node_id=uuid.uuid4().hex, name="me", host="127.0.0.1", port=7000)


class FakeResolver(trio.abc.HostnameResolver):
    """Answers from a dict; names not in it fail like NXDOMAIN. Nothing leaves the process."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.lookups = 0

    async def getaddrinfo(
        self,
        host: bytes | None,
        port: bytes | str | int | None,
        family: int = 0,
        type: int = 0,
        proto: int = 0,
        flags: int = 0,
    ) -> list[Any]:
        self.lookups += 1
        await trio.lowlevel.checkpoint()
        name = host.decode() if isinstance(host, bytes) else str(host)
        if name == "slow.test":
            await trio.sleep_forever()
        if name not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            (socket.AF_INET, socket.SOCK_DGRAM, 17, "", (addr, int(port or 0)))
            for addr in self.table[name]
        ]

    async def getnameinfo(self, sockaddr: Any, flags: int) -> tuple[str, str]:
        raise NotImplementedError


async def collect(disc: SeedDiscovery, seconds: float, me: Advert = ME) -> list[Advert]:
    out: list[Advert] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(disc.run, me, out.append)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
    return out


async def test_localhost_resolves_to_loopback() -> None:
    found = await collect(SeedDiscovery(["localhost:7946"]), 0.5)
    assert found
    assert {(a.host, a.port, a.node_id, a.name, a.mesh) for a in found} == {
        ("127.0.0.1", 7946, "", "", "m")
    }
    assert [(a.host, a.port) for a in await SeedDiscovery(["localhost:7946"]).browse("m", 2)] == [
        ("127.0.0.1", 7946)
    ]


async def test_headless_service_and_late_seeds() -> None:
    resolver = FakeResolver({"ftmesh.ns.svc.test": ["10.0.0.1", "10.0.0.2"]})
    trio.socket.set_custom_hostname_resolver(resolver)
    disc = SeedDiscovery(
        ["ftmesh.ns.svc.test:7946", "10.0.0.9:7000", "missing.test:1"], refresh_interval=0.1
    )
    async with trio.open_nursery() as nursery:
        found: list[Advert] = []
        await nursery.start(disc.run, ME, found.append)
        await trio.sleep(0.05)
        assert {(a.host, a.port) for a in found} == {
            ("10.0.0.1", 7946),
            ("10.0.0.2", 7946),
            ("10.0.0.9", 7000),
        }
        resolver.table["ftmesh.ns.svc.test"].append("10.0.0.3")  # a pod scheduled later
        resolver.table["missing.test"] = ["10.0.0.4"]
        await trio.sleep(0.25)
        nursery.cancel_scope.cancel()
    assert {(a.host, a.port) for a in found} >= {("10.0.0.3", 7946), ("10.0.0.4", 1)}
    assert disc.statistics().errors >= 1  # missing.test failed at first, counted, not raised


async def test_self_is_skipped_and_slow_dns_is_bounded() -> None:
    trio.socket.set_custom_hostname_resolver(FakeResolver({}))
    disc = SeedDiscovery(["127.0.0.1:7000", "127.0.0.2:7000", "slow.test:1"], resolve_timeout=0.1)
    with trio.fail_after(2):
        found = await collect(disc, 0.3)
    assert {(a.host, a.port) for a in found} == {("127.0.0.2", 7000)}
    assert disc.statistics().errors >= 1
    with trio.fail_after(1):
        assert await disc.browse("m", 0.2) != []


@pytest.mark.parametrize(
    "entry",
    [
        "localhost",
        "localhost:",
        ":7946",
        "host:0",
        "host:65536",
        "host:-1",
        "host:79x",
        "[::1]:7946",
        "::1:7946",
        "",
        "a b:1",
        "x" * 300 + ":1",
    ],
)
def test_malformed_entries_raise_config_error(entry: str) -> None:
    with pytest.raises(ConfigError):
        SeedDiscovery([entry])


def test_parse_and_factory() -> None:
    assert parse_seed("10.1.2.3:7946") == ("10.1.2.3", 7946)
    assert parse_seed(" seed.example:1 ") == ("seed.example", 1)
    assert SeedDiscovery([]).seeds == ()  # the first member: nobody to join yet
    with pytest.raises(ConfigError, match="not one string"):
        SeedDiscovery("localhost:7946")
    assert isinstance(make_discovery("seeds"), SeedDiscovery)
    disc = make_discovery("seeds", seeds=["a:1", "a:1", "b:2"])
    assert isinstance(disc, SeedDiscovery) and disc.seeds == (("a", 1), ("b", 2))
