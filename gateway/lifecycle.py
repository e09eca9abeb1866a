"""Ending a tenant's training runs from their records: one close path for unload, finish_session, stale
clients and ``tinkerq keys revoke`` (which runs outside any gateway).

A run's worker session is closed with a ``close_model`` posted after the highest sequence id any gateway took
for it (gateway/records.py ``top``), so it comes after every request of the run, never as a repeat of one.
"""

from __future__ import annotations

import logging
from typing import Any

from tinkerq import types
from tinkerq.errors import TinkerqError
from tinkerq.gateway.records import Records
from tinkerq.producer import ServiceClient, TrainingClient
from tinkerq.quotas import Quotas

log = logging.getLogger("tinkerq.gateway")

CLOSE_TIMEOUT_S = 30.0


def close_run(service: ServiceClient, records: Records, quotas: Quotas, record: dict[str, Any],
              client: TrainingClient | None = None) -> None:
    """Close the run's worker session (if it still has one), mark the run closed, free the key's client slot."""
    model_id = str(record["model_id"])
    if not record.get("closed") and isinstance(record.get("info"), dict):
        client = client or service.attach_training_client(types.ModelInfo(**record["info"]))
        last = records.top(model_id) + int(record.get("offset") or 0)
        try:
            client.submit("close_model", {}, seq_id=last + 1).result(timeout=CLOSE_TIMEOUT_S)
        except TinkerqError as exc:  # the worker may be gone already: nothing left to free
            log.info("closing %s: %s", model_id, exc.message)
    record["closed"] = True
    records.put("run", model_id, record)
    records.forget_run(model_id)
    quotas.close_training_client(str(record["tenant"]), model_id)


def end_tenant(service: ServiceClient, records: Records, quotas: Quotas, tenant: str) -> tuple[int, int]:
    """Finish every session of ``tenant`` and close its open training runs: (sessions, runs) ended."""
    runs = [r for r in records.scan("run", tenant) if not r.get("closed")]
    for record in runs:
        close_run(service, records, quotas, record)
    sessions = [(ident, s) for ident, s in records.scan_items("session", tenant) if not s.get("finished")]
    for session_id, record in sessions:
        records.put("session", session_id, {**record, "finished": True})
    for model_id in quotas.training_clients(tenant):  # a create that never finished: its slot goes too
        quotas.close_training_client(tenant, model_id)
    return len(sessions), len(runs)

