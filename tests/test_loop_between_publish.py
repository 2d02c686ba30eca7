"""``ftmesh.torch.between``: a member whose code between steps runs long publishes it (the
fault text of its progress), so ``ftmesh status`` and the launcher's view show why the mesh
waits; the next step ends it."""

from __future__ import annotations

import threading

from ftmesh.torch.between import BetweenSteps, between_text


def test_a_long_pause_between_steps_is_published_and_the_next_step_ends_it() -> None:
    got: list[tuple[float, int]] = []
    published = threading.Event()

    def publish(seconds: float, step: int) -> None:
        got.append((seconds, step))
        published.set()

    resumed: list[int] = []
    watch = BetweenSteps(publish, lambda: resumed.append(len(got)), after=0.05, every=0.05)
    try:
        watch.enter(7)
        assert published.wait(10.0), "a pause longer than `after` was not published"
        watch.leave()
        count = len(got)
        assert resumed == [count]  # the plain progress is published again
        assert count >= 1 and got[0][1] == 7 and got[0][0] >= 0.05, got
        published.clear()
        watch.enter(8)  # the next pause names its own step
        assert published.wait(10.0)
        watch.leave()
        assert got[count][1] == 8, got
        watch.leave()  # nothing published since: nothing to resume
        assert len(resumed) == 2
        assert watch.publications == len(got)
    finally:
        watch.stop()


def test_the_text_names_the_pause_and_the_step() -> None:
    assert between_text(35.4, 12) == "between steps 35s (after step 12)"
