"""Helpers shared by the end-to-end training tests."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftmesh.collective import CollectiveConfig
from ftmesh.lab import VirtualLan, slowness
from ftmesh.lab.netns import LabError
from ftmesh.membership.config import MembershipConfig
from ftmesh.mesh.core import MeshConfig
from ftmesh.net.node import NodeConfig

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "train_digits.py")
FTMESH = str(Path(sys.executable).parent / "ftmesh")
"""The ``ftmesh`` command, as a user runs it."""


def cpu_cgroups_available() -> bool:
    """Whether the cgroup ``cpu`` controller is mounted (the lab's CPU throttle needs it)."""
    try:
        slowness.cpu_mount()
    except LabError:
        return False
    return True


def launch(tmp: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftmesh", "launch", "--no-live", "--log-dir", str(tmp), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def progress(log_dir: Path) -> dict[str, list[dict[str, object]]]:
    out: dict[str, list[dict[str, object]]] = {}
    for log in sorted(log_dir.glob("w*.log")):
        out[log.stem] = [
            json.JSONDecoder().raw_decode(line[len("FTMESH ") :])[0]
            for line in log.read_text().splitlines()
            if line.startswith("FTMESH ")
        ]
    return out


def accuracy(text: str) -> float:
    found = re.findall(r"^test accuracy: (0\.\d+)$", text, re.M)
    assert found, text[-2000:]
    return float(found[-1])


def check_consistency(
    records: dict[str, list[dict[str, object]]], total: int, batch: int = 32
) -> None:
    check_consistency_from(records, first=1, total=total, batch=batch)


def check_consistency_from(
    records: dict[str, list[dict[str, object]]], *, first: int, total: int, batch: int = 32
) -> None:
    """Bitwise-identical states at every step (digests), steps never repeat, every step is
    committed by somebody, and every step covered its whole global batch (``batch``)."""
    digests: dict[int, set[str]] = defaultdict(set)
    committed: set[int] = set()
    for name, recs in records.items():
        steps = [int(r["step"]) for r in recs if "done" not in r]  # type: ignore[call-overload]
        assert steps == sorted(set(steps)), f"{name} repeated or reordered a step"
        for prev, cur in itertools.pairwise(recs):
            if "done" in cur:
                continue
            if int(cur["step"]) != int(prev["step"]) + 1:  # type: ignore[call-overload]
                assert cur["synced"], f"{name} skipped from {prev['step']} to {cur['step']}"
        for r in recs:
            if r.get("digest"):
                digests[int(r["step"])].add(str(r["digest"]))  # type: ignore[call-overload]
            if "done" not in r:
                committed.add(int(r["step"]))  # type: ignore[call-overload]
                assert r["samples"] == batch, r
    assert committed == set(range(first, total + 1)), "some step was never committed"
    split = {s: d for s, d in digests.items() if len(d) > 1}
    assert not split, f"members disagree at steps {sorted(split)[:5]}"


def local_mesh_config(registry: Path, mesh: str, **collective: Any) -> MeshConfig:
    """A mesh of members in this process or on this host: same-host discovery in
    ``registry``, the ``local`` preset, a 60 s ``io_timeout`` (far above any test's wait)."""
    return MeshConfig(
        node=NodeConfig(
            mesh=mesh,
            discovery="local",
            registry_dir=str(registry),
            membership=MembershipConfig.preset("local"),
        ),
        collective=CollectiveConfig(**{"io_timeout": 60.0, "view_timeout": 5.0, **collective}),
    )


class SingleRun:
    """``examples/train_digits.py --single`` (the baseline accuracy), started in the
    background when a test asks for it and shared by every test of the session."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, EXAMPLE, "--single"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self._out: str | None = None

    def accuracy(self) -> float:
        if self._out is None:
            self._out, _ = self._proc.communicate(timeout=600)
            assert self._proc.returncode == 0, self._out[-3000:]
        return accuracy(self._out)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


class Worker:
    """One ``ftmesh worker`` process running ``examples/train_digits.py`` (or ``script``), its
    output in ``log``; ``steps()`` are its progress records. ``prefix`` runs it under a
    wrapper (``prlimit``, ``faketime``)."""

    def __init__(
        self,
        log: Path,
        env: dict[str, str],
        *worker_args: str,
        prefix: tuple[str, ...] = (),
        script_args: tuple[str, ...] = ("--epochs", "1000", "--digest-every", "0"),
    ) -> None:
        self.log = log
        self._out = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-m",
                "ftmesh",
                "worker",
                *worker_args,
                EXAMPLE,
                *script_args,
            ],
            cwd=ROOT,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def steps(self) -> list[dict[str, Any]]:
        out = []
        for line in self.text().splitlines():
            if line.startswith("FTMESH "):
                with contextlib.suppress(ValueError):
                    out.append(json.JSONDecoder().raw_decode(line[len("FTMESH ") :])[0])
        return out

    def last_step(self) -> int:
        recs = [r for r in self.steps() if "done" not in r]
        return int(recs[-1]["step"]) if recs else 0

    def wait(self, pred: Callable[[Worker], bool], timeout: float, what: str) -> float:
        """Poll until ``pred(self)``; the seconds it took. Fails with the log's tail."""
        start = time.monotonic()
        while not pred(self):
            if self.proc.poll() is not None or time.monotonic() - start > timeout:
                raise AssertionError(
                    f"{what} not within {timeout:.0f}s (rc {self.proc.poll()}):\n"
                    + self.text()[-3000:]
                )
            time.sleep(0.1)
        return time.monotonic() - start

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._out.close()


class Machine:
    """A command run on one lab host; its ``FTMESH {json}`` lines parsed as they come."""

    def __init__(self, lan: VirtualLan, host: int, argv: list[str], log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTMESH_")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.log = log
        self.proc = lan.popen(
            host,
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            cwd=ROOT,
        )
        self.records: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log, "w") as out:
            for line in self.proc.stdout:
                out.write(line)
                self.lines.append(line)
                if line.startswith("FTMESH "):
                    self.records.append(json.JSONDecoder().raw_decode(line[7:])[0])

    def step(self) -> int:
        return max((int(r["step"]) for r in self.records if "step" in r), default=0)

    def finish(self, timeout: float) -> str:
        self.proc.wait(timeout=timeout)
        self._reader.join(10)
        return "".join(self.lines)


def wait_until(cond: Any, timeout: float, what: str, machines: list[Machine]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            tails = ["".join(m.lines[-8:]) for m in machines]
            raise AssertionError(f"{what} within {timeout}s; last lines: {tails}")
        time.sleep(0.2)
