"""The flags every ``ftmesh`` command shares, in one table (imported by ``main`` and by the
subcommands alike, so that neither imports the other).

Every command that finds or joins a mesh adds its flags with :func:`add_settings_args` and
reads them with :func:`settings_from_args`, so ``--port`` (say) means the same everywhere and
the environment (``FTMESH_PORT``) fills what the flags leave out (``ftmesh.settings``).
:class:`Parser` makes argparse's errors one line.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any, NoReturn

from ..logs import LOG_FORMATS, LOG_LEVELS
from ..membership.config import PRESETS
from ..settings import DISCOVERY_KINDS, Settings, parse_meta


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (argparse prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_FLAGS: dict[str, dict[str, Any]] = {
    "mesh": {"metavar": "NAME", "help": "mesh name (default: default)"},
    "discovery": {
        "choices": DISCOVERY_KINDS,
        "help": "how to find members: local (same host, no multicast), seeds (the --join "
        "list), mdns (LAN multicast), none (default: %s; seeds with --join)",
    },
    "join": {
        "action": "append",
        "metavar": "HOST:PORT",
        "help": "a member (or a DNS name resolving to several) to join through; repeatable",
    },
    "interface": {
        "metavar": "IP|NAME",
        "help": "for mdns: the interface to announce and browse on (default: the one behind "
        "the default route); otherwise the address to bind",
    },
    "bind": {
        "metavar": "IP",
        "help": "address to bind gossip, data plane and state server to (default: the mDNS "
        "interface; for seeds the LAN address, loopback when every seed is loopback; for "
        "local 127.0.0.1); 0.0.0.0 binds all and advertises the default",
    },
    "advertise": {
        "metavar": "IP",
        "help": "address peers reach us on, published for gossip, data plane and state "
        "server (default: the bound one); may be one this machine does not own (NAT, port "
        "forwarding): the listeners bind --bind",
    },
    "port": {"type": int, "metavar": "PORT", "help": "gossip port, UDP and TCP (default: any)"},
    "data_port": {
        "type": int,
        "metavar": "PORT",
        "help": "data-plane (collectives) TCP port (default: any; launch: worker k gets PORT+k)",
    },
    "state_port": {
        "type": int,
        "metavar": "PORT",
        "help": "state-transfer TCP port (default: any; launch: worker k gets PORT+k)",
    },
    "site": {
        "metavar": "NAME",
        "help": "this member's site (a zone, a lab, a region): members of a site stay adjacent "
        "on the ring and reduce together first; default: sites measured from round trips",
    },
    "preset": {"choices": PRESETS, "help": "membership timing preset (default: %s)"},
    "secret_file": {
        "metavar": "FILE",
        "help": "file with the mesh secret (one per line; the first signs, all verify); "
        "default: $FTMESH_SECRET, else no authentication",
    },
    "encrypt": {
        "action": argparse.BooleanOptionalAction,
        "help": "also encrypt gossip and the data plane (AES-256-GCM; needs a secret; every "
        "member must agree)",
    },
    "registry_dir": {"help": argparse.SUPPRESS},
    "name": {"metavar": "NAME", "help": "human name (default: hostname-pid)"},
    "meta": {"action": "append", "metavar": "KEY=VALUE", "help": "member metadata; repeatable"},
    "start_peers": {
        "type": int,
        "metavar": "N",
        "help": "a fresh mesh takes its first step once N members are ready; after "
        "--start-timeout more than half of them start, fewer exit with an error (default: %s)",
    },
    "start_timeout": {
        "type": float,
        "metavar": "S",
        "help": "seconds to wait for the start peers (default: 60)",
    },
    "metrics_port": {
        "type": int,
        "metavar": "PORT",
        "help": "serve Prometheus metrics at http://BIND:PORT/metrics (0: any free port; "
        "needs ftmesh[metrics]; launch: worker k gets PORT+k); default: off",
    },
    "log_level": {
        "choices": LOG_LEVELS,
        "help": "level of ftmesh's log on stderr (default: warning; -v info, -vv debug)",
    },
    "log_format": {
        "choices": LOG_FORMATS,
        "help": "log as text (default), or json: one object per line, for log collectors",
    },
}
"""The flag of every user setting (``ftmesh.settings.Settings``); ``%s`` in a help text is
filled with the command's default."""

MESH_FLAGS = (
    "mesh", "discovery", "join", "interface", "secret_file", "encrypt", "registry_dir",
    "log_level", "log_format",
)  # fmt: skip
"""What every command that talks to a mesh takes."""
MEMBER_FLAGS = (*MESH_FLAGS, "bind", "advertise", "port", "preset", "metrics_port")
"""What a member of a mesh takes besides."""
TRAINER_FLAGS = (*MEMBER_FLAGS, "data_port", "state_port", "site")
"""What a member that trains (``worker``, ``launch``) takes besides: the ports of its data
plane and state server, and its site (``ftmesh node`` runs gossip only)."""


def add_settings_args(p: argparse.ArgumentParser, names: tuple[str, ...], **defaults: Any) -> None:
    """Add the flags of settings ``names``; ``defaults`` fill the ``%s`` of their help."""
    for name in names:
        spec = dict(_FLAGS[name])
        if "%s" in spec.get("help", ""):
            spec["help"] = spec["help"] % defaults.get(name, "none")
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, **spec)


def settings_from_args(
    args: argparse.Namespace, environ: Mapping[str, str], **defaults: Any
) -> Settings:
    """The command's ``defaults``, then the environment, then the flags given."""
    explicit: dict[str, Any] = {}
    for name in _FLAGS:
        value = getattr(args, name, None)
        if name == "meta" and value is not None:
            value = parse_meta(value)
        explicit[name] = value
    return Settings(**defaults).over(Settings.from_env(environ)).replace(**explicit)
