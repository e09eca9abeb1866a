"""Each tenant's audit log: who did what to its keys, checkpoints and sessions, for ``AdminClient.get_audit_log``.

One Redis list per tenant (:func:`tinkerq.keys.audit_log`), newest first, at most ``MAX_EVENTS`` long, written by
``tinkerq keys`` (key events) and the gateway (checkpoint, publish, project events) and read by the gateway's
``GET /api/v1/audit`` for that tenant only. Events are named as Tinker names them, ``<resource>_<action>``:

* ``api_key_create``, ``api_key_revoke``                          (event_type "organizations": keys are the org's)
* ``checkpoint_create``, ``checkpoint_delete``, ``checkpoint_publish``, ``checkpoint_unpublish``,
  ``checkpoint_ttl_set``, ``checkpoint_copy``, ``checkpoint_read``   (event_type "checkpoints")
* ``session_project_set``                                            (event_type "projects")

Writing is best effort: an audit write that fails is logged, and the action it records still happens (the
action is what the user asked for; the log must not turn a working call into a failed one).
"""

from __future__ import annotations

import json
import logging
import time
from datetime import date, datetime, timezone
from typing import Any

from tinkerq import keys
from tinkerq.errors import TinkerqError
from tinkerq.store import KeyValueStore

log = logging.getLogger("tinkerq.audit")

MAX_EVENTS = 10_000  # per tenant; older events fall off
EVENT_TYPES = {"all": "", "checkpoints": "checkpoint_", "projects": "session_project_", "organizations": "api_key_",
               "teams": "team_"}


class AuditLog:
    def __init__(self, store: KeyValueStore) -> None:
        self.store = store.with_retry(0)

    def record(self, tenant: str, event: str, *, actor: str | None = None, **details: Any) -> None:
        """Append ``event`` with ``details`` (JSON values) to ``tenant``'s log, best effort. ``actor``: who did it
        (default the tenant itself; another tenant reading a published checkpoint of this one)."""
        entry = {"timestamp": time.time(), "event": event, "event_details": {"actor": actor or tenant, **details}}
        try:
            self.store.push(keys.audit_log(tenant), json.dumps(entry, separators=(",", ":")).encode(),
                            max_len=MAX_EVENTS)
        except TinkerqError as exc:
            log.warning("audit event %s of %s not recorded: %s", event, tenant, exc.message)

    def entries(self, tenant: str, event_type: str = "all", day: date | None = None) -> list[dict[str, Any]]:
        """``tenant``'s events of ``event_type`` (one of EVENT_TYPES), on UTC ``day`` if given, oldest first, as
        SDK 0.38's ``AuditLogEntry`` reads them."""
        prefix = EVENT_TYPES[event_type]
        found = []
        for raw in reversed(self.store.list_range(keys.audit_log(tenant), 0, -1)):
            entry = json.loads(raw)
            when = datetime.fromtimestamp(float(entry["timestamp"]), tz=timezone.utc)
            if not str(entry["event"]).startswith(prefix) or (day is not None and when.date() != day):
                continue
            details = entry.get("event_details") or {}
            view = {"timestamp": when.isoformat(), "event": entry["event"], "event_details": details}
            if str(entry["event"]).startswith("checkpoint_"):  # the SDK's deprecated top-level copies
                view.update(model_id=details.get("model_id"), tinker_path=details.get("tinker_path"),
                            purpose=details.get("purpose"))
            found.append(view)
        return found
