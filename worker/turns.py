"""Fair turns between training and sampling on one worker's compute.

Training requests run in the Celery thread, decode steps in the sampling engine's thread. Running both at
once would only make them fight over the same cores (or GPU), so each unit of work — one training request,
one prefill or decode step — takes a turn. When only one side has work it gets every turn. When both wait,
the side that used less compute lately goes next (usage decays with a half-life of a few seconds), so each
gets about half the time whatever the size of its units: a long RL sampling phase cannot starve
``forward_backward``, nor a stream of training requests the sampling batch. A side coming back from idle
gets at most ``max_credit_s`` of priority for the time it was away.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator

KINDS = ("train", "sample")


class ComputeTurns:
    def __init__(self, half_life_s: float = 5.0, max_credit_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.half_life_s = half_life_s
        self.max_credit_s = max_credit_s
        self._cond = threading.Condition()
        self._busy = False
        self._waiting = dict.fromkeys(KINDS, 0)
        self._used = dict.fromkeys(KINDS, 0.0)  # decayed seconds of compute
        self._seconds = dict.fromkeys(KINDS, 0.0)  # total, for metrics and tests
        self._at = clock()

    @contextlib.contextmanager
    def take(self, kind: str) -> Iterator[None]:
        """Hold the compute for one unit of ``kind`` work ("train" or "sample")."""
        other = KINDS[1 - KINDS.index(kind)]
        with self._cond:
            self._decay()
            if self._waiting[kind] == 0:  # back from idle: bounded credit for the time away
                self._used[kind] = max(self._used[kind], self._used[other] - self.max_credit_s)
            self._waiting[kind] += 1
            try:
                while self._busy or (self._waiting[other] and self._used[kind] > self._used[other]):
                    self._cond.wait()
                    self._decay()
            finally:
                self._waiting[kind] -= 1
            self._busy = True
        started = self.clock()
        try:
            yield
        finally:
            spent = self.clock() - started
            with self._cond:
                self._decay()
                self._used[kind] += spent
                self._seconds[kind] += spent
                self._busy = False
                self._cond.notify_all()

    def seconds(self) -> dict[str, float]:
        """Compute seconds each side has used since the worker started."""
        with self._cond:
            return dict(self._seconds)

    def _decay(self) -> None:
        now = self.clock()
        factor = math.pow(0.5, (now - self._at) / self.half_life_s)
        self._at = now
        for kind in KINDS:
            self._used[kind] *= factor
