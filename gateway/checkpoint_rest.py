"""Tinker's checkpoint REST calls beyond the lookups: every checkpoint of a tenant (``list_user_checkpoints``),
publishing (``publish`` / ``unpublish_checkpoint_from_tinker_path``), expiry (``set_checkpoint_ttl_from_tinker_path``)
and copies (``copy_weights``). Each changes the owner's record (gateway/records.py), and the files where the
workers read them (gateway/checkpoint_files.py), and leaves an audit event (tinkerq/audit.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from tinkerq import keys
from tinkerq.audit import AuditLog
from tinkerq.errors import ValidationError
from tinkerq.gateway import checkpoint_files, publishing
from tinkerq.gateway.http_errors import HTTPError, not_found
from tinkerq.gateway.lookups import checkpoint_view
from tinkerq.gateway.records import PathError, Records, TinkerPath, checkpoint_record
from tinkerq.validation import validate_ttl_seconds


def parse(path: Any) -> TinkerPath:
    try:
        return TinkerPath.parse(path)
    except PathError as exc:
        raise HTTPError(400, str(exc)) from None


def owned(records: Records, tenant: str, run_id: str, checkpoint_id: str) -> tuple[TinkerPath, dict[str, Any]]:
    path = parse(f"tinker://{run_id}/{checkpoint_id}")
    record = records.get("checkpoint", str(path), tenant)
    if record is None:
        raise not_found("checkpoint", str(path))
    return path, record


def _ttl_left(record: dict[str, Any]) -> float | None:
    """The record's remaining time in Redis (it expires with the checkpoint), for a rewrite that keeps it."""
    expires_at = record.get("expires_at")
    return None if expires_at is None else max(0.001, float(expires_at) - time.time())


def list_user_checkpoints(records: Records, tenant: str, limit: int, offset: int) -> dict[str, Any]:
    """Every checkpoint of the caller's runs, newest first, one page (SDK 0.38's CheckpointsListResponse)."""
    found = sorted(records.scan("checkpoint", tenant), key=lambda c: (-float(c["time"]), c["tinker_path"]))
    return {"checkpoints": [checkpoint_view(c) for c in found[offset:offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}


def set_public(records: Records, audit: AuditLog, tenant: str, run_id: str, checkpoint_id: str,
               public: bool) -> None:
    """Publish (``public``) or unpublish the caller's checkpoint: 409 when it already is so (Tinker's answer)."""
    path, record = owned(records, tenant, run_id, checkpoint_id)
    if bool(record.get("public")) == public:
        raise HTTPError(409, f"checkpoint {path} is already {'public' if public else 'private'}")
    record["public"] = public
    records.put("checkpoint", str(path), record, ttl_s=_ttl_left(record))
    audit.record(tenant, "checkpoint_publish" if public else "checkpoint_unpublish", model_id=path.run,
                 tinker_path=str(path))


def set_ttl(records: Records, audit: AuditLog, checkpoint_dir: str, tenant: str, run_id: str, checkpoint_id: str,
            ttl_seconds: Any) -> None:
    """Expire the caller's checkpoint ``ttl_seconds`` from now (None: never). The directory's marker says so first
    (the workers' sweep deletes it then), and then the record (it leaves the listings then)."""
    path, record = owned(records, tenant, run_id, checkpoint_id)
    try:
        validate_ttl_seconds(ttl_seconds)
    except ValidationError as exc:
        raise HTTPError(400, exc.message) from None
    expires_at = None if ttl_seconds is None else time.time() + ttl_seconds
    checkpoint_files.set_expiry(checkpoint_dir, str(record["directory"]), expires_at)
    record["expires_at"] = expires_at
    records.put("checkpoint", str(path), record, ttl_s=ttl_seconds)
    audit.record(tenant, "checkpoint_ttl_set", model_id=path.run, tinker_path=str(path), ttl_seconds=ttl_seconds)


def copy(records: Records, audit: AuditLog, checkpoint_dir: str, tenant: str, body: dict[str, Any],
         idempotency_key: str | None) -> dict[str, Any]:
    """``copy_weights``: the source (the caller's, or a published one) copied into a new training run of the
    caller that cannot be trained on (no worker session), in a new session unless ``session_id`` and
    ``model_seq_id`` name one of the caller's. Answers SDK 0.38's CopyWeightsResponse."""
    source_path = parse(body.get("source_path"))
    source = publishing.readable(records, tenant, source_path)
    if source is None:
        raise not_found("checkpoint", str(source_path))
    ttl_seconds = body.get("ttl_seconds")
    try:
        validate_ttl_seconds(ttl_seconds)
    except ValidationError as exc:
        raise HTTPError(400, exc.message) from None
    session_id, seq = body.get("session_id"), body.get("model_seq_id")
    if session_id is None:
        if not body.get("destination_project_id"):
            raise HTTPError(400, "copy_weights needs destination_project_id, or session_id and model_seq_id")
        session_id, seq = str(uuid.uuid4()), 0
        records.put("session", session_id, {
            "tenant": tenant, "created": time.time(), "finished": True, "tags": [], "user_metadata": None,
            "display_name": f"copy of {source_path}", "project_id": body["destination_project_id"]})
    elif records.get("session", str(session_id), tenant) is None:
        raise not_found("session", session_id)
    elif isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise HTTPError(400, f"model_seq_id must be an integer >= 0, got {seq!r}")
    run_id = f"{session_id}:train:{seq}"
    path = TinkerPath(run_id, source_path.segment, source_path.name)
    claim = None if idempotency_key is None else f"copy:{tenant}:{idempotency_key}"
    prior = None if claim is None else records.claim(claim, str(path))
    if prior is not None:  # the SDK's retry of a copy already made
        return {"tinker_path": prior}
    if records.get("run", run_id, tenant) is not None:
        raise HTTPError(400, f"training run {run_id} exists already: pass another model_seq_id")
    expires_at = None if ttl_seconds is None else time.time() + ttl_seconds
    try:
        directory = checkpoint_files.copy(checkpoint_dir, str(source["directory"]), expires_at)
    except BaseException:
        if claim is not None:
            records.store.delete(keys.gateway_claim(claim))
        raise
    run = {"tenant": tenant, "model_id": run_id, "session_id": session_id, "base_model": source["base_model"],
           "lora": source.get("lora"), "optimizer": source.get("optimizer"), "created": time.time(),
           "user_metadata": None, "info": None, "offset": 0,
           "closed": True, "copied_from": str(source_path)}
    records.put("run", run_id, run)
    record = checkpoint_record(tenant, path, directory, run, ttl_seconds, source.get("user_metadata"))
    record["bytes"] = int(source.get("bytes") or 0)
    records.put("checkpoint", str(path), record, ttl_s=ttl_seconds)
    audit.record(tenant, "checkpoint_copy", model_id=run_id, tinker_path=str(path), source_path=str(source_path))
    if source["tenant"] != tenant:  # a published checkpoint: its owner sees who read it
        audit.record(source["tenant"], "checkpoint_read", actor=tenant, model_id=source_path.run,
                     tinker_path=str(source_path), purpose="copy_weights")
    return {"tinker_path": str(path)}

