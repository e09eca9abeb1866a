"""Each training run's metrics, step by step: what the console plots as loss and metric curves.

Nothing else keeps them: a future's answer (with the metrics in it) lives only ``gateway_keep_s`` in Redis,
and the usage counters sum tokens, not losses. So when a forward, forward_backward or optim_step of a run is
answered (:data:`tinkerq.operations.PLOTTED`), its metrics are written here, one field per SDK ``seq_id`` of a
Redis hash per run (:func:`tinkerq.keys.gateway_run_metrics`). A field per seq_id makes a job run twice (an
adopting gateway re-posts it; the worker answers from its kept reply) write the same field again, never a second
point.

Kept as long as the run's record (``IDLE_TTL_S`` after its last request), and at most ``MAX_POINTS`` per run
(about 100 bytes each): a longer run keeps its newest points.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from tinkerq import keys
from tinkerq.errors import TinkerqError
from tinkerq.gateway.records import IDLE_TTL_S
from tinkerq.store import Expire, HashDelete, HashPut, KeyValueStore, Transaction

log = logging.getLogger("tinkerq.gateway")

MAX_POINTS = 20_000


class RunMetrics:
    def __init__(self, store: KeyValueStore) -> None:
        self.store = store.with_retry(0)  # inline on the gateway's answers: never wait out an outage

    def record(self, model_id: str, seq_id: int, op: str, metrics: Mapping[str, float]) -> None:
        """Keep step ``seq_id``'s metrics. Best effort: a Redis error loses the point, never the answer."""
        point = json.dumps({"op": op, "t": time.time(), "metrics": {str(k): float(v) for k, v in metrics.items()}},
                           separators=(",", ":"))
        key = keys.gateway_run_metrics(model_id)

        def add(t: Transaction) -> int:
            t.write(HashPut(key, {str(seq_id): point}), Expire(key, IDLE_TTL_S))
            return t.hash_size(key) + 1  # (read before the write: at most one more)

        try:
            if self.store.transaction(add, what="recording a run's metrics") > MAX_POINTS:
                # Rare: drop the oldest steps in one go.
                fields = sorted(int(f) for f in self.store.hash_items(key))
                self.store.write_many([HashDelete(key, [str(f) for f in fields[:len(fields) - MAX_POINTS]])])
        except TinkerqError as exc:
            log.warning("run %s step %d: metrics not kept for the console (%s)", model_id, seq_id, exc.message)

    def points(self, model_id: str) -> list[dict[str, Any]]:
        """Every kept step of the run, by seq_id: {seq_id, op, t, metrics}."""
        found = []
        for field, value in self.store.hash_items(keys.gateway_run_metrics(model_id)).items():
            point = json.loads(value)
            point["seq_id"] = int(field)
            found.append(point)
        return sorted(found, key=lambda p: p["seq_id"])
