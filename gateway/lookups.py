"""Tinker's REST lookups (training runs, their checkpoints, weights info), answered from the gateway's records.

Read-only views of :mod:`gateway.records`, shaped as SDK 0.38's pydantic models expect them.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from tinkerq.gateway.records import Records


class NotFound(LookupError):
    def __init__(self, what: str, ident: Any) -> None:
        super().__init__(what, ident)
        self.what, self.ident = what, ident


def training_run(records: Records, tenant: str, run_id: str) -> dict[str, Any]:
    record = records.get("run", run_id, tenant)
    if record is None:
        raise NotFound("training run", run_id)
    return training_run_view(records, record)


def training_runs(records: Records, tenant: str, limit: int, offset: int,
                  project_id: str | None = None) -> dict[str, Any]:
    found = sorted(records.scan("run", tenant), key=lambda r: r["created"], reverse=True)
    if project_id is not None:  # a run is in its session's project (assign_session_project moves both)
        projects = {ident: s.get("project_id") for ident, s in records.scan_items("session", tenant)}
        found = [r for r in found if projects.get(str(r.get("session_id"))) == project_id]
    page = found[offset:offset + limit]
    return {"training_runs": [training_run_view(records, r) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}


def training_run_view(records: Records, record: dict[str, Any]) -> dict[str, Any]:
    lora = record.get("lora")
    checkpoints = records.scan("checkpoint", record["tenant"], f"tinker://{record['model_id']}/")
    last = {kind: max((c for c in checkpoints if c["checkpoint_type"] == kind), key=lambda c: c["time"],
                      default=None) for kind in ("training", "sampler")}
    last_request = records.last_request(record["model_id"]) or record["created"]
    return {
        "training_run_id": record["model_id"], "base_model": record["base_model"], "model_owner": record["tenant"],
        "is_lora": lora is not None, "lora_rank": None if lora is None else lora["rank"], "corrupted": False,
        "last_request_time": iso(last_request), "user_metadata": str_map(record.get("user_metadata")),
        "last_checkpoint": None if last["training"] is None else checkpoint_view(last["training"]),
        "last_sampler_checkpoint": None if last["sampler"] is None else checkpoint_view(last["sampler"]),
    }


def list_checkpoints(records: Records, tenant: str, run_id: str) -> dict[str, Any]:
    training_run(records, tenant, run_id)
    found = sorted(records.scan("checkpoint", tenant, f"tinker://{run_id}/"), key=lambda c: c["time"])
    return {"checkpoints": [checkpoint_view(c) for c in found]}


def weights_info(record: dict[str, Any]) -> dict[str, Any]:
    lora = record.get("lora")
    info: dict[str, Any] = {"base_model": record["base_model"], "is_lora": lora is not None,
                            "optimizer_config": record.get("optimizer") or {"type": "adamw"}}
    if lora is not None:
        info.update({"lora_rank": lora["rank"], "train_unembed": lora.get("train_unembed"),
                     "train_mlp": lora.get("train_mlp"), "train_attn": lora.get("train_attn")})
    return info


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


def str_map(value: Any) -> dict[str, str] | None:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else None


def checkpoint_view(record: dict[str, Any]) -> dict[str, Any]:
    return {
        "checkpoint_id": record["checkpoint_id"], "checkpoint_type": record["checkpoint_type"],
        "time": iso(record["time"]), "tinker_path": record["tinker_path"],
        "public": bool(record.get("public")), "size_bytes": record.get("bytes"),
        "user_metadata": str_map(record.get("user_metadata")),
        "expires_at": None if record.get("expires_at") is None else iso(record["expires_at"]),
    }
