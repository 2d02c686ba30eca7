"""``ftmesh launch``: run a training script as N local workers, with optional chaos.

By default the workers find each other through a private registry directory (same-host
discovery, no multicast, no configuration), see ``ftmesh.connect``; ``--discovery seeds``
(with ``--join`` to join a mesh elsewhere) and ``--discovery mdns`` take the settings flags of
``ftmesh worker``, with the same meaning. Each worker runs as ``ftmesh worker`` with those
settings in its environment (``ftmesh.settings``), ``LOCAL_RANK`` (its slot) and, on a host
with GPUs, ``CUDA_VISIBLE_DEVICES`` (the slot's GPU, see ``ftmesh.cli.devices``). Worker
``k`` binds gossip port ``--port`` + ``k`` when a port is given (with seeds always, from a
free one), and with seeds the first N workers' addresses are every worker's seeds, so other
hosts can join through the first one; likewise data-plane port ``--data-port`` + ``k``,
state port ``--state-port`` + ``k`` and metrics port ``--metrics-port`` + ``k`` when given
(ranges that overlap are refused before any worker starts).

The launcher follows the training from the mesh itself: it reads the workers' member list
as an observer (``ftmesh.cli.live_view.BackgroundReader``: an observer push-pull a few times a
second; it never joins) and takes each worker's committed step, world size, share, step time,
samples/s, backend and last fault from the progress the worker publishes in its metadata
(``Mesh.report_progress``, which the trainer calls after each committed step), so a script
that prints nothing gets the same view. A training script *may* also print lines ``FTMESH
{json}`` (``PROGRESS_PREFIX``; keys ``step``, ``loss``, ``members``, ``share``, ``done``): an
extra channel, merged with the mesh's (the larger step wins), and the only source of
``loss``; everything else it prints goes to its log file. ``--kill-at STEP`` kills a random
training worker with SIGKILL once any worker has committed STEP steps; kills given the
same STEP happen together, and are deferred until more workers than that train, so at least
one survives; ``--join-at STEP`` starts a new worker then (the view says it *joins* at its
first committed step), and ``--respawn`` replaces a worker that died. The first N workers
start together (``start_peers`` = N unless ``--start-peers`` says otherwise); workers added
later only join the running mesh (``join_running``): one that arrives after training ended
exits cleanly, and no worker is added once it has. The launcher shows a live view (``rich``;
plain lines without a terminal), keeps every worker's log, reports every worker's exit (in
the view when it happens, and in the final summary), warns about a ``--kill-at`` or
``--join-at`` that never fired, runs until the workers are done (``--timeout``: a limit, none
by default) and exits non-zero, naming the worker and showing its traceback, when a worker it
did not kill fails.

The numbers are the mesh's: the view shows the running workers' published steps, worlds and
losses (a dead worker's leave the view), one plain line whenever it changes; the summary
gives each worker's last step as it published it (each ``ftmesh worker`` writes its mesh's
last published progress to ``<log dir>/wN.final.json`` as it exits, ``--final-report``, since
the reads a few times a second may miss the last ones) and the run's committed steps; a
``--kill-at``/``--join-at`` that never fired says why (the run ended first, the workers
failed, the launcher was stopped). SIGTERM (``timeout``, systemd, Docker, Kubernetes) and
SIGINT are a planned departure for every worker (SIGTERM to each), waited for up to
``LEAVE_GRACE_S`` (then SIGKILL; a second signal: at once); the launcher exits with status
128 + the signal and says how each worker ended. With local discovery the workers use the
default registry (``/tmp/ftmesh-$UID``, or ``--registry-dir``) as mesh ``launch-PID-RANDOM``
(``--mesh`` names it), printed at the start, so ``ftmesh status`` on the same host finds it
(by that name, or alone with no mesh named); the launcher removes its workers' entries and
the mesh's directory when it ends, however it ends.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..discovery.local import default_registry_dir, remove_entries
from ..errors import ConfigError
from ..membership.messages import MemberState
from ..mesh.blocking import REPEAT_AFTER_S
from ..settings import DEFAULT_MESH, ENV, PORT_SETTINGS, Settings, label
from .args import TRAINER_FLAGS, add_settings_args, settings_from_args
from .devices import free_slot, visible_gpus, worker_env
from .escape import shown
from .live_view import BackgroundReader, MemberRow, MeshReader, live_view_available
from .worker_cmd import Target, add_target_args, add_worker_parser

PROGRESS_PREFIX = "FTMESH "
MAX_FRUITLESS_RESPAWNS = 3
"""Replacements of a slot in a row that died before their first step, after which the slot
is not respawned again: a script that cannot start would otherwise restart forever."""
STOP_GRACE_S = 5.0
"""Seconds a worker the launcher stops gets between SIGTERM and SIGKILL."""
LEAVE_GRACE_S = 20.0
"""Seconds the workers get to leave after the launcher is asked to stop (SIGTERM or SIGINT):
each is sent SIGTERM (a planned departure at its next step boundary: the rest of the step,
one more at most, the leave, the process' exit; see docs/guide/running.md, "Leaving"), and
the ones still running after this bound are killed with SIGKILL. So the launcher exits within
this bound (and a moment to reap) of the signal, and no worker outlives it. Under Kubernetes'
default grace (30 s); Docker's (10 s) ends the whole container anyway."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.25
"""Seconds between two reads of the workers' member list (one observer push-pull each)."""
READ_TIMEOUT_S = 1.0
"""Seconds one member gets to answer a read before the next one is asked."""


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float
    slot: int
    """``LOCAL_RANK``: the lowest slot free when it started."""
    joiner: bool = False
    """Started to join the running mesh (``--join-at``, ``--respawn``)."""
    killed: bool = False
    stopped_at: float | None = None
    """When the launcher stopped it (SIGTERM): it arrived after training ended (it held no
    state), or the launcher was asked to stop."""
    stop_grace: float = STOP_GRACE_S
    """Seconds from ``stopped_at`` to SIGKILL."""
    replaced: bool = False
    """It died and ``--respawn`` started another worker in its slot."""
    step: int = 0
    """Its committed steps: the larger of what the mesh and its ``FTMESH`` records say."""
    progressed: bool = False
    loss: float | None = None
    members: int = 0
    """The world size of its last committed step."""
    done: bool = False
    spare: bool = False
    """Its last step computed no samples (a hot spare): not a kill victim."""
    mesh: MemberRow | None = None
    """Its member as the last read of the mesh showed it (``None``: not seen yet)."""
    joined: bool = False
    """A joiner whose first committed step the view has shown."""
    reported: bool = False
    final: Path | None = None
    """Where its ``ftmesh worker`` writes the last progress its mesh published, as it exits
    (``--final-report``): the summary's numbers for a worker that ended on its own."""
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    output: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    @property
    def died(self) -> bool:
        """It ended without finishing: killed, crashed, or exited non-zero."""
        return not self.running and not self.stopped and self.proc.returncode != 0

    def exit_text(self) -> str:
        """How it ended (``running`` if it has not)."""
        rc = self.proc.returncode
        if rc is None:
            return "running"
        how = f"exit code {rc}"
        if rc < 0:
            try:
                how = f"signal {signal.Signals(-rc).name}"
            except ValueError:
                how = f"signal {-rc}"
        if self.killed:
            return f"killed by the launcher ({how})"
        if self.stopped:
            return f"stopped by the launcher ({how})"
        return how

    def observe(self, row: MemberRow) -> None:
        """Take what the mesh says of it: its published progress and role."""
        self.mesh = row
        p = None if row.info is None else row.info.progress
        if p is not None and p.step >= self.step:
            self.step = p.step
            self.progressed = self.progressed or p.step > 0
            self.members = p.world
            self.spare = p.share == 0
        if row.info is not None and row.info.role == "done":
            self.done = True

    def read_final(self) -> None:
        """Take the worker's own last published progress (``--final-report``), written as it
        exited: the publications the view reads a few times a second may have missed the
        last ones."""
        if self.final is None:
            return
        try:
            rec = json.loads(self.final.read_text())
        except (OSError, ValueError):
            return  # killed, or it never published progress
        if not isinstance(rec, dict):
            return
        step, world = rec.get("step"), rec.get("world")
        if type(step) is int and step >= self.step:
            self.step = step
            self.progressed = self.progressed or step > 0
            if type(world) is int and world > 0:
                self.members = world


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
    p.add_argument(
        "--respawn",
        action="store_true",
        help="replace a worker that dies (a new member in its slot) while training runs",
    )
    add_settings_args(
        p, (*TRAINER_FLAGS, "start_peers", "start_timeout"), discovery="local", preset="local",
        start_peers="-n",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed for choosing whom to kill")
    p.add_argument("--log-dir", default=None, help="worker logs (default: runs/launch-TIME)")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="stop every worker after this many seconds (default: no limit)",
    )
    p.add_argument("--no-live", action="store_true", help="plain progress lines, no live view")
    add_target_args(p)
    add_worker_parser(sub)


def _free_port(host: str) -> int:
    """A TCP and UDP port free on ``host`` now (the first seed of a seeds launch)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Launcher:
    def __init__(self, args: argparse.Namespace, out: TextIO) -> None:
        if args.nprocs < 1:
            raise ConfigError(f"-n must be at least 1, got {args.nprocs}")
        if args.timeout is not None and not args.timeout > 0:
            raise ConfigError(f"--timeout must be positive, got {args.timeout}")
        self.target = Target.of(args)
        self.args = args
        self.out = out
        self.rng = random.Random(args.seed)
        self.kills = sorted(args.kill_at)
        self.joins = sorted(args.join_at)
        self.workers: list[Worker] = []
        self._kill_deferred = False
        self._fruitless: dict[int, int] = {}  # slot -> replacements in a row without a step
        self.events: deque[str] = deque(maxlen=8)
        self.view: BackgroundReader | None = None
        """Reads the workers' mesh (started by ``run``)."""
        self._view_lost = False
        self.signalled: signal.Signals | None = None
        """The signal that asked the launcher to stop (SIGTERM, SIGINT), if one did."""
        self._hurry = False
        self.t0 = time.monotonic()
        self.deadline = float("inf") if args.timeout is None else self.t0 + args.timeout
        """When the launcher stops every worker (``--timeout``; by default never)."""
        self.gpus = visible_gpus(os.environ)
        self.settings = self._settings(settings_from_args(args, os.environ, preset="local"))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_dir = Path(args.log_dir or f"runs/launch-{stamp}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        threads = max(1, (os.cpu_count() or 1) // args.nprocs)
        self.env = {k: v for k, v in os.environ.items() if k not in ENV.values()}
        self.env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))

    def _settings(self, given: Settings) -> Settings:
        """Every worker's settings but port, name and start: a private registry for local
        discovery, consecutive ports and the first N workers as seeds for seeds discovery."""
        given.node_config()  # every setting checked before anything is created
        kind = given.discovery_kind("local")
        mesh = given.mesh
        if kind == "local" and mesh is None:
            mesh = f"launch-{os.getpid()}-{self.rng.getrandbits(32):08x}"
        settings = given.replace(
            discovery=kind,
            mesh=mesh or DEFAULT_MESH,
            start_peers=self.args.nprocs if given.start_peers is None else None,
        )
        self.base_port = given.port
        if kind == "seeds":
            node = settings.node_config()  # the address the seeds are reached on
            host = node.advertised_host
            if self.base_port is None:
                self.base_port = _free_port(node.bind)
            first = [f"{host}:{self.base_port + i}" for i in range(self.args.nprocs)]
            settings = settings.replace(join=(*settings.seeds(), *first))
        self._check_port_ranges(settings)
        return settings

    def _check_port_ranges(self, settings: Settings) -> None:
        """Worker ``k`` takes each fixed port + ``k`` (``_port``): the ranges of the first N
        workers must not overlap, or two of them would bind one port."""
        n = self.args.nprocs
        bases = {"port": self.base_port}
        bases |= {name: getattr(settings, name) for name in PORT_SETTINGS[1:]}
        fixed = sorted((base, name) for name, base in bases.items() if base)
        for (a, name_a), (b, name_b) in itertools.pairwise(fixed):
            if b < a + n:
                raise ConfigError(
                    f"{label(name_a)} {a} and {label(name_b)} {b}: worker k takes each port "
                    f"+ k, so with -n {n} they overlap; leave {n} ports between them (more for "
                    "workers added later: --join-at, --respawn)"
                )

    def event(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {text}"
        self.events.append(line)
        if self.args.no_live or not self.out.isatty():
            print(line, file=self.out, flush=True)

    def _port(self, name: str, index: int) -> int | None:
        """Worker ``index``'s port setting ``name`` (``data_port``...): the given port +
        ``index``; 0 (any port) and not given stay so."""
        base: int | None = getattr(self.settings, name)
        return base + index if base else base

    def start_worker(self, *, joiner: bool) -> Worker:
        index = len(self.workers)
        name = f"w{index}"
        slot = free_slot({w.slot for w in self.workers if w.running})
        settings = self.settings.replace(
            name=name,
            port=None if self.base_port is None else self.base_port + index,
            **{key: self._port(key, index) for key in PORT_SETTINGS[1:]},
            join_running=joiner or None,
            start_peers=1 if joiner else None,
        )
        env = {
            **self.env,
            **settings.to_env(),
            **worker_env(slot, self.gpus),
            "FTMESH_WORKER_NAME": name,
        }
        verbose = ["-v"] * self.args.verbose
        final = self.log_dir / f"{name}.final.json"
        final.unlink(missing_ok=True)
        worker = ["worker", "--final-report", str(final), *self.target.argv()]
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftmesh", *verbose, *worker],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        w = Worker(name, proc, self.log_dir / f"{name}.log", time.monotonic(), slot, joiner)
        w.final = final
        w.reader = threading.Thread(target=self._read, args=(w,), daemon=True)
        w.reader.start()
        self.workers.append(w)
        devices = env.get("CUDA_VISIBLE_DEVICES")
        gpu = "" if devices is None or not self.gpus else f", CUDA_VISIBLE_DEVICES {devices}"
        self.event(f"started {name} (pid {proc.pid}, LOCAL_RANK {slot}{gpu})")
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
        if isinstance(rec.get("step"), int) and rec["step"] >= w.step:
            w.step = rec["step"]
            w.progressed = True
        if isinstance(rec.get("loss"), int | float):
            w.loss = float(rec["loss"])
        if isinstance(rec.get("members"), int):
            w.members = rec["members"]
        if isinstance(rec.get("share"), int):
            w.spare = rec["share"] == 0
        if rec.get("done"):
            w.done = True

    def committed(self) -> int:
        """The mesh's committed steps: the newest step its members published."""
        return max((w.step for w in self.workers), default=0)

    def _current(self) -> list[Worker]:
        """The workers whose numbers the live view shows: the running ones that published
        a step (a dead worker's last numbers are history, not the mesh's state)."""
        return [w for w in self.workers if w.running and w.progressed]

    def finished(self) -> bool:
        """A worker has finished the training: nobody is added any more."""
        return any(w.done for w in self.workers)

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
                self.event(f"step {step}: kill -9 {victim.name} (at its step {victim.step})")
        while self.joins and step >= self.joins[0]:
            self.joins.pop(0)
            if self.finished():
                self.event(f"step {step}: no worker joins: the training has finished")
                continue
            w = self.start_worker(joiner=True)
            self.event(f"step {step}: {w.name} started to join (it joins at its first step)")

    def respawn(self) -> None:
        """``--respawn``: a worker that died is replaced by a new member in its slot."""
        for w in self.workers:
            if not w.died or w.replaced or self.finished():
                continue
            w.replaced = True
            fruitless = 0 if w.progressed else self._fruitless.get(w.slot, 0) + 1
            self._fruitless[w.slot] = fruitless
            if fruitless >= MAX_FRUITLESS_RESPAWNS:
                self.event(f"not replacing {w.name}: slot {w.slot} died {fruitless}x unstarted")
                w.replaced = False
                continue
            new = self.start_worker(joiner=True)
            self.event(f"{w.name} died (exit {w.proc.returncode}): replaced by {new.name}")

    def stop_latecomers(self) -> None:
        """Once every worker that trained has ended, joiners still waiting to join (they
        hold no state) are stopped instead of waiting for a mesh that is gone."""
        if not self.finished():
            return
        if any(w.running and w.progressed for w in self.workers):
            return
        for w in self.workers:
            if w.running and not w.stopped:
                w.stopped_at = time.monotonic()
                os.killpg(w.proc.pid, signal.SIGTERM)
                self.event(f"{w.name} arrived after the training ended: stopped")

    def observe(self) -> None:
        """Take the latest read of the mesh: every worker's published progress, and the
        joiners that took their first step (that is when they join)."""
        rows = self.view.latest if self.view is not None else None
        if self.view is not None and self.view.error is not None and not self._view_lost:
            self._view_lost = True
            self.event(f"the view stopped reading the mesh: {self.view.error!r}")
        by_name: dict[str, MemberRow] = {}
        for row in rows or ():
            old = by_name.get(row.name)  # (a name twice: another launch on the same mesh)
            if old is None or row.snapshot.state == MemberState.ALIVE:
                by_name[row.name] = row
        for w in self.workers:
            if w.name in by_name:
                w.observe(by_name[w.name])
            if w.joiner and w.progressed and not w.joined:
                world = w.members or self._mesh_world(rows or [])
                if world:  # (a step from an FTMESH record without "members": from the mesh)
                    w.joined = True
                    self.event(f"step {w.step}: {w.name} joins (world {world})")

    @staticmethod
    def _mesh_world(rows: list[MemberRow]) -> int:
        """The training members alive in the latest read of the mesh."""
        alive = (r for r in rows if r.snapshot.state == MemberState.ALIVE)
        return sum(1 for r in alive if r.info is not None and r.info.role == "train")

    def reap(self) -> None:
        """Report every worker that ended since the last call, however it ended."""
        for w in self.workers:
            since = w.stopped_at
            if since is not None and w.running and time.monotonic() - since > w.stop_grace:
                os.killpg(w.proc.pid, signal.SIGKILL)  # SIGTERM was not enough
            rc = w.proc.poll()
            if rc is None or w.reported:
                continue
            w.reported = True
            if rc == 0 and w.progressed and not w.stopped:
                w.done = True  # it trained and ended well: it finished
            self.event(f"{w.name} ended: {w.exit_text()} at step {w.step}")

    def state_of(self, w: Worker) -> str:
        """What the view says a worker is doing."""
        rc = w.proc.returncode
        if rc is not None:  # (short: the summary says it in full)
            if w.killed or w.stopped:
                return "killed" if w.killed else "stopped"
            return "done" if rc == 0 and w.done else w.exit_text()
        if w.stopped:
            return "stopping"
        role = "" if w.mesh is None or w.mesh.info is None else w.mesh.info.role
        if w.joiner and not w.joined:
            return "joining"
        if w.spare or role == "spare":
            return "spare"
        return role or "starting"

    def world(self) -> int:
        """The world size of the newest committed step a running worker published."""
        live = self._current()
        return max(live, key=lambda w: w.step).members if live else 0

    def render(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        title = Text(shown(f"ftmesh launch: {' '.join(self.target.argv())}"))
        table = Table(title=title, expand=False)
        columns = ("worker", "pid", "state", "step", "world", "share", "step time")
        for col in (*columns, "samples/s", "backend", "loss", "last fault"):
            table.add_column(col)
        for w in self.workers:
            p = None if w.mesh is None or w.mesh.info is None else w.mesh.info.progress
            cells = (
                w.name,
                str(w.proc.pid),
                self.state_of(w),
                str(w.step),
                str(w.members),
                "-" if p is None else str(p.share),
                "-" if p is None else f"{p.step_s * 1000:.0f}ms",
                "-" if p is None else f"{p.sps:.1f}",
                "-" if p is None else p.backend,
                "" if w.loss is None else f"{w.loss:.4f}",
                "-" if p is None or not p.fault else p.fault,
            )
            table.add_row(*(Text(shown(c)) for c in cells))  # (member text: never markup)
        elapsed = time.monotonic() - self.t0
        rate = self.committed() / elapsed if elapsed > 0 else 0.0
        head = Text(
            f"mesh {self.settings.mesh}  committed steps {self.committed()}  ({rate:.1f} steps/s)"
            f"  world {self.world()}"
        )
        return Group(head, table, Text("\n".join(self.events)))

    def line(self) -> str:
        """The plain view: the newest step and its world, each running worker's
        ``step/world`` as it published them, live workers, the latest loss."""
        running = [w for w in self.workers if w.running]
        if not any(w.progressed for w in self.workers):
            return f"  waiting for the first committed step  live workers {len(running)}"
        live = self._current()
        if not live:
            return f"  step {self.committed()}  no worker training  live workers {len(running)}"
        each = "  ".join(f"{w.name} {w.step}/{w.members}" for w in live)
        # The loss of the newest step a running worker reported (never a dead worker's).
        losses = [w for w in live if w.loss is not None]
        loss = max(losses, key=lambda w: w.step).loss if losses else None
        return (
            f"  step {self.committed()}  world {self.world()}  [{each}]  live workers "
            f"{len(running)}  loss {'-' if loss is None else f'{loss:.4f}'}"
        )

    def run(self) -> int:
        mesh = self.settings.mesh or DEFAULT_MESH
        self.view = BackgroundReader(MeshReader(self.settings, mesh, READ_TIMEOUT_S), POLL_S)
        previous = self._catch_signals()
        try:
            if self.settings.discovery == "local":
                self.event(f"mesh {mesh} (see it with: ftmesh status --mesh {mesh})")
            for _ in range(self.args.nprocs):
                self.start_worker(joiner=False)
            self.view.start()
            if not self.args.no_live and self.out.isatty() and live_view_available():
                from rich.live import Live

                with Live(self.render(), refresh_per_second=4) as live:
                    rc = self._loop(lambda: live.update(self.render()))
            else:
                rc = self._loop(None)
            return self._report(rc)
        finally:
            self.view.close()
            for w in self.workers:
                if w.running:
                    os.killpg(w.proc.pid, signal.SIGKILL)
                    w.proc.wait()
            self._clean_registry()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _catch_signals(self) -> dict[signal.Signals, Any]:
        """SIGTERM (``timeout``, systemd, Docker, Kubernetes) and SIGINT (Ctrl-C) ask the
        launcher to stop: ``_loop`` gives every worker a planned departure (``_leave``); a
        second signal (``REPEAT_AFTER_S`` or more after the first: ``timeout`` and group
        signals deliver one stop twice) kills them at once. Returns the handlers to put
        back."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

        first: list[float] = []  # when the first stop signal came

        def on_signal(signum: int, _frame: object) -> None:
            if self.signalled is None:
                self.signalled = signal.Signals(signum)
                first.append(time.monotonic())
            elif time.monotonic() - first[0] >= REPEAT_AFTER_S:
                self._hurry = True

        for sig in STOP_SIGNALS:
            signal.signal(sig, on_signal)
        return previous

    def _clean_registry(self) -> None:
        """Remove what the workers left in the registry (a killed worker cannot remove its
        entry), and the mesh's directory if nothing else is in it."""
        if self.settings.discovery != "local":
            return
        base = Path(self.settings.registry_dir or default_registry_dir())
        remove_entries(base, self.settings.mesh or DEFAULT_MESH, {w.proc.pid for w in self.workers})

    def _leave(self, sig: signal.Signals) -> None:
        """Ask every running worker to leave (SIGTERM: a planned departure at its next step
        boundary); ``reap`` kills the ones still running ``LEAVE_GRACE_S`` later."""
        self.event(
            f"{sig.name}: every worker leaves the mesh (SIGTERM); those still running in"
            f" {LEAVE_GRACE_S:.0f}s are killed ({sig.name} again: kill them now)"
        )
        now = time.monotonic()
        for w in self.workers:
            if w.running and not w.stopped:
                w.stopped_at, w.stop_grace = now, LEAVE_GRACE_S
                os.killpg(w.proc.pid, signal.SIGTERM)

    def _loop(self, refresh: Any) -> int:
        shown, last_line = "", 0.0
        leaving = False
        while any(w.running for w in self.workers):
            if time.monotonic() > self.deadline:
                self.event(f"timeout after {self.args.timeout:.0f}s: stopping every worker")
                for w in self.workers:
                    if w.running:
                        w.stopped_at = time.monotonic()
                        os.killpg(w.proc.pid, signal.SIGKILL)
                        w.proc.wait()
                self.reap()
                return 124
            if self.signalled is not None and not leaving:
                leaving = True
                self._leave(self.signalled)
            if self._hurry:
                for w in self.workers:
                    if w.running:
                        w.stop_grace = 0.0
            self.observe()
            if not leaving:
                self.chaos()
                if self.args.respawn:
                    self.respawn()
                self.stop_latecomers()
            self.reap()
            if refresh is not None:
                refresh()
            elif (line := self.line()) != shown and time.monotonic() - last_line >= 1.0:
                shown, last_line = line, time.monotonic()  # (at most a line a second, and
                print(line, file=self.out, flush=True)  # only when something changed)
            time.sleep(0.05)
        self.observe()
        self.reap()  # the exits of the last tick
        return 0 if self.signalled is None else 128 + self.signalled.value

    def _report(self, rc: int) -> int:
        for w in self.workers:
            if w.reader is not None:
                w.reader.join(5.0)
            w.read_final()
        ended = [w for w in self.workers if not w.killed and not w.stopped]
        failed = [w for w in ended if w.proc.returncode != 0]
        ok = [w for w in ended if w.proc.returncode == 0]
        print(f"logs: {self.log_dir}", file=self.out)
        print("workers:", file=self.out)
        for w in self.workers:
            more = ", replaced" if w.replaced else ""
            ended_as = f"{w.exit_text()} at step {w.step}{more}"
            print(f"  {w.name} (pid {w.proc.pid}): {ended_as}", file=self.out)
        print(f"committed steps: {self.committed()}", file=self.out)
        for what, pending in (("--kill-at", self.kills), ("--join-at", self.joins)):
            if pending:
                print(
                    f"warning: {what} {', '.join(map(str, pending))} never fired: "
                    + self._why_not_fired(),
                    file=self.out,
                )
        if self.signalled is not None:
            left = [w for w in self.workers if w.stopped and w.proc.returncode == 0]
            forced = [w for w in self.workers if w.stopped and w.proc.returncode != 0]
            print(
                f"stopped by {self.signalled.name}: {len(left)} worker(s) left the mesh"
                + (
                    f", {len(forced)} did not within {LEAVE_GRACE_S:.0f}s and were killed"
                    f" or failed ({', '.join(w.name for w in forced)})"
                    if forced
                    else ""
                ),
                file=self.out,
            )
        for w in failed:
            what = "died and was replaced" if w.replaced else "failed"
            print(
                f"\nworker {w.name} (pid {w.proc.pid}) {what} with exit code "
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
        return 1 if any(not w.replaced for w in failed) or not ok else 0

    def _why_not_fired(self) -> str:
        """What happened instead of a ``--kill-at``/``--join-at`` step: the run ended before
        it, the workers crashed first, the launcher was stopped, or nothing reported steps."""
        step = self.committed()
        if self.signalled is not None:
            return f"the launcher was stopped ({self.signalled.name}) at step {step}"
        crashed = [w for w in self.workers if w.died and not w.killed]
        if crashed and not any(w.done for w in self.workers):
            names = ", ".join(f"{w.name} ({w.exit_text()})" for w in crashed)
            return f"the workers ended without finishing at step {step}: {names} failed"
        if not any(w.progressed for w in self.workers):
            return (
                "no worker reported a committed step (the script neither reports progress to"
                " the mesh, see Mesh.report_progress, nor prints FTMESH records)"
            )
        if self._kill_deferred:
            return f"the kill was deferred (too few workers trained) until the end, at step {step}"
        return f"the training ended at step {step}"


def run_launch(args: argparse.Namespace) -> int:
    return Launcher(args, sys.stdout).run()
