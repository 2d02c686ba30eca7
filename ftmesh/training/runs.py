"""How a run of the step machine ends early, and the type of its generators.

Theory of operation. A run (``ftmesh.training.step``) is a generator that yields actions and
is sent ``(now, outcome)`` pairs; it returns its result. Two exceptions, raised anywhere
inside it (the machine's own generators or those of its parts, such as
``ftmesh.training.entry.Ring``), end it otherwise: :class:`Abort` with a ``Raise`` action
(the error the driver raises), :class:`Leave` with a ``Depart`` action (a planned
departure). ``StepMachine`` catches both where it advances the run.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeAlias, TypeVar

from .actions import Action, Depart, Outcome

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
