"""A worker's "I serve model X" registration: a key with a TTL, refreshed while the worker lives.

Producers read these to fail fast on a model nobody serves, instead of waiting on a queue forever.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from tinkerq import keys
from tinkerq.store import KeyValueStore

log = logging.getLogger("tinkerq.worker")


class Registration:
    def __init__(self, store: KeyValueStore, base_model: str, worker_id: str, period_s: float,
                 info: dict | None = None) -> None:
        self.store = store
        self.key = keys.serving(base_model, worker_id)
        self.period_s = period_s
        self.record = {
            "base_model": base_model,
            "worker": worker_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            **(info or {}),
        }
        self._stop = threading.Event()
        self._withdrawn = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self.store.set(self.key, json.dumps(self.record).encode(), ttl_s=3 * self.period_s)

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="tinkerq-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            if self._withdrawn.is_set():
                continue
            try:
                self.beat()
            except Exception as exc:  # Redis blips must not kill the worker; the TTL covers us
                log.warning("heartbeat failed: %s", exc)

    def withdraw(self) -> None:
        """Stop announcing the model for now (e.g. while a shard group re-forms); :meth:`resume` undoes it."""
        self._withdrawn.set()
        self._delete()

    def resume(self) -> None:
        self._withdrawn.clear()
        if self._thread is not None:  # announced only once the worker consumes its queues
            self.beat()

    def stop(self) -> None:
        self._stop.set()
        self._delete()

    def _delete(self) -> None:
        try:
            self.store.delete(self.key)
        except Exception as exc:  # the TTL removes it anyway
            log.warning("could not remove registration %s: %s", self.key, exc)
