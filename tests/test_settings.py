"""``ftmesh.settings``: one way from flags, ``FTMESH_*`` and ``connect()`` arguments to the
node config, and ``connect()``'s errors at the door.

Address choices are checked against a host described to ``ftmesh.discovery.interfaces``
(which interfaces exist, which holds the default route); the lab tests
(``test_lab_doors.py``) run the same choices on real namespaces."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

import ftmesh
from ftmesh.cli.devices import free_slot, visible_gpus, worker_env
from ftmesh.cli.launch_cmd import live_view_available
from ftmesh.cli.main import build_parser
from ftmesh.cli.worker_cmd import worker_settings
from ftmesh.discovery import interfaces
from ftmesh.discovery.interfaces import Interface
from ftmesh.errors import ConfigError, FtmeshError, MeshClosedError
from ftmesh.settings import ENV, Settings

ROOT = Path(__file__).resolve().parent.parent
SECRET = "a mesh secret of some length"


def test_environment_then_explicit_values() -> None:
    env = {
        "FTMESH_MESH": "lab",
        "FTMESH_JOIN": "10.0.0.4:7946, seed.example:7946,",
        "FTMESH_PORT": "7946",
        "FTMESH_DATA_PORT": "7947",
        "FTMESH_STATE_PORT": "7948",
        "FTMESH_ENCRYPT": "yes",
        "FTMESH_SECRET": SECRET,
        "FTMESH_START_PEERS": "4",
        "FTMESH_META": "rack=3,zone=b",
    }
    s = Settings.from_env(env)
    assert (s.mesh, s.join, s.port, s.encrypt, s.start_peers) == (
        "lab",
        ("10.0.0.4:7946", "seed.example:7946"),
        7946,
        True,
        4,
    )
    assert s.meta == {"rack": 3, "zone": "b"}
    assert (s.data_port, s.state_port) == (7947, 7948)
    assert SECRET not in repr(s)
    # Explicit values win; None is "not given"; an empty list and "" are values.
    t = s.replace(mesh="other", port=None, join=(), encrypt=False)
    assert (t.mesh, t.port, t.join, t.encrypt) == ("other", 7946, (), False)
    assert s.replace(mesh="").mesh == ""
    # What a command hands to its script gives the same settings back.
    assert Settings.from_env(s.to_env()) == s
    assert set(s.to_env()) <= set(ENV.values())


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"FTMESH_PORT": "abc"}, "$FTMESH_PORT"),
        ({"FTMESH_PORT": ""}, "$FTMESH_PORT"),
        ({"FTMESH_DATA_PORT": "any"}, "$FTMESH_DATA_PORT"),
        ({"FTMESH_STATE_PORT": "7948/tcp"}, "$FTMESH_STATE_PORT"),
        ({"FTMESH_ENCRYPT": "maybe"}, "$FTMESH_ENCRYPT"),
        ({"FTMESH_START_TIMEOUT": "soon"}, "$FTMESH_START_TIMEOUT"),
        ({"FTMESH_META": "novalue"}, "$FTMESH_META"),
    ],
)
def test_bad_environment_names_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("$", r"\$")):
        Settings.from_env(env)


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"mesh": ""}, "--mesh"),
        ({"mesh": "a/b"}, "--mesh"),
        ({"bind": ""}, "--bind"),
        ({"port": 70000}, "--port"),
        ({"data_port": 70000}, "--data-port"),
        ({"state_port": -1}, "--state-port"),
        # Two listeners, one fixed port: refused before either binds (0 is never a clash).
        ({"port": 7946, "data_port": 7946}, "--port.*--data-port.*each listener"),
        ({"data_port": 7947, "state_port": 7947}, "--data-port.*--state-port"),
        ({"state_port": 9464, "metrics_port": 9464}, "--state-port.*--metrics-port"),
        ({"preset": "fast"}, "--preset"),
        ({"discovery": "carrier-pigeon"}, "--discovery"),
        ({"join": ("nonsense",)}, "--join"),
        ({"secret_file": ""}, "--secret-file"),
        ({"secret_file": "/nonexistent/secret"}, "--secret-file"),
        ({"encrypt": True}, "--secret-file"),
        ({"start_peers": -1}, "--start-peers"),
        ({"start_timeout": 0.0}, "--start-timeout"),
        ({"interface": "no-such-if0"}, "--interface"),
        ({"advertise": "somewhere"}, "--advertise"),
    ],
)
def test_bad_settings_name_the_setting(given: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named) as err:
        Settings().replace(**given).node_config()
    assert "\n" not in str(err.value)


def test_a_single_string_is_not_a_list_of_seeds() -> None:
    with pytest.raises(ConfigError, match="not one string"):
        Settings().replace(join="10.0.0.4:7946")


# ------------------------------------------------------------------ addresses


LAN = Interface("eth0", "10.1.0.5", True, False)
WIFI = Interface("wlan0", "192.168.7.2", True, False)
LO = Interface("lo", "127.0.0.1", True, True)


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A host described to ftmesh: ``host["ifs"]`` its interfaces, ``host["route"]`` the
    interface holding the default route (None: none)."""
    desc: dict[str, Any] = {"ifs": [LO, LAN], "route": "eth0"}
    monkeypatch.setattr(interfaces, "interfaces", lambda: list(desc["ifs"]))
    monkeypatch.setattr(interfaces, "default_route_interface", lambda *a: desc["route"])
    return desc


def addrs(s: Settings) -> tuple[str, str, str]:
    nc = s.node_config()
    return nc.interface, nc.bind, nc.advertise


def test_mdns_uses_the_default_route_interface(host: dict[str, Any]) -> None:
    host["ifs"] = [LO, WIFI, LAN]
    assert addrs(Settings(discovery="mdns")) == ("10.1.0.5", "10.1.0.5", "10.1.0.5")
    # Bound to every interface, it still announces (and advertises) the LAN address.
    assert addrs(Settings(discovery="mdns", bind="0.0.0.0")) == ("10.1.0.5", "0.0.0.0", "10.1.0.5")


def test_no_default_route(host: dict[str, Any]) -> None:
    host["route"] = None
    assert addrs(Settings(discovery="mdns"))[0] == "10.1.0.5"  # the only candidate
    host["ifs"] = [LO, WIFI, LAN]
    with pytest.raises(ConfigError) as err:
        Settings(discovery="mdns").node_config()
    assert "wlan0 192.168.7.2" in str(err.value) and "eth0 10.1.0.5" in str(err.value)
    assert "--interface" in str(err.value)
    host["ifs"] = [LO]
    with pytest.raises(ConfigError, match="'local' discovery"):
        Settings(discovery="mdns").node_config()


def test_seeds_bind_where_the_seeds_can_reach(host: dict[str, Any]) -> None:
    assert addrs(Settings(join=("127.0.0.1:7946",)))[1:] == ("127.0.0.1", "127.0.0.1")
    assert addrs(Settings(join=("localhost:7946",)))[1] == "127.0.0.1"
    remote = Settings(join=("ftmesh.ns.svc.cluster.local:7946",))
    assert remote.node_config().discovery == "seeds"
    assert addrs(remote)[1:] == ("10.1.0.5", "10.1.0.5")
    assert addrs(Settings(discovery="seeds"))[1] == "10.1.0.5"  # the first member
    host["ifs"] = [LO]
    assert addrs(Settings(discovery="seeds"))[1] == "127.0.0.1"  # no LAN: only this host
    # Never advertise an address the seeds cannot reach.
    with pytest.raises(ConfigError, match="loopback"):
        Settings(join=("10.0.0.4:7946",), bind="127.0.0.1").node_config()


def test_advertise_may_name_an_address_this_host_does_not_own(host: dict[str, Any]) -> None:
    """Behind NAT or a port forward: bind here, advertise the public address (no interface
    of this host holds 203.0.113.9)."""
    seeds = ("10.0.0.4:7946",)
    assert addrs(Settings(join=seeds, advertise="203.0.113.9")) == ("", "10.1.0.5", "203.0.113.9")
    nat = Settings(join=seeds, bind="0.0.0.0", advertise="203.0.113.9")
    assert addrs(nat) == ("", "0.0.0.0", "203.0.113.9")
    assert addrs(Settings(advertise="192.0.2.1")) == ("", "127.0.0.1", "192.0.2.1")  # local
    # Its ports can be fixed, so that the NAT can forward them: the mesh config has them.
    mc = nat.replace(port=7946, data_port=7947, state_port=7948).mesh_config()
    assert (mc.node.port, mc.data_port, mc.state_port) == (7946, 7947, 7948)
    assert (Settings().mesh_config().data_port, Settings().mesh_config().state_port) == (0, 0)


def test_local_binds_loopback(host: dict[str, Any]) -> None:
    assert addrs(Settings()) == ("", "127.0.0.1", "127.0.0.1")


def test_start_peers_are_advertised_for_ftmesh_status(host: dict[str, Any]) -> None:
    assert Settings(start_peers=4).node_config().meta == {"expect": 4}
    assert Settings(start_peers=1, meta={"a": 1}).node_config().meta == {"a": 1}


# ------------------------------------------------------------------ connect()


def test_connect_explicit_arguments_beat_the_environment(tmp_path: Path) -> None:
    env = {"FTMESH_MESH": "from-env", "FTMESH_START_PEERS": "3", "FTMESH_PRESET": "wan"}
    with ftmesh.connect(
        mesh="explicit", registry_dir=str(tmp_path), preset="local", environ=env
    ) as m:
        assert m.mesh.config.node.mesh == "explicit"
        assert m.mesh.config.node.registry_dir == str(tmp_path)
        assert m.start_config.start_peers == 3  # for the trainer made on it
    with pytest.raises(ConfigError, match="--mesh"):
        ftmesh.connect(mesh="", environ=env)


def test_connect_raises_the_error_itself(tmp_path: Path) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=f"cannot bind gossip port {port}.*--port"):
            ftmesh.connect(port=port, registry_dir=str(tmp_path), environ={})
    finally:
        taken.close()


def test_an_error_that_ends_the_mesh_reaches_the_caller(tmp_path: Path) -> None:
    m = ftmesh.connect(registry_dir=str(tmp_path), preset="local", environ={})

    async def boom() -> None:
        raise FtmeshError("the disk caught fire")

    # A task of the mesh fails: the mesh thread ends with that error.
    m.call_sync(m.mesh._nursery.start_soon, boom)
    deadline = time.monotonic() + 10
    with pytest.raises(MeshClosedError, match="the disk caught fire") as err:
        while time.monotonic() < deadline:
            m.members()
            time.sleep(0.01)
    assert isinstance(err.value.__cause__, FtmeshError)
    m.close()


# ------------------------------------------------------------------ what commands pass on


def test_the_k8s_worker_command_passes_every_flag_on() -> None:
    """The manifest's worker command: every flag reaches the script's ``connect()``
    (``--port 7946`` was once parsed and dropped, and every pod trained alone)."""
    import yaml

    from ftmesh.lab.pods import expand_vars

    docs = yaml.safe_load_all((ROOT / "examples" / "k8s" / "ftmesh-train.yaml").read_text())
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    pod = {"POD_NAMESPACE": "ml", "POD_IP": "10.4.0.7"}
    argv = [expand_vars(a, pod) for a in [*container["command"], *container["args"]]][1:]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    given = worker_settings(build_parser().parse_args(argv), env)
    handed = Settings.from_env(given.to_env())
    assert handed == given
    assert (handed.port, handed.bind, handed.discovery, handed.mesh) == (
        7946,
        "10.4.0.7",
        "seeds",
        "digits",
    )
    assert handed.join == ("ftmesh.ml.svc.cluster.local:7946",)
    assert (handed.data_port, handed.state_port) == (7947, 7948)  # the NetworkPolicy's
    assert handed.secret_file == "/var/run/secrets/ftmesh/secret" and handed.start_peers == 4


def test_gpus_and_slots(tmp_path: Path) -> None:
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvme0"):
        (tmp_path / name).touch()
    assert visible_gpus({}, dev=tmp_path) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}, dev=tmp_path) == ["3", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,-1,4"}, dev=tmp_path) == ["2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, dev=tmp_path) == []
    assert visible_gpus({}, dev=tmp_path / "absent") == []
    assert free_slot({0, 1, 3}) == 2
    assert worker_env(3, ["3", "5"]) == {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "5"}
    assert worker_env(0, []) == {"LOCAL_RANK": "0"}  # no GPU: CUDA_VISIBLE_DEVICES untouched


def test_the_live_view_is_a_runtime_dependency() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("rich") for d in project["dependencies"])
    assert live_view_available()
