"""A whole fleet in one process: Celery's in-memory transport, the same serializer and worker code.

    with EmbeddedFleet("/path/to/model") as fleet:
        sc = ServiceClient(settings=fleet.settings)
        ...

Used by ``tinkerq sft`` when no broker is configured. Messages still go through msgpack encoding,
claim checks, Celery routing and the worker's ordering; only the transport is a Python queue.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import _state as celery_state
from celery.contrib.testing.worker import start_worker

from tinkerq.settings import Settings
from tinkerq.worker.core.lifecycle import Lifecycle
from tinkerq.worker.core.runtime import AssembledWorker, assemble


class EmbeddedFleet:
    def __init__(self, model_path: str, settings: Settings | None = None, *, name: str | None = None) -> None:
        base = settings or Settings.from_env()
        self.settings = base.replace(broker_url="memory://")
        self.model_path = model_path
        self.name = name
        self.worker: AssembledWorker | None = None
        self._ctx: Any = None
        self._apps_before: tuple[Any, Any] = (None, None)

    def __enter__(self) -> EmbeddedFleet:
        # The memory transport has no host; kombu warns about that on every connection.
        logging.getLogger("kombu.connection").setLevel(logging.ERROR)
        self.worker = assemble(self.model_path, self.settings, name=self.name)
        app = self.worker.connection.app
        self._apps_before = (celery_state.default_app, celery_state._tls.current_app)
        self._ctx = start_worker(
            app, pool="solo", concurrency=1, perform_ping_check=False, loglevel="WARNING",
            queues=self.worker.queues, shutdown_timeout=30.0,
        )
        self._ctx.__enter__()
        # The same parts as `tinkerq worker`, started and stopped in the same order (worker/core/lifecycle.py).
        self.lifecycle = Lifecycle(self.worker)
        self.lifecycle.start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.worker is not None
        try:
            self._ctx.__exit__(None, None, None)  # the consumer stops, as a worker's shutdown stops it first
            self.lifecycle.stop()
        finally:
            # start_worker made this fleet's app Celery's default and current one; left there, Celery would keep the
            # app, its tasks and so the service and its model alive after the fleet (until another replaced it).
            default, current = self._apps_before
            celery_state.set_default_app(default)
            celery_state._set_current_app(current)

    @property
    def base_model(self) -> str:
        assert self.worker is not None
        return self.worker.service.base_model
