"""Slowness faults of the lab: CPU throttling (cgroup quota) and fail-slow pulses fire, as
measured from inside the host (CPU share, stopped time) and by the kernel's counters."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests_support import cpu_cgroups_available

from ftmesh.lab import VirtualLan, slowness
from ftmesh.lab.netns import LabError, _list_netns

pytestmark = [
    pytest.mark.netns,
    pytest.mark.timing,  # cgroup CPU throttles and fail-slow pulses
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or not cpu_cgroups_available(),
        reason="needs root (network namespaces) and the cgroup cpu controller; CI runs as root",
    ),
]

BUSY = [sys.executable, "-c", "while True: pass"]
# Sleeps 10 ms at a time for 4 s and prints the longest gap between two wake-ups: a freeze.
GAPS = [
    sys.executable,
    "-u",
    "-c",
    "import time\nm, t = 0.0, time.monotonic()\nend = t + 4\nwhile t < end:\n"
    "    time.sleep(0.01); n = time.monotonic(); m = max(m, n - t); t = n\nprint(m)",
]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _share(pids: list[int], seconds: float) -> float:
    """CPUs the processes used together over ``seconds``."""
    before, t0 = sum(_cpu_seconds(p) for p in pids), time.monotonic()
    time.sleep(seconds)
    return (sum(_cpu_seconds(p) for p in pids) - before) / (time.monotonic() - t0)


def test_throttle_and_fail_slow_fire() -> None:
    with VirtualLan(hosts=2) as lan:
        early = lan.popen(0, BUSY)  # started before the throttle: moved into the cgroup
        lan.set_cpu(0, 0.25)
        late = lan.popen(0, BUSY)  # started after: joins the cgroup before it execs
        time.sleep(0.3)
        used = _share([early.pid, late.pid], 1.5)
        assert used <= 0.25 * 1.25, f"two busy loops under a 0.25 CPU quota used {used:.2f}"
        stats = lan.cpu_stats(0)
        assert stats["throttled"] > 0 and stats["throttled_s"] > 0.5, stats
        assert lan.faults()["cpu"] == {0: 0.25}
        lan.set_cpu(0, None)  # lifted: the processes leave the cgroup, which is deleted
        cg = slowness.cpu_mount()[0] / slowness.CGROUP_DIR / lan.ns_name(0)
        assert not cg.exists() and lan.faults()["cpu"] == {}

        victim = lan.popen(1, GAPS, stdout=subprocess.PIPE, text=True)
        lan.set_fail_slow(1, 0.3, 1.0)  # returns once the pulser runs
        time.sleep(2.2)
        pulses = lan.fail_slow_stats(1)
        lan.set_fail_slow(1, None)
        out, _ = victim.communicate(timeout=30)
        assert float(out) >= 0.25, f"the victim never stood still: longest gap {out}"
        assert pulses["pulses"] >= 2 and pulses["stopped_s"] >= 0.5, pulses
        assert lan.fail_slow_stats(1) == {} and lan.faults()["fail_slow"] == {}
        # a pulse must not leave anything stopped once it is switched off
        for pid in lan.host_pids(0):
            assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T"
        with pytest.raises(LabError, match="stop"):
            lan.set_fail_slow(1, 2.0, 1.0)
        with pytest.raises(LabError, match="share"):
            lan.set_cpu(1, 0.0)


def _lab(tmp_path: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FTMESH_LAB_DIR": str(tmp_path / "state")}
    argv = [sys.executable, "-m", "ftmesh.cli.lab_cmd", "lab", "--name", "ftmslowt", *args]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    if check:
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r


def test_cli_cpu_and_failslow(tmp_path: Path) -> None:
    """``ftmesh lab cpu`` / ``failslow`` across invocations: ``status`` shows that both fire,
    and ``down`` leaves no cgroup and no pulser behind."""
    try:
        _lab(tmp_path, "up", "--hosts", "2")
        _lab(tmp_path, "run", "-d", "0", "--", *BUSY)
        _lab(tmp_path, "cpu", "0", "0.2")
        _lab(tmp_path, "failslow", "h1", "0.05", "0.2")
        _lab(tmp_path, "run", "-d", "1", "--", "sleep", "60")
        time.sleep(1.0)
        st = json.loads(_lab(tmp_path, "status", "--json").stdout)
        assert st["faults"]["cpu"] == {"0": 0.2}
        assert st["faults"]["fail_slow"] == {"1": {"stop_s": 0.05, "every_s": 0.2}}
        assert st["slowness"]["0"]["cpu"]["throttled"] > 0, st["slowness"]
        assert st["slowness"]["1"]["fail_slow"]["pulses"] >= 2, st["slowness"]
        assert _lab(tmp_path, "cpu", "0", "fast", check=False).returncode == 2
        pulser = json.loads((tmp_path / "state" / "ftmslowt.json").read_text())["lan"]
        pid = int(pulser["pulses"]["1"]["pid"])
        assert slowness.is_pulser(pid)
    finally:
        down = _lab(tmp_path, "down", check=False)
    assert down.returncode == 0, down.stderr
    assert not [ns for ns in _list_netns() if ns.startswith("ftmslowt")]
    assert not slowness.is_pulser(pid)
    base = slowness.cpu_mount()[0] / slowness.CGROUP_DIR
    assert not [cg for cg in base.iterdir() if cg.name.startswith("ftmslowt")]
