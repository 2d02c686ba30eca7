"""``ftmesh launch``: run a training script as N local workers, with optional chaos.

The workers find each other through a private registry directory (same-host discovery, no
multicast, no configuration), see ``ftmesh.connect``. A training script reports progress by
printing lines ``FTMESH {json}`` with at least ``step`` (committed steps); everything else it
prints goes to its log file. ``--kill-at STEP`` kills a random training worker with SIGKILL
once any worker has committed STEP steps; kills given the same STEP happen together, and
are deferred until more workers than that train, so at least one survives;
``--join-at STEP`` starts a new worker then. The first N workers get ``FTMESH_START_PEERS=N``
(``ElasticTrainer`` takes its first step once N train; joiners don't wait). The launcher
shows a live view, keeps every worker's log, and exits non-zero, naming the worker and
showing its traceback, when a worker it did not kill fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..errors import ConfigError

PROGRESS_PREFIX = "FTMESH "


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float
    killed: bool = False
    step: int = 0
    loss: float | None = None
    members: int = 0
    done: bool = False
    spare: bool = False
    """Its last step computed no samples (a hot spare): not a kill victim."""
    reported: bool = False
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    output: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


def add_launch_parser(sub: Any) -> None:
    p = sub.add_parser("launch", help="run a training script as N local workers")
    p.add_argument("-n", "--nprocs", type=int, required=True, help="workers to start")
    p.add_argument(
        "--kill-at",
        type=int,
        action="append",
        default=[],
        metavar="STEP",
        help="kill -9 a random worker once STEP steps are committed; repeatable"
        " (the same STEP twice kills two at once)",
    )
    p.add_argument(
        "--join-at",
        type=int,
        action="append",
        default=[],
        metavar="STEP",
        help="start a new worker once STEP steps are committed; repeatable",
    )
    p.add_argument("--discovery", choices=["local", "mdns", "seeds"], default="local")
    p.add_argument("--preset", choices=["local", "lan", "wan"], default="local")
    p.add_argument("--seed", type=int, default=0, help="seed for choosing whom to kill")
    p.add_argument("--log-dir", default=None, help="worker logs (default: runs/launch-TIME)")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this long (s)")
    p.add_argument("--no-live", action="store_true", help="plain progress lines, no live view")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)

    w = sub.add_parser("worker", help="run a training script as one member of a mesh")
    w.add_argument("--mesh", default="default")
    w.add_argument("--discovery", choices=["local", "mdns", "seeds"], default="mdns")
    w.add_argument("--join", action="append", default=[], metavar="HOST:PORT")
    w.add_argument("--interface", default="", metavar="IP")
    w.add_argument("--bind", default="", metavar="IP")
    w.add_argument("--port", type=int, default=0, help="gossip port (0: any free port)")
    w.add_argument("--preset", choices=["local", "lan", "wan"], default="lan")
    w.add_argument("--secret-file", default="")
    w.add_argument(
        "--start-peers",
        type=int,
        default=0,
        metavar="N",
        help="a fresh mesh takes its first step once N members train (sets $FTMESH_START_PEERS)",
    )
    w.add_argument(
        "--encrypt",
        action="store_true",
        help="encrypt gossip and the data plane (needs a secret; sets $FTMESH_ENCRYPT)",
    )
    w.add_argument("script")
    w.add_argument("args", nargs=argparse.REMAINDER)


def run_worker(args: argparse.Namespace) -> int:
    """``ftmesh worker``: set the mesh environment for ``ftmesh.connect`` and run the script."""
    env = dict(os.environ)
    env.update(
        FTMESH_MESH=args.mesh,
        FTMESH_DISCOVERY=args.discovery,
        FTMESH_JOIN=",".join(args.join),
        FTMESH_INTERFACE=args.interface,
        FTMESH_BIND=args.bind,
        FTMESH_PORT=str(args.port or ""),
        FTMESH_PRESET=args.preset,
        FTMESH_SECRET_FILE=args.secret_file,
    )
    if args.encrypt:
        env["FTMESH_ENCRYPT"] = "1"
    if args.start_peers:
        env["FTMESH_START_PEERS"] = str(args.start_peers)
    os.execvpe(sys.executable, [sys.executable, args.script, *args.args], env)
    return 127  # pragma: no cover - exec does not return


class Launcher:
    def __init__(self, args: argparse.Namespace, out: TextIO) -> None:
        if args.nprocs < 1:
            raise ConfigError("-n must be at least 1")
        if not Path(args.script).is_file():
            raise ConfigError(f"no such script: {args.script}")
        self.args = args
        self.out = out
        self.rng = random.Random(args.seed)
        self.kills = sorted(args.kill_at)
        self.joins = sorted(args.join_at)
        self.workers: list[Worker] = []
        self._kill_deferred = False
        self.events: deque[str] = deque(maxlen=8)
        self.t0 = time.monotonic()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_dir = Path(args.log_dir or f"runs/launch-{stamp}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._registry = tempfile.mkdtemp(prefix="ftmesh-launch-")
        self.env = dict(os.environ)
        self.env.pop("FTMESH_START_PEERS", None)  # only the first N get it (start_worker)
        threads = max(1, (os.cpu_count() or 1) // args.nprocs)
        self.env.update(
            FTMESH_MESH=f"launch-{os.getpid()}-{self.rng.getrandbits(32):08x}",
            FTMESH_DISCOVERY=args.discovery,
            FTMESH_REGISTRY_DIR=self._registry,
            FTMESH_PRESET=args.preset,
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS=str(threads),
        )

    def event(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {text}"
        self.events.append(line)
        if self.args.no_live or not self.out.isatty():
            print(line, file=self.out, flush=True)

    def start_worker(self, start_peers: int = 0) -> Worker:
        name = f"w{len(self.workers)}"
        log_path = self.log_dir / f"{name}.log"
        env = {**self.env, "FTMESH_WORKER_NAME": name}
        if start_peers:
            env["FTMESH_START_PEERS"] = str(start_peers)
        proc = subprocess.Popen(
            [sys.executable, self.args.script, *self.args.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        w = Worker(name, proc, log_path, time.monotonic())
        w.reader = threading.Thread(target=self._read, args=(w,), daemon=True)
        w.reader.start()
        self.workers.append(w)
        self.event(f"started {name} (pid {proc.pid})")
        return w

    def _read(self, w: Worker) -> None:
        assert w.proc.stdout is not None
        with open(w.log_path, "w") as log:
            for raw in w.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                if line.startswith(PROGRESS_PREFIX):
                    self._progress(w, line[len(PROGRESS_PREFIX) :])
                else:
                    w.tail.append(line)
                    if w.done:
                        w.output.append(line)

    def _progress(self, w: Worker, text: str) -> None:
        try:
            # raw_decode: tolerate text glued after the record (interleaved stderr).
            rec, _ = json.JSONDecoder().raw_decode(text)
        except ValueError:
            return
        if not isinstance(rec, dict):
            return
        if isinstance(rec.get("step"), int):
            w.step = rec["step"]
        if isinstance(rec.get("loss"), int | float):
            w.loss = float(rec["loss"])
        if isinstance(rec.get("members"), int):
            w.members = rec["members"]
        if isinstance(rec.get("share"), int):
            w.spare = rec["share"] == 0
        if rec.get("done"):
            w.done = True

    def committed(self) -> int:
        return max((w.step for w in self.workers), default=0)

    def chaos(self) -> None:
        step = self.committed()
        while self.kills and step >= self.kills[0]:
            # Kills given the same STEP happen together (that is how a test loses every
            # replica of a shard at once). Victims are training members (they reported
            # progress and computed samples, so not hot spares), never all of them: with no
            # survivor holding the state there would be nothing to recover from.
            batch = self.kills.count(self.kills[0])
            live = [
                w
                for w in self.workers
                if w.running and not w.killed and not w.done and not w.spare and w.step > 0
            ]
            if len(live) <= batch:
                if not self._kill_deferred:
                    self.event(
                        f"step {step}: kill deferred until {batch + 1} workers train"
                        f" ({len(live)} do)"
                    )
                    self._kill_deferred = True
                break
            self._kill_deferred = False
            for _ in range(batch):
                self.kills.pop(0)
                victim = self.rng.choice(live)
                live.remove(victim)
                victim.killed = True
                os.killpg(victim.proc.pid, signal.SIGKILL)
                self.event(f"step {step}: kill -9 {victim.name}")
        while self.joins and step >= self.joins[0]:
            self.joins.pop(0)
            w = self.start_worker()
            self.event(f"step {step}: {w.name} joins")

    def render(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"ftmesh launch: {self.args.script}", expand=False)
        for col in ("worker", "pid", "state", "step", "loss", "members"):
            table.add_column(col)
        for w in self.workers:
            state = (
                "killed"
                if w.killed
                else "done"
                if w.done and not w.running
                else "running"
                if w.running
                else f"exit {w.proc.returncode}"
            )
            table.add_row(
                w.name,
                str(w.proc.pid),
                state,
                str(w.step),
                "" if w.loss is None else f"{w.loss:.4f}",
                str(w.members),
            )
        elapsed = time.monotonic() - self.t0
        rate = self.committed() / elapsed if elapsed > 0 else 0.0
        head = Text(f"committed steps {self.committed()}  ({rate:.1f} steps/s)")
        return Group(head, table, Text("\n".join(self.events)))

    def run(self) -> int:
        try:
            for _ in range(self.args.nprocs):
                self.start_worker(start_peers=self.args.nprocs)
            live_view = not self.args.no_live and self.out.isatty()
            if live_view:
                from rich.live import Live

                with Live(self.render(), refresh_per_second=4) as live:
                    rc = self._loop(lambda: live.update(self.render()))
            else:
                rc = self._loop(None)
            return self._report(rc)
        finally:
            for w in self.workers:
                if w.running:
                    os.killpg(w.proc.pid, signal.SIGKILL)
                    w.proc.wait()
            shutil.rmtree(self._registry, ignore_errors=True)

    def _loop(self, refresh: Any) -> int:
        last_line = 0.0
        deadline = self.t0 + self.args.timeout
        while any(w.running for w in self.workers):
            if time.monotonic() > deadline:
                self.event(f"timeout after {self.args.timeout:.0f}s: stopping every worker")
                return 124
            self.chaos()
            for w in self.workers:
                rc = w.proc.poll()
                if rc is not None and not w.reported:
                    w.reported = True
                    if not w.killed:
                        self.event(f"{w.name} exited with code {rc} at step {w.step}")
            if refresh is not None:
                refresh()
            elif time.monotonic() - last_line > 2.0:
                last_line = time.monotonic()
                live = sum(w.running for w in self.workers)
                loss = next((w.loss for w in reversed(self.workers) if w.loss is not None), None)
                print(
                    f"  step {self.committed()}  live workers {live}  loss "
                    f"{'-' if loss is None else f'{loss:.4f}'}",
                    file=self.out,
                    flush=True,
                )
            time.sleep(0.05)
        return 0

    def _report(self, rc: int) -> int:
        for w in self.workers:
            if w.reader is not None:
                w.reader.join(5.0)
        failed = [w for w in self.workers if not w.killed and w.proc.returncode not in (0,)]
        ok = [w for w in self.workers if not w.killed and w.proc.returncode == 0]
        print(f"logs: {self.log_dir}", file=self.out)
        for w in failed:
            print(
                f"\nworker {w.name} (pid {w.proc.pid}) failed with exit code "
                f"{w.proc.returncode}; last lines of {w.log_path}:",
                file=self.out,
            )
            for line in list(w.tail)[-25:]:
                print(f"  | {line}", file=self.out)
        if ok:
            for line in ok[0].output:
                print(line, file=self.out)
        if rc:
            return rc
        return 1 if failed or not ok else 0


def run_launch(args: argparse.Namespace) -> int:
    return Launcher(args, sys.stdout).run()
