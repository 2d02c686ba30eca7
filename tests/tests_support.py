"""Helpers shared by the end-to-end training tests."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
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
NIGHTLY = os.environ.get("FTMESH_NIGHTLY") == "1"
"""``FTMESH_NIGHTLY=1``: the long versions of the end-to-end runs (twenty kills on two mesh
sizes, full-length soaks, the minute of loss, issue 4's between-steps evaluations at 30 s);
the default run keeps one run per property, sized to show it."""


def cpu_cgroups_available() -> bool:
    """Whether the cgroup ``cpu`` controller is mounted (the lab's CPU throttle needs it)."""
    try:
        slowness.cpu_mount()
    except LabError:
        return False
    return True


def launch(
    tmp: Path, *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftmesh", "launch", "--no-live", "--log-dir", str(tmp), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


PLATEAU = 9
"""Evaluations averaged by :func:`plateau`: the last three epochs' at ``--eval-every 15``."""


def plateau(records: list[dict[str, object]]) -> float:
    """The mean test accuracy over the last :data:`PLATEAU` evaluations of a digits run. With
    a constant learning rate this small model's accuracy moves by +-0.01 from one evaluation
    to the next, and any perturbation of the trajectory (float32 summation order already
    does it) lands the last evaluation anywhere in that band; the mean over the plateau is
    what a change of the training could degrade."""
    accs = [float(r["accuracy"]) for r in records if "accuracy" in r]  # type: ignore[arg-type]
    assert len(accs) >= PLATEAU, records[-3:]
    return sum(accs[-PLATEAU:]) / PLATEAU


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


def on_member_threads(n: int, member: Any, timeout: float = 150.0) -> None:
    """Run ``member(i)`` for i in 0..n-1, each in its own thread (members of one in-process
    mesh); fails with every member's exception, if any raised or one did not end in time."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            member(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    assert not [t for t in threads if t.is_alive()], "a member did not end in time"


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


def code_hash() -> str:
    """A digest of every file under ``examples/`` and ``ftmesh/`` (paths and contents): a
    cached reference run is valid while it is unchanged."""
    h = hashlib.sha256()
    for top in ("examples", "ftmesh"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Reference:
    """One finished single-process run: its output (stdout and stderr) and, when it was
    asked for with ``save_model``, the final weights (``model``)."""

    out: str
    model: Path | None

    def accuracy(self) -> float:
        return accuracy(self.out)


class References:
    """Single-process reference runs (``python SCRIPT *ARGS``, one torch thread), one per
    argument set, cached on disk in ``cache`` under a key of the script, the arguments and
    :func:`code_hash`: every test that compares against a single process shares one run, in
    this session and the next ones while the code is unchanged. A file lock per key makes
    parallel pytest workers (xdist) run each reference once."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.cache.mkdir(parents=True, exist_ok=True)
        self._code = code_hash()

    def run(
        self, *args: str, script: str = EXAMPLE, save_model: bool = False, timeout: float = 600
    ) -> Reference:
        key_src = json.dumps([script, list(args), save_model, self._code])
        key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
        out_path, model_path = self.cache / f"{key}.out", self.cache / f"{key}.pt"
        with open(self.cache / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not out_path.exists():
                argv = [sys.executable, script, *args]
                if save_model:
                    argv += ["--save-model", str(model_path)]
                res = subprocess.run(
                    argv,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    cwd=ROOT,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
                assert res.returncode == 0, f"reference {argv} failed:\n{res.stderr[-3000:]}"
                tmp = out_path.with_suffix(".tmp")
                tmp.write_text(res.stdout + res.stderr)
                tmp.replace(out_path)  # written last: its presence means the run is complete
        return Reference(out_path.read_text(), model_path if save_model else None)


def references_dir() -> Path:
    """Where :class:`References` caches (``FTMESH_REFERENCE_CACHE``, else a directory in the
    system's temporary directory)."""
    default = Path(tempfile.gettempdir()) / "ftmesh-test-references"
    return Path(os.environ.get("FTMESH_REFERENCE_CACHE", default))


class SingleRun:
    """``examples/train_digits.py --single`` (the baseline accuracy), from the session's
    :class:`References` (run once, cached on disk)."""

    def __init__(self, refs: References) -> None:
        self._refs = refs

    def accuracy(self) -> float:
        return self._refs.run("--single").accuracy()


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
        with self.proc.stdout, open(self.log, "w") as out:  # (the pipe closed at its end)
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
