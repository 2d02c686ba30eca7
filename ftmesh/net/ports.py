"""What a member says when one of its listeners cannot bind its port.

Theory of operation: a member has three listeners, gossip (UDP and TCP, ``--port``), the data
plane (TCP, ``--data-port``) and the state server (TCP, ``--state-port``), and each binds the
member's bind address, never the advertised one (``ftmesh.net.node``). A bind fails for one of
two reasons, each with its own fix: the port is taken (another process, or two of the
member's own listeners given one port): pick another, or 0 for any free one; or the address
is not one of this machine's (``EADDRNOTAVAIL``, errno 99 on Linux): bind a local address and
*advertise* the other one. Either way the user gets one line naming the setting, not an
``OSError`` traceback. A leaf module (no trio, nothing of the node), so the data plane and the
state server can use it without loading the node.
"""

from __future__ import annotations

import errno

from ..errors import ConfigError


def bind_error(what: str, host: str, port: int, setting: str, exc: OSError) -> ConfigError:
    """The error for listener ``what`` (``"gossip"``, ``"data-plane"``, ``"state"``) failing to
    bind ``host:port``; ``setting`` names the port's flag and variable, e.g.
    ``"--data-port ($FTMESH_DATA_PORT)"``."""
    why = exc.strerror.lower() if exc.strerror else str(exc)
    if exc.errno == errno.EADDRNOTAVAIL:
        fix = (
            f"{host} is not an address of this machine: bind a local one (--bind) and "
            f"advertise {host} (--advertise)"
        )
    else:
        fix = f"pick another {setting}, or 0 for any free one"
    return ConfigError(f"cannot bind {what} port {port} on {host}: {why}; {fix}")
