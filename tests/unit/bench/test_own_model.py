"""The piece of bench/own_model.py that needs no server: the offline limit's
bookkeeping."""

from __future__ import annotations

from bench.own_model import best, pool_offline


def test_rounds_pool_per_setting_and_the_fastest_pooled_setting_is_the_limit() -> None:
    rounds = [{(1, 1): 400.0, (1, 8): 900.0, (2, 8): 1000.0},
              {(1, 1): 600.0, (1, 8): 1100.0, (2, 8): 100.0}]
    pooled = pool_offline(rounds)
    assert pooled == {(1, 1): 500.0, (1, 8): 1000.0, (2, 8): 550.0}
    assert best(pooled) == ((1, 8), 1000.0)
