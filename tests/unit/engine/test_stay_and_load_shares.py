"""The two rules against model churn: a request without the admin token only lengthens a
model's stay (up to a cap), and one client's requests cause at most their share of the
loads in a minute, so another client can still load."""

from __future__ import annotations

import pytest

from app.engine.residency import FOREVER, Footprint, LoadRate, Residency, StayNote
from app.errors import Overloaded

CAP_S = 3600.0


def staying(keep_alive_s: float) -> Residency:
    return Residency("m", Footprint(1, 1), loaded_at=0.0, last_used=0.0,
                     keep_alive_s=keep_alive_s)


@pytest.mark.parametrize(("now_s", "asked_s", "after_s", "note"), [
    (300.0, 600.0, 600.0, None),  # longer: done
    (300.0, 300.0, 300.0, None),  # the same: done
    (3600.0, 0.0, 3600.0, StayNote.IGNORED),  # keep_alive=0 from another app
    (3600.0, 60.0, 3600.0, StayNote.IGNORED),  # shorter
    (300.0, FOREVER, 300.0, StayNote.IGNORED),  # for ever needs the token
    (FOREVER, 600.0, FOREVER, StayNote.IGNORED),  # a stay for ever is the longest
    (300.0, 86400.0, CAP_S, StayNote.CAPPED),  # longer than the cap: cut to it
    (7200.0, 86400.0, 7200.0, StayNote.CAPPED),  # an admin's longer stay is kept
])
def test_a_request_only_lengthens_a_stay_up_to_the_cap(
        now_s: float, asked_s: float, after_s: float, note: StayNote | None) -> None:
    model = staying(now_s)
    assert model.lengthen(asked_s, CAP_S) is note
    assert model.keep_alive_s == after_s


def test_the_admins_use_still_sets_any_stay() -> None:
    model = staying(3600.0)
    model.use(5.0, 0.0)
    assert model.keep_alive_s == 0.0 and model.expired(5.0)


def test_one_client_gets_its_share_of_the_loads_and_another_still_loads() -> None:
    now = [0.0]
    rate = LoadRate(6, clock=lambda: now[0], per_client=3)
    for second in (0.0, 1.0, 2.0):
        now[0] = second
        rate.take("127.0.0.1/churner")
    now[0] = 20.0
    with pytest.raises(Overloaded) as refused:
        rate.take("127.0.0.1/churner")
    assert refused.value.retry_after == 40  # its first load leaves the window at 60 s
    message = refused.value.message
    assert "(127.0.0.1/churner)" in message and "3 models in the last minute" in message
    assert "the most one app may" in message and "Try again in 40 s" in message
    rate.take("127.0.0.1/other")  # the others' share is untouched
    rate.take(None)  # an admin's load counts for everyone only
    rate.take(None)
    with pytest.raises(Overloaded) as full:  # 6 in the window: the limit for everyone
        rate.take("127.0.0.1/third")
    assert "vramguard has loaded 6 models" in full.value.message
    now[0] = 60.0
    rate.take("127.0.0.1/churner")  # its load at 0 s has left the window


def test_clients_are_forgotten_once_their_loads_leave_the_window() -> None:
    now = [0.0]
    rate = LoadRate(1000, clock=lambda: now[0], per_client=1)
    for client in range(500):
        rate.take(f"c{client}")
    now[0] = 61.0
    rate.take("late")
    assert list(rate._by_client) == ["late"]


def test_a_share_larger_than_the_limit_is_the_limit() -> None:
    assert LoadRate(2, clock=lambda: 0.0, per_client=5).per_client == 2
