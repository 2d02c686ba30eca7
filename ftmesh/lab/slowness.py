"""Slowness faults for lab hosts: CPU throttling (cgroup CPU quota) and fail-slow pulses.

Theory of operation.

*Throttling* gives a host a CPU budget, as a slow or shared machine has: a cgroup of the CPU
controller per host, ``<cpu mount>/ftmesh-lab/<namespace>``, whose quota is ``share`` CPUs
(cgroup v1: ``cpu.cfs_quota_us = share * cpu.cfs_period_us``; v2: ``cpu.max``) over a
``PERIOD_US`` period. Every process of the host's network namespace is moved into it (writing
its pid to ``cgroup.procs`` moves all its threads), and processes the lab starts there later
join it before they exec (``VirtualLan.popen`` wraps the command), so their children are
throttled too. The kernel counts what it did in ``cpu.stat`` (periods, throttled periods,
throttled time), which ``cpu_stats`` reads back: a throttle that never bites shows as
``nr_throttled == 0``. The mount is found in ``/proc/mounts``: a ``cgroup`` mount whose options
include ``cpu`` (v1), else the ``cgroup2`` mount if its root offers the ``cpu`` controller.

*Fail-slow pulses* freeze a host for ``stop_s`` every ``every_s`` seconds, the way a machine
stalls in long GC pauses, swap storms or a noisy neighbour: a pulser process in the root
namespace (``python -m ftmesh.lab.slowness pulse ...``) SIGSTOPs every process of the
namespace, sleeps, SIGCONTs them, and sleeps the rest of the period. It counts pulses and the
process-seconds it kept stopped in a JSON stats file, rewritten after every pulse. On SIGTERM
(``stop_pulser``) it thaws what it stopped before exiting; it exits by itself once the
namespace is gone (a lab torn down, or its creator killed). A pulser killed with SIGKILL
leaves the host frozen until ``ftmesh lab thaw``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import LabError
from .procs import terminate

PERIOD_US = 10_000
"""CFS period of a throttled host (10 ms): the quota is spent and refilled every period, so a
quarter of a CPU means 2.5 ms of every 10 ms; short enough that the host looks slow rather
than stalling (the kernel's default 100 ms makes 75 ms pauses at a quarter)."""

MIN_SHARE = 0.01
"""Smallest CPU share accepted: 1 % of a CPU (1 ms of quota per 100 ms period)."""

MAX_SHARE = 1024.0
"""Largest CPU share accepted (CPUs): beyond any machine's core count."""

CGROUP_DIR = "ftmesh-lab"
"""Directory under the CPU controller's mount holding one cgroup per throttled host."""

MIN_PULSE_S = 0.001
MAX_PULSES_PER_S = 100
"""Pulses faster than this would be a busy loop of signals, not a fault model."""


# -- cgroups ---------------------------------------------------------------------------------
def cpu_mount(mounts: str | None = None) -> tuple[Path, int]:
    """The CPU controller's mount point and cgroup version (1 or 2); ``LabError`` if none."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError as e:
            raise LabError(f"cannot read /proc/mounts: {e}") from e
    v2: Path | None = None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        where, kind, options = parts[1], parts[2], parts[3].split(",")
        if kind == "cgroup" and "cpu" in options:
            return Path(where), 1
        if kind == "cgroup2" and v2 is None:
            v2 = Path(where)
    if v2 is not None:
        try:
            controllers = (v2 / "cgroup.controllers").read_text().split()
        except OSError:
            controllers = []
        if "cpu" in controllers:
            return v2, 2
    raise LabError("CPU throttling needs the cgroup 'cpu' controller (none is mounted)")


def host_cgroup(ns: str) -> tuple[Path, int]:
    """The cgroup (created if needed) of host namespace ``ns``, and the cgroup version."""
    mount, version = cpu_mount()
    base = mount / CGROUP_DIR
    try:
        base.mkdir(exist_ok=True)
        if version == 2:
            for parent in (mount, base):
                with contextlib.suppress(OSError):  # already on, or not allowed: seen below
                    (parent / "cgroup.subtree_control").write_text("+cpu")
        cg = base / ns
        cg.mkdir(exist_ok=True)
    except OSError as e:
        raise LabError(f"cannot create a CPU cgroup under {base}: {e}") from e
    if version == 2 and not (cg / "cpu.max").exists():
        raise LabError(f"the cpu controller is not enabled for {base} (cgroup v2)")
    return cg, version


def set_quota(cg: Path, version: int, share: float | None) -> None:
    """Limit cgroup ``cg`` to ``share`` CPUs (None: no limit). Shares under 0.1 CPU get a
    longer period: the kernel wants at least 1 ms of quota per period."""
    period = PERIOD_US if share is None else max(PERIOD_US, round(1000 / share))
    quota = None if share is None else round(share * period)
    try:
        if version == 1:
            (cg / "cpu.cfs_quota_us").write_text("-1")  # any period is valid while unlimited
            (cg / "cpu.cfs_period_us").write_text(str(period))
            if quota is not None:
                (cg / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (cg / "cpu.max").write_text(f"{'max' if quota is None else quota} {period}")
    except OSError as e:
        raise LabError(f"cannot set the CPU quota of {cg}: {e}") from e


def move_pids(cg: Path, pids: Sequence[int]) -> int:
    """Move processes into ``cg``; returns how many moved (those that exited meanwhile
    don't count)."""
    moved = 0
    for pid in pids:
        try:
            (cg / "cgroup.procs").write_text(str(pid))
            moved += 1
        except ProcessLookupError:
            continue
        except OSError as e:
            if e.errno == 3:  # ESRCH: gone
                continue
            raise LabError(f"cannot move pid {pid} into {cg}: {e}") from e
    return moved


def cpu_stats(cg: Path) -> dict[str, float]:
    """What the kernel did to the cgroup: ``periods``, ``throttled`` (periods in which it
    ran out of quota) and ``throttled_s`` (time its tasks waited for quota)."""
    try:
        raw = dict(
            (k, int(v))
            for k, v in (line.split() for line in (cg / "cpu.stat").read_text().splitlines())
        )
    except (OSError, ValueError) as e:
        raise LabError(f"cannot read {cg}/cpu.stat: {e}") from e
    if "throttled_time" in raw:  # v1: nanoseconds
        seconds = raw["throttled_time"] / 1e9
    else:  # v2: microseconds
        seconds = raw.get("throttled_usec", 0) / 1e6
    return {
        "periods": raw.get("nr_periods", 0),
        "throttled": raw.get("nr_throttled", 0),
        "throttled_s": seconds,
    }


def release_cgroup(cg: Path) -> None:
    """Move ``cg``'s processes back to the root cgroup and delete it (the throttle is
    lifted)."""
    root = cg.parent.parent
    try:
        pids = [int(t) for t in (cg / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        pids = []
    move_pids(root, pids)
    remove_cgroup(cg)


def remove_cgroup(cg: Path, timeout: float = 5.0) -> None:
    """Delete ``cg`` once its processes are gone (they were just killed: wait a little)."""
    deadline = time.monotonic() + timeout
    while cg.exists():
        try:
            cg.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                return  # still busy; cleanup_stale_cgroups retries later
            time.sleep(0.05)


def cleanup_stale_cgroups(live_namespaces: Sequence[str], pattern: str) -> list[str]:
    """Remove the host cgroups named like ``pattern`` (a regular expression) whose namespace
    no longer exists. Returns the names removed."""
    try:
        mount, _ = cpu_mount()
    except LabError:
        return []
    base = mount / CGROUP_DIR
    if not base.is_dir():
        return []
    removed = []
    live = set(live_namespaces)
    for cg in base.iterdir():
        if cg.is_dir() and cg.name not in live and re.fullmatch(pattern, cg.name):
            remove_cgroup(cg, timeout=0.5)
            if not cg.exists():
                removed.append(cg.name)
    return removed


def throttled_argv(cg: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` run from a shell that first joins cgroup ``cg`` (outside the namespace: ``ip
    netns exec`` remounts /sys, hiding the cgroup mounts), so it and its children are
    throttled from their first instruction."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cg), *argv]


# -- fail-slow pulses ------------------------------------------------------------------------
def netns_pids(ns: str) -> list[int]:
    """Pids whose network namespace is ``ns`` (as ``ip netns pids``, without a subprocess)."""
    try:
        target = os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        raise LabError(f"network namespace {ns} is gone") from None
    me = os.getpid()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{entry}/ns/net").st_ino == target:
                pids.append(int(entry))
    return pids


def check_pulse(stop_s: float, every_s: float) -> None:
    if not MIN_PULSE_S <= stop_s < every_s:
        raise LabError(f"a pulse stops for {stop_s}s: give 0.001 <= stop < every ({every_s}s)")
    if every_s < 1 / MAX_PULSES_PER_S:
        raise LabError(f"pulses every {every_s}s: at most {MAX_PULSES_PER_S} per second")


START_TIMEOUT = 30.0
"""Seconds a pulser may take to start (import ftmesh) and report that it runs."""


def start_pulser(ns: str, stop_s: float, every_s: float, stats: Path) -> subprocess.Popen[bytes]:
    """Start the pulser of host namespace ``ns`` (in the root namespace, its own session) and
    return once it has written its first stats record, i.e. pulses from now on."""
    check_pulse(stop_s, every_s)
    stats.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "ftmesh.lab.slowness", "pulse", ns, str(stop_s), str(every_s)]
    proc = subprocess.Popen(
        [*argv, str(stats)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + START_TIMEOUT
    while not read_pulse_stats(stats):
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-500:] if proc.stderr else ""
            raise LabError(f"the fail-slow pulser for {ns} exited ({proc.returncode}): {err}")
        if time.monotonic() > deadline:
            proc.kill()
            raise LabError(f"the fail-slow pulser for {ns} did not start in {START_TIMEOUT}s")
        time.sleep(0.02)
    if proc.stderr is not None:
        proc.stderr.close()
    return proc


def is_pulser(pid: int) -> bool:
    """Whether ``pid`` is a pulser (so a recorded pid reused by another process is spared)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"ftmesh.lab.slowness" in cmdline and b"pulse" in cmdline


def stop_pulser(pid: int, timeout: float = 5.0) -> None:
    """SIGTERM the pulser ``pid`` (it thaws its host first) and wait for it to exit."""
    terminate(pid, lambda: is_pulser(pid), timeout)


def read_pulse_stats(stats: Path) -> dict[str, Any]:
    """``pulses`` done, ``stopped_s`` (process-seconds kept stopped), ``stop_s``, ``every_s``;
    empty when the pulser has not written yet."""
    try:
        data = json.loads(stats.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _pulse(ns: str, stop_s: float, every_s: float, stats: Path) -> int:
    """The pulser's loop (see the module doc)."""
    stopped: list[int] = []
    done = {"stop": False}

    def on_term(signum: int, frame: object) -> None:
        done["stop"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    pulses, stopped_s, max_pids = 0, 0.0, 0

    def report() -> None:
        record = {
            "pulses": pulses,
            "stopped_s": round(stopped_s, 4),
            "max_pids": max_pids,
            "stop_s": stop_s,
            "every_s": every_s,
        }
        tmp = stats.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(stats)

    report()  # running: the first pulse follows at once
    next_at = time.monotonic()
    try:
        while not done["stop"]:
            try:
                pids = netns_pids(ns)
            except LabError:
                return 0  # the namespace is gone: the lab is down
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
            t0 = time.monotonic()
            while not done["stop"] and time.monotonic() - t0 < stop_s:
                time.sleep(min(0.01, stop_s))
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            held = time.monotonic() - t0
            pulses += 1
            stopped_s += held * len(stopped)
            max_pids = max(max_pids, len(stopped))
            stopped.clear()
            report()
            next_at += every_s
            while not done["stop"] and time.monotonic() < next_at:
                time.sleep(min(0.05, max(next_at - time.monotonic(), 0.0)))
    finally:
        for pid in stopped:  # interrupted mid-pulse: never leave the host frozen
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ftmesh.lab.slowness")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pulse", help="SIGSTOP/SIGCONT every process of a network namespace")
    p.add_argument("ns")
    p.add_argument("stop_s", type=float)
    p.add_argument("every_s", type=float)
    p.add_argument("stats", type=Path)
    args = ap.parse_args(argv)
    check_pulse(args.stop_s, args.every_s)
    return _pulse(args.ns, args.stop_s, args.every_s, args.stats)


if __name__ == "__main__":
    sys.exit(main())
