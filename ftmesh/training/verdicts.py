"""Judging a step's reduced header and gathered rows: typed verdicts, offenders named.

Theory of operation. After a step's gradient allreduce every member holds the same reduced
header (sample count, loss, round tag, leave slots, state check values, speeds:
``ftmesh.training.protocol``) and, from one allgather, every member's *row*: its own
header contribution as it says it added it, and its flags (non-finite gradients; leaving
after the step, asked too late for its leave bit). A row is written by
its member only, so what it says is attributable. :class:`HeaderJudge` turns the two into a
:class:`StepVerdict`, and never raises, whatever the numbers (``DESIGN-NOTES``: the step
header):

1. **Rows.** The gathered rows must be one per member of the view (else the attempt fails);
   each is checked alone (``protocol.row_faults``: its counts, tag, flags, speed claims):
   a hard fault fails the attempt and names the member, a soft one (an implausible speed
   claim) only discards that claim. The rows must add up to the reduced header
   (``protocol.rows_mismatch``).
2. **State check** (every ``check_every`` steps): each member's check values of the
   registered parts, compared as they are. Members that differ from a strict majority are
   offenders (the attempt fails); without a strict majority for us, the verdict is a
   divergence (the driver raises ``StateDivergedError``, naming every member's values).
3. **Round.** The reduced header must be of this round (``protocol.reduction_problem``),
   its sample count the attempt's (the global batch, or what a kept attempt trains:
   :func:`expected_samples`): else a ``DESYNC`` failure.
4. **Going on.** The step's agreed speeds (one per view rank; 0 for a member whose claim
   was not believed), and whether every member skips the update (some member flagged
   non-finite gradients, or the reduced ones are not finite). A member whose gradients were
   non-finite in ``NONFINITE_LIMIT`` committed steps in a row is an offender from then on
   (:meth:`HeaderJudge.committed` counts the streaks).

:meth:`HeaderJudge.check_reduction` is the reduced header's check alone (the round, the
sample count, the leave bits, the state check's sums), and :func:`leaving` reads who
announced their departure in it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .actions import Compute, Failed, Failure
from .config import TrainerConfig
from .pace import Pace
from .protocol import (
    COUNTER_SLOTS,
    HEADER_SLOTS,
    SPEED_RANKS,
    SPEED_SLOTS,
    Offence,
    RowFault,
    leavers,
    reduction_problem,
    row_faults,
    row_flag,
    row_leaves,
    row_nonfinite,
    rows_mismatch,
    speeds_problem,
)

log = logging.getLogger("ftmesh.training")

NONFINITE_LIMIT = 5
"""Committed steps in a row with non-finite gradients from one member after which each
further one is an offence of that member (``StepVerdict.offences``), as a malformed header
is: a member whose gradients stay non-finite is broken or hostile, and the accusation path
leaves it out (``ftmesh.collective.reach``: ``bad_bytes_strikes`` offences)."""


@dataclass(frozen=True, slots=True)
class StepVerdict:
    """What :meth:`StepMachine.check_step` says of a step's reduced header and gathered rows.

    ``failed``: the attempt fails (feed it back); ``diverged``: the parts whose digests differ
    while we are not in a strict majority (a fatal ``StateDivergedError``; ``rows`` holds every
    member's check values to name them); else the step goes on, with ``speeds`` (one per
    view rank; 0: unmeasured or not believed), and ``skip``: every member skips the update
    (non-finite gradients: ``nonfinite`` names the members that said so). ``offences``: the
    members' faults to report (``SyncMesh.report_offence``), soft ones included."""

    failed: Failed | None = None
    diverged: tuple[int, ...] = ()
    rows: tuple[tuple[int, ...], ...] = ()
    offences: tuple[Offence, ...] = ()
    speeds: tuple[float, ...] = ()
    skip: bool = False
    nonfinite: tuple[str, ...] = ()


def expected_samples(action: Compute, batch_size: Callable[[int], int]) -> int:
    """The sample count ``action``'s reduced header must hold: the step's global batch, or
    what a kept attempt trains (``Compute.trained``, ``TrainerConfig.recovery="keep"``)."""
    return batch_size(action.index) if action.trained is None else action.trained


def leaving(
    action: Compute, header: Sequence[float], rows: np.ndarray | None = None
) -> tuple[str, ...]:
    """The members that announced that they leave after ``action``'s step: in its reduced
    header (checked), or with ``FLAG_LEAVING`` in their gathered ``rows`` (judged), in view
    order."""
    size = action.view.size
    ranks = set(leavers(np.asarray(header[COUNTER_SLOTS:HEADER_SLOTS]), size) or ())
    if rows is not None and rows.ndim == 2 and rows.shape[0] == size:
        ranks |= {r for r in range(size) if row_leaves(float(rows[r, -1]))}
    return tuple(action.view.node_ids[r] for r in sorted(ranks))


def flagged(action: Compute, rows: np.ndarray, bit: int) -> tuple[str, ...]:
    """The members whose gathered ``rows`` of ``action``'s step hold the flag ``bit``
    (``protocol.FLAG_*``), in view order; none when the rows are not one per member."""
    size = action.view.size
    if rows.ndim != 2 or rows.shape[0] != size:
        return ()
    return tuple(action.view.node_ids[r] for r in range(size) if row_flag(float(rows[r, -1]), bit))


class HeaderJudge:
    """One member's judge of step headers; see the module docstring. ``pace`` gives the
    split tag of a step (``Pace.split_tag``)."""

    def __init__(
        self, config: TrainerConfig, me: str, batch_size: Callable[[int], int], pace: Pace
    ) -> None:
        self.config = config
        self.me = me
        self.batch_size = batch_size
        self.pace = pace
        self._nonfinite_streak: dict[str, int] = {}
        """Committed steps in a row with non-finite gradients, by member."""
        self.nonfinite_steps = 0
        """Committed steps whose update every member skipped (non-finite gradients)."""
        self.header_faults = 0
        """Faults found in members' header contributions (``protocol.RowFault``)."""

    def check_reduction(
        self,
        action: Compute,
        header: Sequence[float],
        own_checks: Sequence[int] | None,
        announced: bool = False,
    ) -> Failed | tuple[int, ...] | None:
        """Check the reduced header of ``action``: ``None`` when it is sound, a ``Failed``
        (``DESYNC``: feed it back) when it is data of another round, or the indices of the
        registered parts whose digests differ between members (a fatal divergence).
        ``announced``: we set our leave bit in it."""
        view = action.view
        if self.config.measures_speed:
            trouble = speeds_problem(header[-SPEED_SLOTS:], view.size, self.pace.split_tag(action))
            if trouble:
                return Failed(Failure.DESYNC, f"step {action.index + 1}: {trouble}")
            header = header[:-SPEED_SLOTS]
        problem = reduction_problem(
            action.index,
            view.size,
            expected_samples(action, self.batch_size),
            header,
            own_checks,
            view.rank_of(self.me),
            announced,
        )
        if problem is None:
            return None
        if problem.desync:
            return Failed(Failure.DESYNC, problem.desync)
        return problem.diverged

    def check_step(
        self,
        action: Compute,
        header: Sequence[float],
        rows: np.ndarray,
        own_checks: Sequence[int] | None,
        parts: int,
        announced: bool = False,
        reduced_finite: bool = True,
    ) -> StepVerdict:
        """Judge a step from its reduced ``header`` and every member's gathered ``rows`` (its
        own contribution and flags): the step goes on, or fails with a typed
        reason, or our state differs from the majority's (the module docstring's 1 to 4).
        ``parts``: the header's check slots when ``own_checks`` is ``None``;
        ``reduced_finite``: whether the reduced gradients are all finite."""
        index = action.index
        parts = len(own_checks) if own_checks is not None else parts
        tag = self.pace.split_tag(action) if self.config.measures_speed else None
        rows = np.asarray(rows)
        offences: list[Offence] = []
        verdict = self._judge_rows(action, header, rows, parts, tag, own_checks, offences)
        if verdict is not None:
            return verdict
        problem = reduction_problem(
            index,
            action.view.size,
            expected_samples(action, self.batch_size),
            header[: len(header) - SPEED_SLOTS] if tag is not None else header,
            own_checks,
            action.view.rank_of(self.me),
            announced,
        )
        if problem is not None and problem.desync:
            return StepVerdict(failed=Failed(Failure.DESYNC, problem.desync))
        return self._going_on(action, rows, parts, tag, offences, reduced_finite)

    def committed(self, members: Sequence[str], skipped: bool) -> None:
        """After committing a step: count it if its update was skipped, and each member's
        streak of steps with non-finite gradients (``members``: those that flagged them)."""
        if skipped:
            self.nonfinite_steps += 1
        for m in [m for m in self._nonfinite_streak if m not in members]:
            del self._nonfinite_streak[m]
        for m in members:
            self._nonfinite_streak[m] = self._nonfinite_streak.get(m, 0) + 1

    def _judge_rows(
        self,
        action: Compute,
        header: Sequence[float],
        rows: np.ndarray,
        parts: int,
        tag: int | None,
        own_checks: Sequence[int] | None,
        offences: list[Offence],
    ) -> StepVerdict | None:
        """1 and 2 of the module docstring: a verdict that ends the judging, or ``None``
        with every row's soft offences added to ``offences``."""
        size, index = action.view.size, action.index
        if rows.ndim != 2 or rows.shape[0] != size:
            offence = Offence(-1, RowFault.SHAPE, f"gathered rows of shape {rows.shape}")
            return self._rejected(action, (offence,))
        for r in range(size):
            offences += row_faults(
                rows[r].tolist(),
                step=index,
                rank=r,
                batch=self.batch_size(index),
                parts=parts,
                check=own_checks is not None,
                tag=tag,
            )
        hard = tuple(o for o in offences if not o.fault.soft)
        if hard:
            return self._rejected(action, hard, tuple(offences))
        width = len(header)
        speed_ranks = SPEED_SLOTS - 1 if tag is not None else 0
        mismatch = (
            rows_mismatch(rows[:, :width], header, speed_ranks)
            if rows.shape[1] == width + 1
            else f"rows of {rows.shape[1]} slots for a header of {width}"
        )
        if mismatch:
            return self._rejected(action, (Offence(-1, RowFault.MISMATCH, mismatch),))
        if own_checks is not None:
            return self._compare_checks(action, rows, parts, own_checks, offences)
        return None

    def _compare_checks(
        self,
        action: Compute,
        rows: np.ndarray,
        parts: int,
        own_checks: Sequence[int],
        offences: list[Offence],
    ) -> StepVerdict | None:
        """The state check: each member's check values, compared as they are (not as a
        sum)."""
        size = action.view.size
        checks = [
            tuple(int(c) for c in rows[r, HEADER_SLOTS : HEADER_SLOTS + parts]) for r in range(size)
        ]
        mine = tuple(int(c) for c in own_checks)
        same = [r for r in range(size) if checks[r] == mine]
        if len(same) == size:
            return None
        diverged = tuple(i for i in range(parts) if any(c[i] != mine[i] for c in checks))
        if 2 * len(same) <= size:  # we are not in a strict majority: stop
            return StepVerdict(diverged=diverged, rows=tuple(checks))
        odd = tuple(
            Offence(r, RowFault.CHECKS, "holds other state than the majority")
            for r in range(size)
            if r not in same
        )
        return self._rejected(action, odd, tuple(offences) + odd)

    def _going_on(
        self,
        action: Compute,
        rows: np.ndarray,
        parts: int,
        tag: int | None,
        offences: list[Offence],
        reduced_finite: bool,
    ) -> StepVerdict:
        """4 of the module docstring: the verdict of a step that goes on."""
        names = action.view.node_ids
        size = action.view.size
        speeds: tuple[float, ...] = ()
        if tag is not None:
            soft = {o.rank for o in offences}
            base = HEADER_SLOTS + parts
            speeds = tuple(
                0.0 if r in soft or r >= SPEED_RANKS else float(rows[r, base + r])
                for r in range(size)
            )
        flagged = tuple(names[r] for r in range(size) if row_nonfinite(float(rows[r, -1])))
        skip = bool(flagged) or not reduced_finite
        offences += self._nonfinite_offences(names, flagged)
        if skip:
            log.warning(
                "step %d: non-finite gradients from %s: every member skips the update",
                action.index + 1,
                ", ".join(flagged)
                if flagged
                else "no member that says so (the reduced gradients are not finite)",
            )
        return StepVerdict(offences=tuple(offences), speeds=speeds, skip=skip, nonfinite=flagged)

    def _rejected(
        self, action: Compute, hard: tuple[Offence, ...], every: tuple[Offence, ...] = ()
    ) -> StepVerdict:
        names = action.view.node_ids
        detail = "; ".join(
            f"{names[o.rank] if 0 <= o.rank < len(names) else 'a member'}: {o.fault.value} "
            f"({o.detail})"
            for o in hard[:4]
        )
        self.header_faults += len(hard)
        return StepVerdict(
            failed=Failed(Failure.HEADER, f"step {action.index + 1}: {detail}"),
            offences=every or hard,
        )

    def _nonfinite_offences(self, names: Sequence[str], flagged: Sequence[str]) -> list[Offence]:
        """Members whose gradients were non-finite in ``NONFINITE_LIMIT`` committed steps in a
        row, counting this one: treated as insiders (an offence each step from then on)."""
        return [
            Offence(r, RowFault.FLAG, f"non-finite gradients {n + 1} steps in a row")
            for r, m in enumerate(names)
            if m in flagged and (n := self._nonfinite_streak.get(m, 0)) + 1 >= NONFINITE_LIMIT
        ]
