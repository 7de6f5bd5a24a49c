"""The whole-body deadline's rule, on a fake clock: only waits count, bytes buy time at the
minimum rate, a client at that rate never runs out, and the refusal says what to do."""

from __future__ import annotations

from app.gates.upload_deadline import BodyDeadline, UploadPace

PACE = UploadPace(min_bytes_per_s=1000, grace_s=5)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_body_has_the_grace_plus_what_its_bytes_bought():
    assert PACE.allowed_s(0) == 5
    assert PACE.allowed_s(3000) == 8


def test_only_time_spent_waiting_for_bytes_counts():
    clock = Clock()
    deadline = BodyDeadline(PACE, clock)
    with deadline.waiting():
        clock.now += 2
    clock.now += 60  # the route busy with something else: not the client's time
    with deadline.waiting():
        clock.now += 1
    assert deadline.waited_s == 3
    assert deadline.left_s(received=0) == 2


def test_a_client_at_the_minimum_rate_never_runs_out_and_a_trickle_does():
    clock = Clock()
    steady, trickle = BodyDeadline(PACE, clock), BodyDeadline(PACE, clock)
    received = 0
    for _ in range(600):  # ten minutes of 100 bytes every 0.1 s: exactly the rate
        assert steady.left_s(received) > 0
        with steady.waiting():
            clock.now += 0.1
        received += 100
    trickled = 0
    while (left_s := trickle.left_s(trickled)) >= 1:  # a byte a second arrives in time
        with trickle.waiting():
            clock.now += 1
        trickled += 1
    assert trickled == 5  # the 6th byte would come at 6 s; the wait for it ends at 5.005 s
    assert 0 < left_s < 0.01


def test_the_refusal_is_a_408_that_names_the_setting():
    deadline = BodyDeadline(UploadPace(64 * 1024, 5), Clock())
    error = deadline.too_slow(received=12)
    assert (error.status, error.code) == (408, "request_timeout")
    assert "too slowly" in error.message
    assert "64 KiB a second (min_upload_bytes_per_s)" in error.message
