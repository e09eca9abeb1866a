"""The Celery tasks: one per operation, each a thin shell around :class:`worker.service.WorkerService`.

Every message reaching a task has passed :mod:`tinkerq.worker.intake`. The task answers through the service (the
reply goes to the request's reply key and the sender's inbox, retried through Redis outages) before it
returns, so Celery acknowledges a message only once its answer is stored; Celery stores no result.

What a task returns is only what Flower shows as its result (Celery puts ``saferepr`` of it in the
task-succeeded event; no result backend, and nothing else reads it): a one-line summary of the reply, metrics
and array shapes, never the tensors themselves. Likewise remote control (`celery inspect active`, `tinkerq
fleet status`) describes a running request by its summary, never by its body (:class:`SummarisedRequest`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from celery import Celery
from celery.exceptions import Ignore
from celery.worker.request import Request

from tinkerq.celery_app import OPS, TASK_NAMES
from tinkerq.wire import codec
from tinkerq.wire.messages import REPLY_HEADER
from tinkerq.worker.service import WorkerService

SUMMARY_CHARS = 300  # Flower's result column; Celery cuts the repr at 1024 characters anyway
_METRICS_SHOWN = 8


def register_tasks(app: Celery, service: WorkerService) -> None:
    for op in OPS:
        _register(app, service, op)


def _register(app: Celery, service: WorkerService, op: str) -> None:
    def run(task: Any, envelope: Any) -> str:
        request = task.request
        inbox = getattr(request, REPLY_HEADER, None)
        reply = service.handle(op, envelope, task_id=request.id, inbox=inbox if isinstance(inbox, str) else None)
        if reply is None:
            # Buffered until its predecessors arrive; it is answered when it runs.
            raise Ignore()
        service.answer(request.id, inbox, reply)
        return reply_summary(reply)

    run.__name__ = op
    run.__qualname__ = op
    app.task(name=TASK_NAMES[op], bind=True, acks_late=True, ignore_result=True, Request=SummarisedRequest)(run)


class SummarisedRequest(Request):
    """Celery's request, shown to remote control (inspect active, reserved, query_task) by its summary.

    Celery would send the arguments themselves unless the caller asks for ``safe``: the envelope, whose body is
    the request's msgpack bytes (up to the claim-check threshold, base64 in the stock CLI's JSON)."""

    def info(self, safe: bool = False) -> dict[str, Any]:
        return dict(super().info(safe=True))


def reply_summary(reply: dict[str, Any]) -> str:
    """A reply in one short line, e.g. ``ok loss:sum=3.2 datums=4 logprobs (4, 17)`` or ``user error: ...``."""
    if not reply.get("ok"):
        error = reply.get("error") or {}
        return (f"{error.get('category')} error: {error.get('type')}: {error.get('message')}")[:SUMMARY_CHARS]
    ref = reply.get("payload")
    if isinstance(ref, dict) and isinstance(ref.get("inline"), bytes):
        try:
            described = describe(codec.unpackb(ref["inline"]))
        except Exception:  # a summary must never fail the request it describes (the answer is already stored)
            described = f"{len(ref['inline'])}-byte result"
        return f"ok {described}".strip()[:SUMMARY_CHARS]
    if isinstance(ref, dict) and "blob" in ref:  # not fetched back from Redis just to describe it
        return f"ok {ref.get('size')}-byte result (claim check)"
    return "ok"


def describe(value: Any) -> str:
    """Metrics as ``name=value``, arrays by shape, lists by length: what a result is, never its tensors."""
    if not isinstance(value, dict):
        return _brief(value)
    parts = []
    metrics = value.get("metrics")
    if isinstance(metrics, dict):
        parts += [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={_brief(v)}"
                  for k, v in list(metrics.items())[:_METRICS_SHOWN]]
    for key, item in value.items():
        if key in ("metrics", "loss_fn_output_type"):  # metrics come first; the output type says little
            continue
        if key in ("outputs", "sequences") and isinstance(item, list):
            parts.append(_describe_rows("datums" if key == "outputs" else key, item))
        else:
            parts.append(f"{key}={_brief(item)}")
    return " ".join(parts)


def _describe_rows(name: str, rows: list[Any]) -> str:
    """``datums=4 logprobs (4, 17)``: per-datum arrays by their stacked shape; ``(4, 12..17)`` when ragged."""
    parts = [f"{name}={len(rows)}"]
    first = rows[0] if rows and isinstance(rows[0], dict) else {}
    for key, item in first.items():
        if not isinstance(item, np.ndarray):
            continue
        shapes = [r[key].shape for r in rows if isinstance(r, dict) and isinstance(r.get(key), np.ndarray)]
        if len(set(shapes)) == 1:
            parts.append(f"{key} {(len(shapes), *shapes[0])}")
        elif all(len(s) == 1 for s in shapes):  # one value per token, datums of different lengths
            parts.append(f"{key} ({len(shapes)}, {min(shapes)[0]}..{max(shapes)[0]})")
        else:
            sizes = [int(np.prod(s)) for s in shapes]
            parts.append(f"{key} {len(shapes)} arrays of {min(sizes)}..{max(sizes)} values")
    return " ".join(parts)


def _brief(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{value.shape}"
    if isinstance(value, (list, tuple)):
        return f"[{len(value)} items]"
    if isinstance(value, dict):
        return f"{{{len(value)} keys}}"
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return str(value)[:80]
