"""Instrumentation for end-to-end tests of training scripts that are run as written: Python
loads this module at start-up when a test puts ``tests/hooks`` on ``PYTHONPATH``.

With ``FTMESH_TEST_TRACE`` set, every ``ElasticTrainer`` prints one progress line
(``FTMESH {json}``, what ``ftmesh launch`` reads to kill and join by step) per step it commits
or adopts: the step, the learning rate of the optimizer's first group, the state digest, the
members and the share. ``FTMESH_TEST_STEP_DELAY`` (seconds) paces the steps, and
``FTMESH_TEST_HOLD=STEP:MEMBERS`` holds each member after step STEP until MEMBERS members are
alive, so that a joiner's start-up lands mid-run.

``FTMESH_TEST_NAN_GRADS=WORKER:FIRST:COUNT`` (set or not, with or without the trace) makes the
``ftmesh launch`` worker named WORKER compute NaN gradients for COUNT steps from step FIRST
(1-based): a tensor hook on every parameter multiplies its gradient by NaN during those steps'
backward passes, as a diverging fp16 loss or a bad batch would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _install() -> None:
    from ftmesh.torch import trainer as trainer_module

    delay = float(os.environ.get("FTMESH_TEST_STEP_DELAY") or 0)
    step, _, members = os.environ.get("FTMESH_TEST_HOLD", "").partition(":")
    hold = (int(step), int(members)) if step else None
    original = trainer_module.ElasticTrainer.__init__

    def trace(trainer: Any, report: Any) -> None:
        record = {
            "step": report.step,
            "node": trainer.mesh.node_id,
            "lr": trainer.optimizer.param_groups[0]["lr"],
            "digest": trainer.digest(),
            "members": len(report.members),
            "share": report.share,
            "samples": report.samples,
            "attempts": report.attempts,
            "synced": report.synced,
            "adopted": report.adopted,
        }
        sys.stdout.write("FTMESH " + json.dumps(record) + "\n")
        sys.stdout.flush()
        if delay:
            time.sleep(delay)
        if hold and report.step >= hold[0] and len(report.members) < hold[1]:
            _hold(trainer, hold[1])

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.add_step_hook(trace)

    trainer_module.ElasticTrainer.__init__ = init  # type: ignore[method-assign]


def _hold(trainer: Any, members: int, timeout: float = 120.0) -> None:
    """After a step at or past ``FTMESH_TEST_HOLD``'s step on fewer members than it names, wait
    (between steps: the user's time) until that many members are alive in the mesh, so that a
    joiner started then (importing torch on a loaded host takes its time) lands mid-run
    however long it takes, instead of after the end."""
    from ftmesh.membership.messages import MemberState

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [m for m in trainer.mesh.members() if m.state == MemberState.ALIVE]
        if len(alive) >= members:
            return
        time.sleep(0.1)


def _install_nan_grads(spec: str) -> None:
    from ftmesh.torch import trainer as trainer_module

    worker, first, count = spec.split(":")
    if os.environ.get("FTMESH_WORKER_NAME") != worker:
        return
    steps = range(int(first), int(first) + int(count))
    original = trainer_module.ElasticTrainer.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)

        def poison(grad: Any) -> Any:
            return grad * float("nan") if max(self.committed, 0) + 1 in steps else grad

        for p in self.model.parameters():
            if p.requires_grad:
                p.register_hook(poison)

    trainer_module.ElasticTrainer.__init__ = init  # type: ignore[method-assign]


if os.environ.get("FTMESH_TEST_TRACE"):
    _install()
if os.environ.get("FTMESH_TEST_NAN_GRADS"):
    _install_nan_grads(os.environ["FTMESH_TEST_NAN_GRADS"])
