"""``ftmesh lab``: a virtual LAN of network namespaces with fault injection, and a chaos soak.

``up`` builds a persistent lab (kept in a state file, see :mod:`ftmesh.lab.state`), on one
bridge or, with ``--sites AxB``, on two sites joined by a WAN link with a rate, a one-way delay
and loss (``--wan-rate``, ``--wan-delay``, ``--wan-loss``; :mod:`ftmesh.lab.wan`), that later
invocations drive: ``run`` a command inside a host, ``kill``/``freeze``/``thaw`` a host's
processes, take its ``link`` down, add ``loss``, limit its ``rate``, throttle its ``cpu``
(cgroup quota), make it ``failslow`` (SIGSTOP/SIGCONT pulses), ``partition`` the LAN and
``heal`` it, change the ``wan`` link, ``status`` (with what crossed the WAN); ``down`` deletes
it and any leftovers of crashed labs and test runs (the WAN forwarder included).
``chaos`` builds its own throw-away lab, runs a mesh in it under random faults and prints a
summary (exit status 1 on any violated invariant): ``--workload membership`` (the default:
``ftmesh node`` members, no torch needed) or ``--workload train`` (every host trains a small
model with ``ElasticTrainer``; digests, step sequences, the line of agreed states and the
recovery of training are checked too, see :mod:`ftmesh.lab.training`). Everything needs root.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..lab import state as lab_state
from ..lab.chaos import KINDS, WORKLOAD_KINDS, ChaosRunner, parse_kinds
from ..lab.errors import LabError
from ..lab.netns import VirtualLan, cleanup_named, cleanup_stale, is_root
from ..lab.wan import WanLink, parse_delay_ms, rate_bits

DEFAULT_NAME = "ftmlab"
"""Name (namespace prefix) of the lab ``ftmesh lab`` commands act on without ``--name``."""

STALE_BASES = ("ftm", "ftmchaos")
"""Name bases of pid-bound labs (tests, chaos runs) whose leftovers ``down`` removes once their
creator is dead."""

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "CONT": signal.SIGCONT,
           "TERM": signal.SIGTERM, "INT": signal.SIGINT}  # fmt: skip


def _host(text: str) -> int:
    t = text[1:] if text.startswith("h") else text
    if not t.isdigit():
        raise argparse.ArgumentTypeError(f"host {text!r}: give an index like 0 or h0")
    return int(t)


def _group(text: str) -> list[int]:
    try:
        return [_host(t) for t in text.split(",") if t]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"group {text!r}: {e}") from e


def _sites(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"sites {text!r}: give two host counts like 2x2")
    return int(parts[0]), int(parts[1])


def _rate(text: str) -> str | None:
    if text == "none":
        return None
    try:
        rate_bits(text)
    except LabError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


def _delay(text: str) -> float:
    try:
        return parse_delay_ms(text)
    except LabError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_lab_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``lab`` and its subcommands to the ``ftmesh`` parser."""
    lab = sub.add_parser(
        "lab", help="virtual LAN of network namespaces with fault injection (root)"
    )
    lab.add_argument(
        "--name",
        default=DEFAULT_NAME,
        help="lab name: prefix of its namespaces (default: %(default)s)",
    )
    cmds = lab.add_subparsers(dest="lab_command", required=True)

    up = cmds.add_parser(
        "up", help="build a lab of N hosts on one bridge, or on two sites joined by a WAN link"
    )
    up.add_argument("--hosts", type=int, default=None, help="hosts on one bridge (default 4)")
    up.add_argument(
        "--sites",
        type=_sites,
        default=None,
        metavar="AxB",
        help="two sites of A and B hosts, each on its own bridge and half of the subnet, "
        "joined by one WAN link (e.g. 2x2; default: one bridge)",
    )
    up.add_argument(
        "--wan-rate",
        type=_rate,
        default=None,
        metavar="RATE",
        help="the WAN link's rate each way, like 20mbit (default: none, unlimited)",
    )
    up.add_argument(
        "--wan-delay",
        type=_delay,
        default=0.0,
        metavar="DELAY",
        help="the WAN link's one-way delay, like 50ms (default: 0)",
    )
    up.add_argument(
        "--wan-loss", type=float, default=0.0, metavar="PERCENT", help="WAN loss each way"
    )
    up.add_argument("--subnet", default="10.78.0.0/24", help="IPv4 subnet (default: %(default)s)")
    up.add_argument("--json", action="store_true")

    run = cmds.add_parser(
        "run", help="run a command inside a host: lab run 0 -- CMD ... ({ip}: the host's IP)"
    )
    run.add_argument("host", type=_host)
    run.add_argument("-d", "--detach", action="store_true", help="run in the background")
    run.add_argument("--timeout", type=float, default=0.0, help="seconds, 0 = no limit")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...")

    status = cmds.add_parser("status", help="hosts, addresses, faults and processes")
    status.add_argument("--json", action="store_true")

    cmds.add_parser(
        "down", help="delete the lab, its logs, and leftovers of crashed labs and test runs"
    )

    kill = cmds.add_parser("kill", help="signal every process of a host (default: kill -9)")
    kill.add_argument("host", type=_host)
    kill.add_argument("--signal", choices=sorted(SIGNALS), default="KILL")
    freeze = cmds.add_parser("freeze", help="SIGSTOP every process of a host")
    freeze.add_argument("host", type=_host)
    thaw = cmds.add_parser("thaw", help="SIGCONT every process of a host")
    thaw.add_argument("host", type=_host)

    link = cmds.add_parser("link", help="plug or unplug a host's cable")
    link.add_argument("host", type=_host)
    link.add_argument("state", choices=["up", "down"])

    loss = cmds.add_parser("loss", help="random loss on a host's link, or LAN-wide with 'all'")
    loss.add_argument("host", help="host index, or 'all' for end-to-end loss on every path")
    loss.add_argument("percent", type=float, help="0 clears")

    rate = cmds.add_parser("rate", help="limit a host's link (tc tbf)")
    rate.add_argument("host", type=_host)
    rate.add_argument("rate", help="tc rate like 1mbit, or 'none'")

    cpu = cmds.add_parser("cpu", help="throttle a host to a CPU share (cgroup cpu quota)")
    cpu.add_argument("host", type=_host)
    cpu.add_argument("share", help="CPUs, like 0.25 (a quarter of one core), or 'none'")

    slow = cmds.add_parser(
        "failslow", help="freeze a host (SIGSTOP) for STOP seconds every EVERY seconds"
    )
    slow.add_argument("host", type=_host)
    slow.add_argument("stop", help="seconds each pulse freezes the host, or 'off'")
    slow.add_argument("every", type=float, nargs="?", default=1.0, help="seconds (default 1)")

    wan = cmds.add_parser("wan", help="change the WAN link of a two-site lab (what is given)")
    wan.add_argument("--rate", type=_rate, default=argparse.SUPPRESS, help="like 5mbit, or none")
    wan.add_argument("--delay", type=_delay, default=argparse.SUPPRESS, help="one way, like 30ms")
    wan.add_argument("--loss", type=float, default=argparse.SUPPRESS, help="percent each way")

    part = cmds.add_parser("partition", help="split the LAN: lab partition 0,1 2,3")
    part.add_argument("groups", nargs="+", type=_group, metavar="HOSTS")
    cmds.add_parser("heal", help="remove the partition")

    chaos = cmds.add_parser("chaos", help="random faults on a mesh in a fresh lab; a summary")
    chaos.add_argument("--hosts", type=int, default=5)
    chaos.add_argument("--duration", type=float, default=180.0, help="seconds of faults")
    chaos.add_argument("--seed", type=int, default=1)
    chaos.add_argument("--preset", choices=["local", "lan", "wan"], default="local")
    chaos.add_argument(
        "--kinds",
        default="",
        help=f"fault kinds, comma-separated, from {','.join(KINDS)} (default: all; "
        f"{', '.join(WORKLOAD_KINDS)} only with --workload train)",
    )
    chaos.add_argument(
        "--workload",
        choices=["membership", "train"],
        default="membership",
        help="what every host runs: 'membership' (default) runs 'ftmesh node' and checks "
        "views; 'train' runs fault-tolerant training (needs torch) and also checks that "
        "members of a view commit identical state at every step, steps never repeat or skip, "
        "the mesh never loses a state it agreed on, and training resumes in one ring after "
        "every fault",
    )
    chaos.add_argument(
        "--step-delay",
        type=float,
        default=0.05,
        help="train: seconds each member sleeps after a step (default: %(default)s)",
    )
    chaos.add_argument(
        "--resume-bound",
        type=float,
        default=None,
        help="train: seconds from a single view until every member trains again in one "
        "ring (default: ftmesh.lab.training.RECOVERY_BOUND)",
    )
    chaos.add_argument("--log-dir", default=None, help="keep member logs here")
    chaos.add_argument("--json", action="store_true", help="print the summary as JSON")
    chaos.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    chaos.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw a timeline: faults, committed steps and throughput per host, view "
        "changes (matplotlib)",
    )


def _attach(name: str) -> tuple[VirtualLan, dict[str, Any]]:
    saved = lab_state.load(name)
    if saved is None:
        raise LabError(f"no lab named {name!r} is up (run 'ftmesh lab up --hosts N')")
    return VirtualLan.attach(saved["lan"]), saved


def _save(name: str, lan: VirtualLan, saved: dict[str, Any]) -> None:
    saved["lan"] = lan.to_state()
    lab_state.save(name, saved)


def _up(args: argparse.Namespace) -> int:
    if lab_state.load(args.name) is not None:
        raise LabError(f"lab {args.name!r} is already up; 'ftmesh lab down' first")
    wan_given = args.wan_rate is not None or args.wan_delay or args.wan_loss
    if args.sites is None and wan_given:
        raise LabError("--wan-rate, --wan-delay and --wan-loss need --sites AxB")
    if args.sites is None:
        lan = VirtualLan(
            hosts=4 if args.hosts is None else args.hosts, subnet=args.subnet, name=args.name
        )
    else:
        wan = WanLink(rate=args.wan_rate, delay_ms=args.wan_delay, loss_percent=args.wan_loss)
        lan = VirtualLan(
            hosts=args.hosts, subnet=args.subnet, name=args.name, sites=args.sites, wan=wan
        )
    try:
        saved = {"name": args.name, "created": time.time(), "detached": [], "lan": {}}
        _save(args.name, lan, saved)
    except BaseException:
        lan.down()
        raise
    lan.detach()
    hosts = [
        {"host": i, "namespace": lan.ns_name(i), "ip": lan.host_ip(i), "site": lan.site_of(i)}
        for i in range(lan.hosts)
    ]
    link = None if lan.wan is None else lan.wan.to_json()
    if args.json:
        print(json.dumps({"name": args.name, "hosts": hosts, "wan": link}))
    else:
        for h in hosts:
            site = f"  site {h['site']}" if link is not None else ""
            print(f"h{h['host']}  {h['namespace']}  {h['ip']}{site}")
        if link is not None:
            print(f"WAN between the sites: {_wan_text(link)}")
        print(f"lab {args.name!r} is up: 'ftmesh lab run 0 -- CMD', 'ftmesh lab down'")
    return 0


def _wan_text(wan: dict[str, Any]) -> str:
    return (
        f"rate {wan['rate'] or 'unlimited'}, delay {wan['delay_ms']:g} ms one way, "
        f"loss {wan['loss_percent']:g}%, queue {wan['queue_ms']:g} ms"
    )


def _run(args: argparse.Namespace, lan: VirtualLan, saved: dict[str, Any]) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise LabError("nothing to run: ftmesh lab run HOST -- CMD ...")
    # "{ip}" in the command stands for the host's address (e.g. --interface {ip}).
    ip = lan.host_ip(args.host)
    argv = [a.replace("{ip}", ip) for a in argv]
    if args.detach:
        log = lab_state.state_dir() / f"{args.name}-h{args.host}-{int(time.time() * 1000)}.log"
        with open(log, "wb") as out:
            proc = lan.popen(
                args.host,
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        saved.setdefault("detached", []).append(
            {"host": args.host, "pid": proc.pid, "argv": argv, "log": str(log)}
        )
        print(f"started pid {proc.pid} on h{args.host}; output in {log}")
        return 0
    full = ["ip", "netns", "exec", lan.ns_name(args.host), *argv]
    try:
        return subprocess.run(full, timeout=args.timeout or None, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"ftmesh lab: command took over {args.timeout}s; killed", file=sys.stderr)
        return 124


def _status(args: argparse.Namespace, lan: VirtualLan, saved: dict[str, Any]) -> int:
    hosts = [
        {
            "host": i,
            "namespace": lan.ns_name(i),
            "ip": lan.host_ip(i),
            "site": lan.site_of(i),
            "pids": lan.host_pids(i),
        }
        for i in range(lan.hosts)
    ]
    faults = lan.faults()
    slowness = {
        h: {"cpu": lan.cpu_stats(h), "fail_slow": lan.fail_slow_stats(h)}
        for h in sorted({*faults["cpu"], *faults["fail_slow"]})
    }
    out = {"name": args.name, "hosts": hosts, "faults": faults, "slowness": slowness}
    if lan.wan is not None:
        out["wan_stats"] = dataclasses.asdict(lan.wan_stats())
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for h in hosts:
        print(f"h{h['host']}  {h['namespace']}  {h['ip']}  pids {h['pids']}")
    for k, v in faults.items():
        if v and k != "wan":  # (below, with its counters)
            print(f"{k}: {v}")
    for h, what in slowness.items():
        print(f"h{h} slowness: {what}")
    if "wan_stats" in out:
        stats = out["wan_stats"]
        print(f"WAN: {_wan_text(stats['link'])}")
        for way in ("a_to_b", "b_to_a"):
            c = stats[way]
            print(
                f"  {way.replace('_', ' ')}: {c['packets']} packets, {c['bytes']} bytes, "
                f"dropped {c['dropped_queue']} (queue) {c['dropped_loss']} (loss)"
            )
    return 0


def _down(args: argparse.Namespace) -> int:
    removed: list[str] = []
    with lab_state.locked(args.name):
        saved = lab_state.load(args.name) if lab_state.state_path(args.name).exists() else None
        if saved is not None:
            try:
                lan = VirtualLan.attach(saved["lan"])
                removed += lan.namespaces()
                lan.down()
            except (LabError, KeyError):
                pass  # half gone already: the sweep below finds the rest
        lab_state.remove(args.name)
        for log in lab_state.state_dir().glob(f"{args.name}-h*.log"):
            log.unlink(missing_ok=True)
    removed += cleanup_named(args.name)
    for base in STALE_BASES:
        removed += cleanup_stale(base)
    print(
        f"removed {len(set(removed))} namespaces"
        + (f": {' '.join(sorted(set(removed)))}" if removed else "")
    )
    return 0


def _fault(args: argparse.Namespace, lan: VirtualLan) -> None:
    cmd = args.lab_command
    if cmd == "kill":
        n = lan.kill_host(args.host, SIGNALS[args.signal])
        print(f"sent SIG{args.signal} to {n} processes on h{args.host}")
    elif cmd in ("freeze", "thaw"):
        n = lan.kill_host(args.host, signal.SIGSTOP if cmd == "freeze" else signal.SIGCONT)
        print(f"{cmd}: {n} processes on h{args.host}")
    elif cmd == "link":
        lan.link(args.host, args.state == "up")
    elif cmd == "loss":
        if args.host == "all":
            lan.set_lan_loss(args.percent)
        else:
            try:
                host = _host(args.host)
            except argparse.ArgumentTypeError as e:
                raise LabError(str(e)) from e
            lan.set_loss(host, args.percent)
    elif cmd == "rate":
        lan.set_rate(args.host, None if args.rate == "none" else args.rate)
    elif cmd == "cpu":
        lan.set_cpu(args.host, None if args.share == "none" else _number(args.share, "share"))
    elif cmd == "failslow":
        stop = None if args.stop == "off" else _number(args.stop, "stop")
        lan.set_fail_slow(args.host, stop, args.every)
    elif cmd == "wan":
        if lan.wan is None:
            raise LabError(f"lab {args.name!r} has one bridge and no WAN (up --sites AxB)")
        changes = {"rate": "rate", "delay": "delay_ms", "loss": "loss_percent"}
        given = {field: getattr(args, flag) for flag, field in changes.items() if flag in args}
        lan.set_wan(dataclasses.replace(lan.wan, **given))
        print(f"WAN: {_wan_text(lan.wan.to_json())}")
    elif cmd == "partition":
        lan.partition(args.groups)
    elif cmd == "heal":
        lan.heal()


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise LabError(f"{what} {text!r} is not a number") from None


def _chaos(args: argparse.Namespace) -> int:
    from ..bench.plots import check_plot_path, plot_chaos

    if args.plot:
        check_plot_path(args.plot)  # before the run, not after it
    progress = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    workload = None
    if args.workload == "train":
        import importlib.util

        from ..lab.training import RECOVERY_BOUND, TrainingWorkload

        if importlib.util.find_spec("torch") is None:
            raise LabError("--workload train needs torch (pip install 'ftmesh[torch]')")

        workload = TrainingWorkload(
            seed=args.seed,
            step_delay=args.step_delay,
            recovery_bound=args.resume_bound or RECOVERY_BOUND,
        )
    runner = ChaosRunner(
        hosts=args.hosts,
        duration=args.duration,
        seed=args.seed,
        preset=args.preset,
        kinds=parse_kinds(args.kinds),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        workload=workload,
        progress=progress,
    )
    summary = runner.run()
    if args.json:
        print(json.dumps(summary.to_json(), indent=1))
    else:
        print(summary.text())
    if args.plot:
        plot_chaos(summary.to_json(), args.plot)
        if progress is not None:
            progress(f"plot: {args.plot}")
    return 0 if summary.ok else 1


def run_lab(args: argparse.Namespace) -> int:
    """Carry out ``ftmesh lab ...``; raises :class:`LabError` (an ``FtmeshError``) on failure."""
    if not is_root():
        raise LabError(
            "ftmesh lab needs root to create network namespaces (try: sudo ftmesh lab ...)"
        )
    cmd = args.lab_command
    if cmd == "up":
        with lab_state.locked(args.name):
            return _up(args)
    if cmd == "down":
        return _down(args)
    if cmd == "chaos":
        return _chaos(args)
    if cmd == "run" and not args.detach:
        with lab_state.locked(args.name):
            lan, saved = _attach(args.name)
        return _run(args, lan, saved)  # no lock held while a foreground command runs
    with lab_state.locked(args.name):
        lan, saved = _attach(args.name)
        if cmd == "run":
            rc = _run(args, lan, saved)
        elif cmd == "status":
            return _status(args, lan, saved)
        else:
            _fault(args, lan)
            rc = 0
        _save(args.name, lan, saved)
        return rc


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m ftmesh.cli.lab_cmd lab ...`` = ``ftmesh lab ...``."""
    parser = argparse.ArgumentParser(prog="ftmesh")
    add_lab_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return run_lab(args)
    except LabError as exc:
        print(f"ftmesh: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
