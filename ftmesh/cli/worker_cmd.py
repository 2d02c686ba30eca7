"""``ftmesh worker``: run a training script (or ``-m module``) as one member of a mesh.

Theory of operation: the flags, over ``FTMESH_*``, over the worker's defaults (mDNS discovery,
the ``lan`` preset) make the member's settings (``ftmesh.settings``). They are checked at the
door by building the node config: a bad flag, a secret file that is not there, an interface
this host does not have is one line and exit status 2 before the script imports anything.
Then the settings go into the environment and the script runs *in this process*, as
``python script.py ARGS`` (or ``python -m module ARGS``) would run it (``sys.argv``,
``sys.path[0]``, ``__main__``): its ``ftmesh.connect()`` reads them, and the worker is itself
the process a container runs as PID 1. An ``FtmeshError`` that ends the script reaches the
user as one line with exit status 2 (``ftmesh -v worker`` adds the traceback);
``TrainingFinishedError`` (a spare or a joiner that found the training over) exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import runpy
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, TrainingFinishedError
from ..settings import Settings
from .args import TRAINER_FLAGS, add_settings_args, settings_from_args

WORKER_FLAGS = (*TRAINER_FLAGS, "name", "meta", "start_peers", "start_timeout")


def add_target_args(p: argparse.ArgumentParser) -> None:
    """``SCRIPT [ARGS]`` or ``-m MODULE [ARGS]``: everything after them is the script's."""
    p.add_argument(
        "-m",
        dest="module",
        nargs=argparse.REMAINDER,
        metavar=("MODULE", "ARGS"),
        help="-m MODULE [ARGS]: run a module as the script, like python -m",
    )
    p.add_argument("target", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]")


def add_worker_parser(sub: Any) -> None:
    w = sub.add_parser("worker", help="run a training script as one member of a mesh")
    add_settings_args(w, WORKER_FLAGS, discovery="mdns", preset="lan", start_peers=1)
    # (``ftmesh launch``'s channel: where to write the last progress the mesh published)
    w.add_argument("--final-report", default=None, help=argparse.SUPPRESS)
    add_target_args(w)


@dataclass(frozen=True)
class Target:
    """What a worker runs: a script or a module, and its arguments."""

    script: str | None
    module: str | None
    args: tuple[str, ...]

    @classmethod
    def of(cls, args: argparse.Namespace) -> Target:
        """The target the command line names; ``ConfigError`` if it names none or one that
        is not there."""
        if args.module is not None:
            if not args.module:
                raise ConfigError("-m needs a module name, e.g. -m mypackage.train")
            module, *rest = args.module
            _check_module(module)
            return cls(None, module, tuple(rest))
        if not args.target:
            raise ConfigError("no training script given: SCRIPT [ARGS] or -m MODULE [ARGS]")
        script, *rest = args.target
        if not Path(script).is_file():
            raise ConfigError(f"no such script: {script}")
        return cls(script, None, tuple(rest))

    def argv(self) -> list[str]:
        """The worker command line's tail that names this target."""
        head = ["-m", self.module] if self.module is not None else [str(self.script)]
        return [*head, *self.args]

    def run(self) -> None:
        """Run it in this process as ``python`` would."""
        if self.module is not None:
            sys.argv = [self.module, *self.args]
            sys.path[0] = os.getcwd()
            runpy.run_module(self.module, run_name="__main__", alter_sys=True)
        else:
            assert self.script is not None
            sys.argv = [self.script, *self.args]
            sys.path[0] = str(Path(self.script).resolve().parent)
            runpy.run_path(self.script, run_name="__main__")


def _check_module(name: str) -> None:
    """Raise ``ConfigError`` unless ``python -m name`` would find the module (looked up with
    the working directory first on the path, as ``python -m`` has it)."""
    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:
        found = False
    except Exception as exc:  # the package's __init__ failed: the user's code, said briefly
        raise ConfigError(f"cannot import the package of -m {name}: {exc!r}") from exc
    finally:
        sys.path.pop(0)
    if not found:
        raise ConfigError(f"no module named {name!r} (-m); is it on the path?")


def worker_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """The worker's settings, its discovery resolved (mDNS unless seeds are given)."""
    settings = settings_from_args(args, environ, preset="lan")
    return settings.replace(discovery=settings.discovery_kind("mdns"))


THREADS_ENV = "OMP_NUM_THREADS"


def _workers_on_host(proc: Path = Path("/proc")) -> int:
    """``ftmesh worker`` processes running on this host (this one included), from the
    process table (at most ``MAX_PROCS_SCANNED`` entries looked at)."""
    n = 0
    for i, entry in enumerate(proc.iterdir()):
        if i >= MAX_PROCS_SCANNED:
            break
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ftmesh" in argv and b"worker" in argv[argv.index(b"ftmesh") :]:
            n += 1
    return max(n, 1)


MAX_PROCS_SCANNED = 65536
"""Process table entries ``_workers_on_host`` reads (bounds its work on a busy host)."""


def default_threads(environ: Mapping[str, str], cpus: int | None = None) -> int | None:
    """Threads each worker's torch and OpenMP get when ``OMP_NUM_THREADS`` is not set: the
    host's cores shared by the workers on it (``LOCAL_WORLD_SIZE`` if set, as torchrun sets
    it, else the ``ftmesh worker`` processes running now), like ``ftmesh launch`` does.
    Without it every worker starts a thread per core and N workers on one host
    oversubscribe it N times (17 s/step instead of 1). None: set, leave it."""
    if environ.get(THREADS_ENV):
        return None
    cpus = cpus or os.cpu_count() or 1
    local = environ.get("LOCAL_WORLD_SIZE", "")
    workers = int(local) if local.isdigit() and int(local) > 0 else _workers_on_host()
    return max(1, cpus // workers)


def _write_final(path: str) -> None:
    """``--final-report``: the last progress this process's mesh published, as JSON."""
    from ..mesh.core import last_progress

    p = last_progress()
    if p is None:
        return
    record = {"step": p.step, "world": p.world, "share": p.share}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(record))
    os.replace(tmp, path)


def run_worker(args: argparse.Namespace) -> int:
    settings = worker_settings(args, os.environ)
    settings.node_config()  # every setting checked before the script starts
    target = Target.of(args)
    os.environ.update(settings.to_env())
    threads = default_threads(os.environ)
    if threads is not None:  # (before the script imports torch)
        os.environ[THREADS_ENV] = str(threads)
    try:
        target.run()
    except TrainingFinishedError as exc:
        print(f"ftmesh: {exc}", file=sys.stderr)
    finally:
        if args.final_report:
            with contextlib.suppress(OSError):
                _write_final(args.final_report)
    return 0
