"""A local mesh finds itself with no configuration, loses a member to kill -9, and notices.

Starts N ``ftmesh node`` processes on this host (same-host discovery: no multicast, no
addresses to type), waits until every member sees every other, prints the member table, kills
one member with SIGKILL and reports when each survivor declared it dead.

    python examples/membership_demo.py [--nodes 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from ftmesh.lab.procs import NodeGroup, declared_dead


def show_status(group: NodeGroup) -> None:
    """What ``ftmesh status`` prints about the demo mesh."""
    argv = [sys.executable, "-m", "ftmesh", "status", "--mesh", group.mesh,
            "--registry-dir", str(group.registry)]  # fmt: skip
    subprocess.run(argv, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5)
    args = parser.parse_args()
    with NodeGroup(mesh="demo") as group:
        t0 = time.monotonic()
        nodes = [group.start() for _ in range(args.nodes)]
        group.wait_converged(nodes, timeout=30)
        print(
            f"{len(nodes)} members found each other in {time.monotonic() - t0:.2f} s "
            "(same-host discovery, SWIM gossip, no coordinator):\n"
        )
        show_status(group)
        victim = nodes[-1]
        print(f"\nkill -9 {victim.name} ...")
        killed = time.monotonic()
        victim.kill()
        for n in nodes[:-1]:
            seen = n.wait_seen(declared_dead(victim.node_id), timeout=10)
            print(f"  {n.name} declared {victim.name} dead after {seen.mono - killed:.3f} s")
        print("\nthe survivors carry on as one mesh:")
        time.sleep(0.5)
        show_status(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
