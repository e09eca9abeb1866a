"""The Celery app Flower loads (`celery -A tinkerq.launcher.flower_app:app flower`).

The app is the fleet's (:func:`tinkerq.celery_app.make_celery`): the broker's Sentinel and TLS options, and
remote control (inspect, revoke, shutdown) in JSON, which workers accept. Tasks are not registered here;
Flower learns them from the workers' events.

Two changes to Flower 2.2 itself:

- ``/metrics`` goes behind Flower's login. Flower serves it open (only ``/healthcheck`` should be): task
  names, worker names and rates are not for anyone who can reach the port.
- Workers that start after Flower are inspected as soon as their events reach it. Flower inspects workers
  (``/api/workers``, the dashboard's worker details) only at its start and on ``?refresh=1``, so a worker
  started later stayed missing from ``/api/workers`` until somebody asked for a refresh.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from flower.app import Flower
from flower.views import monitor
from tornado import web
from tornado.ioloop import PeriodicCallback

from tinkerq.celery_app import make_celery
from tinkerq.settings import Settings

NEW_WORKER_CHECK_MS = 2000  # how often Flower's worker list is compared with the workers its events show
# A worker that did not answer an inspection (busy loading its model, on a loaded host) is asked again after
# a delay that doubles from the first to the last of these, so a slow starter shows up within seconds and a
# worker that never answers costs one inspection per half minute.
REINSPECT_FIRST_S, REINSPECT_MAX_S = 2.0, 30.0

monitor.Metrics.get = web.authenticated(monitor.Metrics.get)


def inspect_new_workers(flower: Flower, asked: dict[str, tuple[float, float]]) -> None:
    """Inspect the workers Flower knows from their events but not from an inspection (runs on Flower's loop).

    ``asked`` maps a worker to (when it was last asked, the delay before asking it again).
    """
    now = time.monotonic()
    new = [name for name, worker in flower.events.state.workers.items()
           if worker.alive and name not in flower.workers
           and now - asked.get(name, (float("-inf"), 0.0))[0] >= asked.get(name, (0.0, 0.0))[1]]
    if new:
        for name in new:
            delay = asked[name][1] * 2 if name in asked else REINSPECT_FIRST_S
            asked[name] = (now, min(delay, REINSPECT_MAX_S))
        flower.update_workers()  # all workers at once, as Flower does at its start (one inspection in flight)


_flower_start = Flower.start


def _start_inspecting_new_workers(self: Flower, *args: Any, **kwargs: Any) -> Any:
    PeriodicCallback(functools.partial(inspect_new_workers, self, {}), NEW_WORKER_CHECK_MS).start()
    return _flower_start(self, *args, **kwargs)


Flower.start = _start_inspecting_new_workers

app = make_celery(Settings.from_env())
