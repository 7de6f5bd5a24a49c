"""Which models stay loaded: the fit by measured memory, least-recently-used eviction,
keep-alive, and the limit on loads per minute."""

from __future__ import annotations

import pytest

from app.engine.residency import (
    Footprint,
    LoadRate,
    Residency,
    needed,
    plan_evictions,
)
from app.errors import Overloaded

MB = 1_000_000


def resident(name: str, weights: int, peak: int, used: float, *, loaded: float = 0.0,
             pinned: bool = False, keep: float = 300.0) -> Residency:
    return Residency(name, Footprint(weights * MB, peak * MB), loaded, used, keep, pinned)


def idle(_name: str) -> bool:
    return False


def test_models_need_every_weight_and_the_largest_batch_only() -> None:
    prints = [Footprint(20 * MB, 100 * MB), Footprint(30 * MB, 50 * MB)]
    assert needed(prints) == 150 * MB
    assert needed([]) == 0


def test_eviction_goes_least_recently_used_first_until_the_newcomer_fits() -> None:
    residents = [resident("a", 100, 10, used=5), resident("b", 100, 10, used=1),
                 resident("c", 100, 10, used=3)]
    incoming = Footprint(100 * MB, 10 * MB)
    assert plan_evictions(residents, incoming, 410 * MB, 10, idle, 0) == []
    assert plan_evictions(residents, incoming, 310 * MB, 10, idle, 0) == ["b"]
    assert plan_evictions(residents, incoming, 210 * MB, 10, idle, 0) == ["b", "c"]


def test_pinned_busy_and_new_models_are_never_evicted() -> None:
    residents = [resident("pinned", 100, 10, used=0, pinned=True),
                 resident("busy", 100, 10, used=1), resident("new", 100, 10, used=2, loaded=9),
                 resident("old", 100, 10, used=3)]
    incoming = Footprint(100 * MB, 10 * MB)

    def busy(name: str) -> bool:
        return name == "busy"

    assert plan_evictions(residents, incoming, 410 * MB, 10, busy, 5) == ["old"]
    assert plan_evictions(residents, incoming, 310 * MB, 10, busy, 5) is None
    assert plan_evictions(residents, incoming, 310 * MB, 10, busy, 0) == ["new", "old"]


def test_a_large_batch_elsewhere_counts_once() -> None:
    """The newcomer's batch does not add to the others': one batch runs at a time."""
    residents = [resident("big-batch", 100, 500, used=1)]
    assert plan_evictions(residents, Footprint(10 * MB, 400 * MB), 620 * MB, 5, idle, 0) == []
    assert plan_evictions(residents, Footprint(10 * MB, 600 * MB), 620 * MB, 5, idle,
                          0) == ["big-batch"]
    assert plan_evictions(residents, Footprint(10 * MB, 700 * MB), 620 * MB, 5, idle,
                          0) is None  # not even alone


def test_keep_alive() -> None:
    model = resident("m", 1, 1, used=100.0, keep=60.0)
    assert not model.expired(159.0) and model.expires_in(159.0) == pytest.approx(1.0)
    assert model.expired(160.0)
    model.use(200.0, keep_alive_s=0.0)
    assert model.expired(200.0) and model.expires_in(200.0) == 0.0
    model.use(201.0, keep_alive_s=-1.0)
    assert not model.expired(10**9) and model.expires_in(10**9) is None
    pinned = resident("p", 1, 1, used=0.0, keep=0.0, pinned=True)
    assert not pinned.expired(10**9) and pinned.expires_in(0) is None


def test_loads_per_minute() -> None:
    now = [0.0]
    rate = LoadRate(2, clock=lambda: now[0])
    rate.take()
    now[0] = 10.0
    rate.take()
    now[0] = 20.0
    with pytest.raises(Overloaded) as refused:
        rate.take()
    assert refused.value.retry_after == 40  # the first load leaves the window at 60 s
    now[0] = 60.0
    rate.take()  # the load at 0 s has left the window
    with pytest.raises(Overloaded):
        rate.take()
