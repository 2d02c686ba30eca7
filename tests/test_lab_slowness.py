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


QUOTA = 0.25
"""The throttle's quota on a quiet host (CPUs)."""


def _quota(free: float) -> float:
    """The quota for two busy loops that the host lets use ``free`` CPUs in their cgroup:
    ``QUOTA``, or a quarter of ``free`` when that is less, so that the quota bites.

    A quota bites only on what the host would give: on cgroup v1 every lab host's cgroup sits
    under one parent (``slowness.CGROUP_DIR``) that competes with the root cgroup's tasks as
    one task would (``cpu.shares`` 1024), so at a load average of 10 on 2 cores the two loops
    get about 0.2 CPU in all, below a 0.25 quota, and the kernel never throttles them (seen in
    parallel suite runs: 0.09 s throttled)."""
    return max(slowness.MIN_SHARE, min(QUOTA, round(free / 4, 2)))


def _cgroup_of(pid: int) -> str:
    """The cpu controller's cgroup path of ``pid`` (cgroup v1 line ``N:cpu...:/path``, or the
    v2 line ``0::/path``)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") or (controllers == "" and slowness.cpu_mount()[1] == 2):
            return path
    return ""


def _wait_in_host(lan: VirtualLan, i: int, pid: int, timeout: float = 10.0) -> None:
    """Until ``pid`` runs in host ``i``'s namespace (``VirtualLan.host_pids``)."""
    end = time.monotonic() + timeout
    while pid not in lan.host_pids(i):
        assert time.monotonic() < end, f"pid {pid} did not enter host {i} in {timeout:.0f}s"
        time.sleep(0.02)


def test_throttle_and_fail_slow_fire() -> None:
    with VirtualLan(hosts=2) as lan:
        early = lan.popen(0, BUSY)  # started before the throttle: moved into the cgroup
        # (once in the namespace: `ip netns exec` may not have entered it yet on a loaded
        # host, and the throttle moves the namespace's processes: run 30 on 8843703)
        _wait_in_host(lan, 0, early.pid)
        lan.set_cpu(0, 2.0)  # a quota two busy loops cannot reach on 2 cores: what they get
        late = lan.popen(0, BUSY)  # started after: joins the cgroup before it execs
        own = f"/{slowness.CGROUP_DIR}/{lan.ns_name(0)}"
        time.sleep(0.3)
        assert _cgroup_of(early.pid) == own and _cgroup_of(late.pid) == own
        free = _share([early.pid, late.pid], 1.0)
        quota = _quota(free)  # (QUOTA on a quiet host)
        lan.set_cpu(0, quota)
        assert _cgroup_of(early.pid) == own and _cgroup_of(late.pid) == own
        before = lan.cpu_stats(0)
        used = _share([early.pid, late.pid], 1.5)
        stats = lan.cpu_stats(0)
        print(f"two busy loops: {free:.2f} CPU in the cgroup, {used:.2f} under a {quota} quota")
        assert used <= quota * 1.25, f"two busy loops under a {quota} CPU quota used {used:.2f}"
        bit = {k: stats[k] - before[k] for k in ("throttled", "throttled_s")}
        assert bit["throttled"] > 0 and bit["throttled_s"] > 0.5, (bit, stats)
        assert lan.faults()["cpu"] == {0: quota}
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
