"""How a run of the step machine ends early, and the type of its generators.

Theory of operation. A run (``ftmesh.training.step``) is a generator that yields actions and
is sent ``(now, outcome)`` pairs; it returns its result. Two exceptions, raised anywhere
inside it (the machine's own generators or those of its parts, such as
``ftmesh.training.entry.Ring``), end it otherwise: :class:`Abort` with a ``Raise`` action
(the error the driver raises), :class:`Leave` with a ``Depart`` action (a planned
departure). ``StepMachine`` catches both where it advances the run.

The machine checks the type of every outcome where it is fed (``StepMachine.feed``, against
``actions.EXPECTS``); the accessors at the end (``view_of``...) unwrap the one an action
expects, for the generators of the machine and its parts.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import numpy as np

from ..errors import FtmeshError
from .actions import (
    Action,
    Depart,
    Failed,
    Fetched,
    MemberInfo,
    Members,
    Outcome,
    Reduced,
    ViewSeen,
)

if TYPE_CHECKING:
    from ..collective.view import RingView

T = TypeVar("T")

Steps: TypeAlias = Generator[Action, tuple[float, Outcome], T]
"""A generator of the step machine's actions, sent ``(now, outcome)``, returning ``T``."""


class Abort(Exception):
    """Ends a run with a ``Raise`` action (raised inside the run's generator)."""

    def __init__(self, error: BaseException, cause: BaseException | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.cause = cause


class Leave(Exception):
    """Ends a run with a ``Depart`` action (raised inside the run's generator)."""

    def __init__(self, action: Depart) -> None:
        super().__init__(f"departing after step {action.step}")
        self.action = action


# -- outcome accessors --------------------------------------------------------------------------


def seen_of(outcome: Outcome) -> RingView | None:
    """The view of a ``ViewSeen`` (``None``: none)."""
    assert isinstance(outcome, ViewSeen)
    return outcome.view


def view_of(outcome: Outcome) -> RingView:
    """The view of a ``ViewSeen`` that must have one (``WaitView``)."""
    view = seen_of(outcome)
    if view is None:
        raise FtmeshError("WaitView returned no view")
    return view


def members_of(outcome: Outcome) -> tuple[MemberInfo, ...]:
    assert isinstance(outcome, Members)
    return outcome.members


def vector_of(outcome: Outcome) -> np.ndarray:
    assert isinstance(outcome, Reduced)
    return outcome.vector


def nbytes_of(outcome: Outcome) -> int:
    assert isinstance(outcome, Fetched)
    return outcome.nbytes


def failed_of(outcome: Outcome) -> Failed:
    assert isinstance(outcome, Failed)
    return outcome
