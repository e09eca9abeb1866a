"""Fair turns between training and sampling (worker/turns.py), on a simulated clock: no timing asserted."""

from __future__ import annotations

import threading
import time

import pytest

from tinkerq.worker.turns import ComputeTurns

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    """Time advances only when a unit of work says it took some."""

    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.now

    def spend(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


def _run(turns: ComputeTurns, clock: FakeClock, units: dict[str, float], until: float) -> dict[str, int]:
    """Both sides loop on units of the given (simulated) length until ``until``; returns units done per side."""
    done = dict.fromkeys(units, 0)

    def side(kind: str) -> None:
        while clock() < until:
            with turns.take(kind):
                clock.spend(units[kind])
                done[kind] += 1
                time.sleep(0.0005)  # real time too, so that both threads are scheduled

    threads = [threading.Thread(target=side, args=(k,)) for k in units]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return done


def test_both_busy_share_the_compute_whatever_their_unit_sizes():
    clock = FakeClock()
    turns = ComputeTurns(half_life_s=5.0, clock=clock)
    # Training requests of 0.5 s against decode steps of 10 ms: neither starves the other.
    done = _run(turns, clock, {"train": 0.5, "sample": 0.01}, until=20.0)
    seconds = turns.seconds()
    share = seconds["sample"] / (seconds["sample"] + seconds["train"])
    assert 0.4 < share < 0.6, (seconds, done)
    assert done["sample"] > 20 * done["train"]  # many short units for each long one


def test_one_side_alone_gets_every_turn_and_comes_back_with_bounded_credit():
    clock = FakeClock()
    turns = ComputeTurns(half_life_s=5.0, max_credit_s=1.0, clock=clock)
    _run(turns, clock, {"sample": 0.05}, until=30.0)  # a long sampling phase, no training
    assert turns.seconds()["train"] == 0.0 and turns.seconds()["sample"] == pytest.approx(30.0, abs=0.06)
    start = dict(turns.seconds())
    _run(turns, clock, {"train": 0.1, "sample": 0.05}, until=40.0)
    gained = {k: turns.seconds()[k] - start[k] for k in start}
    # Training, back from idle, is ahead at first (its credit is capped), then the two share the time.
    assert 0.4 < gained["train"] / 10.0 < 0.7, gained
