"""Every Redis key and queue name tinkerq uses, in one place (so operators can find them)."""

from __future__ import annotations

import hashlib
import re

PREFIX = "tinkerq"


def model_key(base_model: str) -> str:
    """A short stable name for a served model: readable tail + hash of the full name."""
    tail = re.sub(r"[^A-Za-z0-9_.-]+", "-", base_model.rstrip("/").rsplit("/", 1)[-1])[:40] or "model"
    digest = hashlib.sha1(base_model.encode()).hexdigest()[:10]
    return f"{tail}-{digest}"


def model_queue(base_model: str) -> str:
    """Queue a worker serving ``base_model`` listens on for new training sessions."""
    return f"{PREFIX}.model.{model_key(base_model)}"


def worker_queue(worker_id: str) -> str:
    """A worker's own queue: every request of a session goes to the worker that holds it."""
    return f"{PREFIX}.worker.{worker_id}"


def blob(blob_id: str) -> str:
    """A claim-checked payload (raw bytes, with a TTL)."""
    return f"{PREFIX}:blob:{blob_id}"


def serving(base_model: str, worker_id: str) -> str:
    """A worker's heartbeat registration for the model it serves (JSON, with a TTL)."""
    return f"{PREFIX}:serving:{model_key(base_model)}:{worker_id}"


def serving_pattern(base_model: str | None = None) -> str:
    return f"{PREFIX}:serving:{model_key(base_model) if base_model else '*'}:*"
