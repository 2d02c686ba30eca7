from __future__ import annotations

from ftmesh.net.ratelimit import MAX_SOURCES, RateLimiter


def test_bucket_allows_burst_then_rate() -> None:
    rl = RateLimiter(rate=10, burst=5, global_rate=1000)
    assert sum(rl.allow("a", 0.0) for _ in range(20)) == 5
    assert sum(rl.allow("a", 1.0) for _ in range(20)) == 5  # refilled 10/s, capped at burst
    assert rl.allow("b", 1.0)  # other sources are unaffected


def test_global_budget_bounds_many_sources() -> None:
    rl = RateLimiter(rate=100, burst=100, global_rate=10)
    allowed = sum(rl.allow(i, 0.0) for i in range(1000))
    assert allowed == 20  # the global burst


def test_source_table_is_bounded() -> None:
    rl = RateLimiter(rate=1, burst=1, global_rate=1e9)
    for i in range(3 * MAX_SOURCES):
        rl.allow(i, 0.0)
    assert len(rl._buckets) == MAX_SOURCES
