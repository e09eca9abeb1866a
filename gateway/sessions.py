"""Tinker's session REST calls (``RestClient.get_session``, ``list_sessions``, ``search_sessions``,
``assign_session_project``), answered from the gateway's records, for the caller's own sessions only.

A session's record (gateway/records.py, written by ``create_session``) holds its tags, user_metadata,
display_name and project_id; its training runs and samplers are the records whose ids start with
``<session id>:`` (``<session>:train:<n>``, ``<session>:sample:<n>`` and ``<run>:sample:<seq_id>``). Another
tenant's session answers 404, as a missing one (the records' ``get`` sees only the caller's).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from tinkerq.gateway.lookups import NotFound, iso, str_map
from tinkerq.gateway.records import Records

# A session with no project assigned is in this one (Tinker's SessionSummary.project_id is never empty).
DEFAULT_PROJECT = "default"


def owned(records: Records, tenant: str, session_id: str) -> dict[str, Any]:
    record = records.get("session", session_id, tenant)
    if record is None:
        raise NotFound("session", session_id)
    return record


def get_session(records: Records, tenant: str, session_id: str) -> dict[str, Any]:
    """SDK 0.38's GetSessionResponse."""
    record = owned(records, tenant, session_id)
    runs = records.scan("run", tenant, f"{session_id}:train:")
    samplers = records.scan("sampler", tenant, f"{session_id}:")
    return {"training_run_ids": [r["model_id"] for r in sorted(runs, key=lambda r: r["created"])],
            "sampler_ids": sorted(s["sampler_id"] for s in samplers),
            "user_metadata": str_map(record.get("user_metadata")), "display_name": record.get("display_name")}


def _order(ident: str, record: dict[str, Any]) -> tuple[float, str]:
    # Newest first, ties broken by id: a total order. The time is read back from its ISO form (microseconds), as
    # a cursor carries it, so that a cursor compares equal to the session it names.
    return -datetime.fromisoformat(iso(float(record["created"]))).timestamp(), ident


def _newest_first(records: Records, tenant: str) -> list[tuple[str, dict[str, Any]]]:
    return sorted(records.scan_items("session", tenant), key=lambda item: _order(*item))


def list_sessions(records: Records, tenant: str, limit: int, offset: int) -> dict[str, Any]:
    """SDK 0.38's ListSessionsResponse: the caller's session ids, newest first, one page."""
    found = _newest_first(records, tenant)
    return {"sessions": [ident for ident, _ in found[offset:offset + limit]]}


def assign_project(records: Records, tenant: str, session_id: str, project_id: Any) -> None:
    """Move the session into ``project_id`` (Tinker has no way out of a project: None is refused)."""
    if not isinstance(project_id, str) or not project_id:
        raise ValueError("project_id is required: the project to move the session into (a session cannot be "
                         "moved out of a project)")
    if records.update("session", session_id, tenant, lambda record: record.update(project_id=project_id)) is None:
        raise NotFound("session", session_id)


def status(record: dict[str, Any]) -> dict[str, Any]:
    """Tinker's SessionStatus: a finished session's client said it was done; any other is active."""
    if record.get("finished"):  # an older client's finish said no reason: success
        return {"type": "client_finished", "reason": {"type": record.get("finish_reason") or "success"},
                "detail": record.get("finish_detail")}
    return {"type": "active"}


def _matches(ident: str, record: dict[str, Any], query: dict[str, Any]) -> bool:
    by_id, name = query.get("session_id"), query.get("display_name")
    if by_id is not None or name is not None:  # with both, either one matching is enough (Tinker's rule)
        display = str(record.get("display_name") or "").lower()
        named = name is not None and all(word in display for word in str(name).lower().split())
        if ident != by_id and not named:
            return False
    projects = query.get("project_ids")
    if projects is not None and (record.get("project_id") or DEFAULT_PROJECT) not in projects:
        return False
    metadata = str_map(record.get("user_metadata")) or {}
    if any(metadata.get(k) != v for k, v in (query.get("user_metadata") or {}).items()):
        return False
    statuses = query.get("statuses")
    if statuses is not None:
        mine = status(record)
        if not any(s.get("type") == mine["type"] and (mine["type"] != "client_finished" or s.get("reasons") is None
                                                       or mine["reason"]["type"] in s["reasons"])
                   for s in statuses):
            return False
    return True


def search_sessions(records: Records, tenant: str, query: dict[str, Any]) -> dict[str, Any]:
    """SDK 0.38's SessionSearchResponse: one page of the caller's sessions matching ``query`` (a
    SessionSearchRequest), newest first; ``next_cursor`` names the last one when more may follow.

    Every owner filter sees the caller's own sessions only: a tenant is its own organization here, so
    ``accessible`` is the caller's sessions, and ``user`` matches when it names the caller."""
    limit = query.get("limit", 50)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 200:
        raise ValueError(f"limit must be an integer from 1 to 200, got {limit!r}")
    owner = query.get("owner") or {"type": "own"}
    if owner.get("type") == "user" and tenant not in owner.get("owner_urns", ()) \
            and f"tml:user:{tenant}" not in owner.get("owner_urns", ()):
        return {"sessions": [], "next_cursor": None}
    found = [(ident, r) for ident, r in _newest_first(records, tenant) if _matches(ident, r, query)]
    cursor = query.get("cursor")
    if cursor is not None:
        after = (-datetime.fromisoformat(str(cursor["last_created_at"])).timestamp(), str(cursor["last_session_id"]))
        found = [(ident, r) for ident, r in found if _order(ident, r) > after]
    page = found[:limit]
    checkpoints = records.scan("checkpoint", tenant)
    summaries = []
    for ident, record in page:
        mine = [c for c in checkpoints if str(c["run"]).startswith(f"{ident}:")]
        summaries.append({
            "session_id": ident, "created_at": iso(float(record["created"])), "owner": tenant,
            "project_id": record.get("project_id") or DEFAULT_PROJECT, "status": status(record),
            "checkpoints_count": len(mine), "display_name": record.get("display_name"),
            "user_metadata": str_map(record.get("user_metadata")),
            "checkpoint_storage_bytes": sum(int(c.get("bytes") or 0) for c in mine),
        })
    more = len(found) > limit
    next_cursor = {"last_created_at": iso(float(page[-1][1]["created"])), "last_session_id": page[-1][0]} \
        if more and page else None
    return {"sessions": summaries, "next_cursor": next_cursor}
