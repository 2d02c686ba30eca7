"""The state size a joiner prepares a receive buffer for (issue #26, item 7): bounded by what
the holders of the newest state advertise and by a multiple of the joiner's own state, so a
member advertising 1 TiB (or 100 MiB for a 1 KB model) makes no joiner allocate it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ftmesh.state.transfer import (
    SIZE_HINT_FACTOR,
    SIZE_HINT_SLACK,
    bounded_state_hint,
    own_size_limit,
)
from ftmesh.torch.driver import MeshDriver
from ftmesh.training.protocol import FRESH

TIB = 1 << 40
MB = 1_000_000


def test_only_the_holders_of_the_newest_step_count() -> None:
    # Three members at an old step claim 1 TiB; the two holding step 10 hold 5 MB.
    holders = [(10, 5 * MB), (10, 5 * MB), (3, TIB), (3, TIB), (3, TIB)]
    assert bounded_state_hint(holders, cap=2 * TIB) == 5 * MB
    # Among the newest, one member's claim cannot raise the agreed size.
    assert bounded_state_hint([(7, TIB), (7, 5 * MB), (7, 5 * MB)], cap=2 * TIB) == 5 * MB
    assert bounded_state_hint([(7, TIB), (7, TIB)], cap=TIB - 1) == 0  # over the cap
    assert bounded_state_hint([], cap=TIB) == 0


def test_own_size_limit() -> None:
    assert own_size_limit(1000) == 1000 * SIZE_HINT_FACTOR + SIZE_HINT_SLACK
    assert own_size_limit(-5) == SIZE_HINT_SLACK


def _joiner(advertised: int, own: int) -> Any:
    """What ``MeshDriver._prepare_receive_buffer`` reads of a driver that has not trained."""
    return SimpleNamespace(
        machine=SimpleNamespace(committed=FRESH),
        _receive_buffer=None,
        mesh=SimpleNamespace(advertised_state_bytes=lambda: advertised),
        state=SimpleNamespace(state=SimpleNamespace(nbytes=lambda: own)),
    )


def test_a_joiner_prepares_no_buffer_far_larger_than_its_own_state() -> None:
    # A 1 KB model; the members advertise 100 MB (a lie, or another program).
    big = _joiner(100 * MB, 1000)
    MeshDriver._prepare_receive_buffer(big)
    assert big._receive_buffer is None
    # A plausible size (the same model with more optimizer state) is prepared.
    fair = _joiner(3 * MB, 1 * MB)
    MeshDriver._prepare_receive_buffer(fair)
    assert fair._receive_buffer is not None and fair._receive_buffer.nbytes >= 3 * MB
