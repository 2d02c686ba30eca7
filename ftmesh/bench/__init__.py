"""Benchmarks that compare ftmesh against a peer measured in the same run."""

from __future__ import annotations

import datetime
import os


def host_stamp(load_before: tuple[float, float, float]) -> dict[str, object]:
    """What a bench's JSON says of the host around its run: the load average before (taken
    by the caller as it starts) and now, and when it ended (UTC)."""
    return {
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
