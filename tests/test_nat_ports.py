"""Bind and advertise are separate, and every listener's port can be fixed (issue 31, item 3).

Real members in this process on loopback: SWIM over UDP, real data-plane and state-server
sockets, same-host discovery in a per-test registry. A member advertises an address this
machine does not own (192.0.2.1, TEST-NET-1: on Linux all of 127.0.0.0/8 is local, so a
loopback alias would not show it) while its listeners bind 127.0.0.1; members with fixed data
and state ports publish exactly those ports and train and transfer state through them; a
port already taken is a ``ConfigError`` naming its flag. ``test_cli_errors.py`` checks the
same errors from the commands; ``test_lab_nat.py`` forms a mesh through a real NAT."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np
import pytest
import trio

from ftmesh.discovery.interfaces import check_local_address
from ftmesh.errors import ConfigError
from ftmesh.mesh.core import MeshConfig, open_mesh
from ftmesh.mesh.meta import DATA_KEY, STATE_KEY, MemberInfo
from ftmesh.net.node import NodeConfig
from ftmesh.settings import Settings
from ftmesh.state import Lookup, State

NOT_OURS = "192.0.2.1"
"""TEST-NET-1 (RFC 5737): documentation only, never an address of this machine."""
WAIT_S = 20.0


def free_tcp_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (held together while chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


@pytest.fixture
def taken() -> Iterator[int]:
    """A TCP port another process (here: a listening socket) holds on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def member(registry: Path, **given: object) -> Settings:
    return Settings(
        discovery="local", registry_dir=str(registry), mesh="nat", preset="local", bind="127.0.0.1"
    ).replace(**given)


def lookup_of(state: State) -> Lookup:
    """Serve ``state``'s committed snapshot, whatever is asked for."""
    return lambda step, digest: state.committed


async def answers(port: int) -> None:
    """A TCP listener answers on 127.0.0.1:``port``."""
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.aclose()


async def test_a_member_advertises_an_address_it_does_not_own(tmp_path: Path) -> None:
    """Before: the data plane bound the advertised address, ``OSError 99``. Now every
    listener binds 127.0.0.1 and every published address names 192.0.2.1."""
    with pytest.raises(ConfigError):  # the premise: not an address of this machine
        check_local_address(NOT_OURS, "advertise")
    data, state_port = free_tcp_ports(2)
    settings = member(tmp_path, advertise=NOT_OURS, data_port=data, state_port=state_port)
    state = State(arrays={"w": np.arange(4.0)}, rng=False)
    state.commit(step=1)
    async with open_mesh(settings.mesh_config()) as mesh:
        me = mesh.node.me()
        assert me.addr[0] == NOT_OURS  # gossip
        assert me.meta[DATA_KEY] == f"{NOT_OURS}:{data}"
        assert await mesh.serve_state(lookup_of(state)) == (NOT_OURS, state_port)
        assert mesh.node.me().meta[STATE_KEY] == f"{NOT_OURS}:{state_port}"
        for port in (me.addr[1], data, state_port):  # bound here, on those ports
            await answers(port)
        # A second state server (a new trainer on this mesh) takes the same fixed port.
        assert await mesh.serve_state(lookup_of(state)) == (NOT_OURS, state_port)
        await answers(state_port)


async def test_members_with_fixed_ports_form_a_mesh_through_them(tmp_path: Path) -> None:
    """Two members on fixed data and state ports: each sees the other's fixed ports in its
    metadata, an allreduce runs over the data plane and a state fetch over the state
    server."""
    ports = free_tcp_ports(4)
    given = [{"data_port": ports[0], "state_port": ports[1]}]
    given.append({"data_port": ports[2], "state_port": ports[3]})
    state = State(arrays={"w": np.arange(1000.0)}, scalars={"epoch": 3}, rng=False)
    snap = state.commit(step=7)
    async with AsyncExitStack() as stack:
        ms = [
            await stack.enter_async_context(open_mesh(member(tmp_path, **g).mesh_config()))
            for g in given
        ]
        for mesh in ms:
            await mesh.serve_state(lookup_of(state))
        with trio.fail_after(WAIT_S):
            for mesh in ms:
                await mesh.wait_view(min_members=2, timeout=WAIT_S)

            def seen(m: int, other: int) -> MemberInfo | None:
                found = [i for i in ms[m].usable_members() if i.node == ms[other].node_id]
                return found[0] if found and found[0].state_addr is not None else None

            while seen(0, 1) is None or seen(1, 0) is None:
                await trio.sleep(0.05)
        for m, other in ((0, 1), (1, 0)):
            info = seen(m, other)
            assert info is not None
            assert info.data == ("127.0.0.1", given[other]["data_port"])
            assert info.state_addr == ("127.0.0.1", given[other]["state_port"])
        out: dict[int, np.ndarray] = {}

        async def reduce(i: int) -> None:
            out[i] = (await ms[i].allreduce(np.full(16, i + 1.0, np.float32))).output

        with trio.fail_after(WAIT_S):
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(reduce, i)
        for i in range(2):
            np.testing.assert_array_equal(out[i], np.full(16, 3.0, np.float32))
        with trio.fail_after(WAIT_S):
            got = await ms[0].fetch_state([ms[1].node_id], 7, snap.digest)
        assert got.digest == snap.digest


async def test_a_data_port_in_use_names_the_flag(tmp_path: Path, taken: int) -> None:
    with pytest.raises(ConfigError) as err:
        async with open_mesh(member(tmp_path, data_port=taken).mesh_config()):
            pass
    text = str(err.value)
    assert f"cannot bind data-plane port {taken} on 127.0.0.1" in text
    assert "in use" in text and "--data-port ($FTMESH_DATA_PORT)" in text


async def test_a_state_port_in_use_names_the_flag(tmp_path: Path, taken: int) -> None:
    state = State(arrays={"w": np.arange(4.0)}, rng=False)
    state.commit(step=1)
    async with open_mesh(member(tmp_path, state_port=taken).mesh_config()) as mesh:
        with pytest.raises(ConfigError) as err:
            await mesh.serve_state(lookup_of(state))
    text = str(err.value)
    assert f"cannot bind state port {taken} on 127.0.0.1" in text
    assert "in use" in text and "--state-port ($FTMESH_STATE_PORT)" in text


async def test_binding_an_address_this_machine_does_not_own_says_advertise_it(
    tmp_path: Path,
) -> None:
    """The library's door (the CLI refuses such a ``--bind`` earlier): bind it, and the
    error says to bind a local address and advertise this one, not ``OSError 99``."""
    config = MeshConfig(node=NodeConfig(bind=NOT_OURS, registry_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match=f"{NOT_OURS} is not an address.*--advertise"):
        async with open_mesh(config):
            pass
