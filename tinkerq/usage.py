"""Usage accounting per tenant (API key) and session, in hourly buckets, shared by every gateway through Redis.

The gateway calls :meth:`Usage.record` once a request is answered, with what it used (:data:`COUNTERS`, and
request counts per kind: :func:`request_counter`). Counts are added to the tenant's bucket of that UTC hour
(key names in :mod:`tinkerq.keys`): a hash per tenant and hour, field ``<session id>|<counter>``, kept
``keep_days``; an index of the tenant's hours and one of the tenants make :meth:`Usage.rows` a few reads, not a
SCAN. With ``once`` (the request id) the increments and a marker are one store transaction, so a request whose
answer two gateways both see is counted once.

``prefill_tokens`` are prompt tokens prefilled at full cost; ``cached_prefill_tokens`` those served from a
prefix cache (Tinker bills them apart). Each applied record also increments this process's Prometheus counters
(``tinkerq_tenant_tokens_total{tenant,kind}`` ...; on prometheus_client's default registry), when
prometheus-client is installed.

:func:`billing_usage_view` turns rows into the body of the Tinker API's ``GET /api/v1/billing/usage/events``
(the SDK's ``AdminClient.get_billing_usage``; model ``tinker.types.BillingUsageResponse``).
"""

from __future__ import annotations

import datetime
import re
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from tinkerq import keys
from tinkerq.errors import ValidationError
from tinkerq.store import Expire, HashIncr, HashPut, Put, Transaction, ZAdd, ZRemoveBelow
from tinkerq.tenants import check_tenant_name

if TYPE_CHECKING:
    from tinkerq.store import KeyValueStore

COUNTERS = ("training_tokens", "prefill_tokens", "cached_prefill_tokens", "sampled_tokens", "checkpoints",
            "checkpoint_bytes")
REQUEST_PREFIX = "requests_"  # requests_<kind>: e.g. requests_forward_backward, requests_sample
HOUR_S = 3600
DEFAULT_KEEP_DAYS = 90
# A request's once-marker outlives any second answer to it: replies are kept result_ttl_s (1 h by default) and
# the SDK gives up polling long before a day. About 100 bytes of Redis per request recorded with ``once``.
DEFAULT_ONCE_TTL_S = 24 * 3600.0
MAX_ID_CHARS = 256
# How long a process trusts what it last saw the tenants' index hold for a tenant (a Redis that lost the index
# has it back within this).
INDEX_KNOWN_S = 60.0
BILLING_MAX_WINDOW_S = 14 * 24 * HOUR_S  # the Tinker API's limit on ending_before - starting_on

_COUNTER_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")


class UsageRow(NamedTuple):
    tenant: str
    session_id: str  # "" for usage outside any session
    hour: int  # the UTC hour's start, epoch seconds
    counts: dict[str, int]


def hour_of(at: float) -> int:
    """The start of the UTC hour ``at`` falls in (epoch seconds)."""
    return int(at // HOUR_S) * HOUR_S


def request_counter(kind: str) -> str:
    """The counter of requests of ``kind`` (``forward_backward``, ``sample``, ...): ``requests_<kind>``."""
    name = REQUEST_PREFIX + kind
    if not _COUNTER_RE.fullmatch(name):
        raise ValidationError(f"request kind {kind!r:.40} is not a valid counter name: use a-z, 0-9 and '_'")
    return name


# -- Prometheus -----------------------------------------------------------------------------------------------

_TOKEN_KINDS = {"training_tokens": "training", "prefill_tokens": "prefill",
                "cached_prefill_tokens": "cached_prefill", "sampled_tokens": "sampled"}


def _counter(name: str, documentation: str, labels: list[str]) -> Any:
    try:
        from prometheus_client import Counter
    except ImportError:  # optional for the core: without it there is just nothing to export
        return None
    return Counter(name, documentation, labels)


TOKENS = _counter("tinkerq_tenant_tokens", "Tokens used per API key (tenant), by kind: training, prefill, "
                  "cached_prefill, sampled", ["tenant", "kind"])
CHECKPOINTS = _counter("tinkerq_tenant_checkpoints", "Checkpoints saved per API key (tenant)", ["tenant"])
CHECKPOINT_BYTES = _counter("tinkerq_tenant_checkpoint_bytes", "Bytes of checkpoints saved per API key (tenant)",
                            ["tenant"])
REQUESTS = _counter("tinkerq_tenant_requests", "Requests answered per API key (tenant), by kind",
                    ["tenant", "kind"])


def _export(tenant: str, increments: Mapping[str, int]) -> None:
    if TOKENS is None:
        return
    for name, value in increments.items():
        if name in _TOKEN_KINDS:
            TOKENS.labels(tenant=tenant, kind=_TOKEN_KINDS[name]).inc(value)
        elif name == "checkpoints":
            CHECKPOINTS.labels(tenant=tenant).inc(value)
        elif name == "checkpoint_bytes":
            CHECKPOINT_BYTES.labels(tenant=tenant).inc(value)
        elif name.startswith(REQUEST_PREFIX):
            REQUESTS.labels(tenant=tenant, kind=name[len(REQUEST_PREFIX):]).inc(value)


# -- the store ------------------------------------------------------------------------------------------------

def _check_id(what: str, value: object, *, empty_ok: bool) -> str:
    if not isinstance(value, str) or len(value) > MAX_ID_CHARS or (not value and not empty_ok):
        raise ValidationError(f"{what} must be a string of {0 if empty_ok else 1}-{MAX_ID_CHARS} characters, "
                              f"got {value!r:.60}")
    return value


def _increments(counts: Mapping[str, int]) -> dict[str, int]:
    found = {}
    for name, value in counts.items():
        if not isinstance(name, str) or not _COUNTER_RE.fullmatch(name):
            raise ValidationError(f"usage counter {name!r:.40} is not valid: use a-z, 0-9 and '_' "
                                  f"(the usual ones: {', '.join(COUNTERS)}, requests_<kind>)")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValidationError(f"usage counter {name} must be a whole number >= 0, got {value!r:.40}")
        if value:
            found[name] = value
    return found


class Usage:
    """Hourly usage per tenant and session in the fleet's store; kept ``keep_days`` (then Redis drops it)."""

    def __init__(self, store: KeyValueStore, *, keep_days: int = DEFAULT_KEEP_DAYS,
                 once_ttl_s: float = DEFAULT_ONCE_TTL_S) -> None:
        if isinstance(keep_days, bool) or not isinstance(keep_days, int) or keep_days < 1:
            raise ValidationError(f"keep_days must be a whole number of days >= 1, got {keep_days!r}")
        if not once_ttl_s > 0:
            raise ValidationError(f"once_ttl_s must be > 0 seconds, got {once_ttl_s!r}")
        self.store = store
        self.keep_days = keep_days
        self.once_ttl_s = once_ttl_s
        # tenant -> (an hour the tenants' index is known to hold for it, monotonic time known): a record within
        # INDEX_KNOWN_S of that skips reading the index (one round trip of every answered request's accounting).
        self._indexed: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()

    @property
    def keep_s(self) -> int:
        return self.keep_days * 24 * HOUR_S

    def record(self, tenant: str, session_id: str, counts: Mapping[str, int], *, once: str | None = None,
               at: float | None = None) -> bool:
        """Add ``counts`` to ``tenant``'s bucket of the hour of ``at`` (default: now), under ``session_id`` ("" for
        none). With ``once`` (a request id), applied at most once per id, atomically with the marker (for
        ``once_ttl_s``, longer than any second answer can come); False when skipped for that reason."""
        check_tenant_name(tenant)
        _check_id("session_id", session_id, empty_ok=True)
        if once is not None:
            _check_id("once", once, empty_ok=False)
        increments = _increments(counts)
        if not increments and once is None:
            return True
        now = time.time()
        hour = hour_of(now if at is None else at)
        ttl_s = max(60.0, hour + HOUR_S + self.keep_s - now)  # a bucket lives keep_days past its hour's end
        hour_key, hours_key = keys.usage_hour(tenant, hour), keys.usage_hours(tenant)
        oldest = hour_of(now - self.keep_s)
        once_key = None if once is None else keys.usage_once(once)
        with self._lock:
            known = self._indexed.get(tenant)
        indexed = known is not None and known[0] >= hour and time.monotonic() - known[1] < INDEX_KNOWN_S

        def add(t: Transaction) -> bool:
            # Counters added to the hour's hash, that hour noted in the tenant's index, the tenant in the index of
            # tenants, all at once and, with ``once``, only if its marker was not set yet.
            if once_key is not None:
                if t.exists(once_key):
                    return False
                t.write(Put(once_key, b"1", self.once_ttl_s))
            t.write(*(HashIncr(hour_key, f"{session_id}|{name}", value) for name, value in increments.items()),
                    Expire(hour_key, ttl_s), ZAdd(hours_key, str(hour), hour), ZRemoveBelow(hours_key, oldest),
                    Expire(hours_key, ttl_s))
            # The tenants' index keeps each tenant's latest hour: watched only when this raises it (once an hour).
            if not indexed and hour > _int(t.hash_get(keys.USAGE_TENANTS, [tenant])[0]):
                t.watch(keys.USAGE_TENANTS)
                if hour > _int(t.hash_get(keys.USAGE_TENANTS, [tenant])[0]):
                    t.write(HashPut(keys.USAGE_TENANTS, {tenant: str(hour)}))
            return True

        applied = self.store.transaction(add, [] if once_key is None else [once_key],
                                         what=f"recording the usage of {tenant}")
        if applied:
            _export(tenant, increments)
            if not indexed:  # the index holds this hour for the tenant now (it was there, or this wrote it)
                with self._lock:
                    if len(self._indexed) > 10_000:
                        self._indexed.clear()
                    self._indexed[tenant] = (hour, time.monotonic())
        return applied

    def rows(self, tenant: str | None = None, since: float | None = None) -> list[UsageRow]:
        """Every (tenant, session, hour) with usage, sorted by tenant, hour, session; only ``tenant``'s if given,
        only hours that end after ``since`` (epoch seconds) if given."""
        first = -float("inf") if since is None else float(hour_of(since))
        latest = {name: int(value) for name, value in self.store.hash_items(keys.USAGE_TENANTS).items()}
        tenants = sorted(t for t, last in latest.items() if last >= first and (tenant is None or t == tenant))
        buckets = [(t, int(h)) for t in tenants for h, _ in self.store.zset_range(keys.usage_hours(t), first,
                                                                                    float("inf"))]
        found = []
        for (name, hour), fields in zip(buckets, self.store.hash_items_many(
                [keys.usage_hour(t, h) for t, h in buckets]), strict=True):
            sessions: dict[str, dict[str, int]] = {}
            for field, value in fields.items():
                session_id, _, counter = field.rpartition("|")
                sessions.setdefault(session_id, {})[counter] = int(value)
            found += [UsageRow(name, session_id, hour, counts) for session_id, counts in sessions.items()]
        return sorted(found, key=lambda row: (row.tenant, row.hour, row.session_id))

    def totals(self, tenant: str | None = None, since: float | None = None) -> dict[str, int]:
        """The sums of :meth:`rows` (every one of COUNTERS, 0 when unused, and any other counter seen)."""
        return sum_counts(row.counts for row in self.rows(tenant, since))


def sum_counts(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """The sum of several counts: every one of COUNTERS (0 when absent) and any other counter seen."""
    total = dict.fromkeys(COUNTERS, 0)
    for one in counts:
        for name, value in one.items():
            total[name] = total.get(name, 0) + value
    return total


# -- times ----------------------------------------------------------------------------------------------------

_AGO_RE = re.compile(r"(\d+)\s*([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": HOUR_S, "d": 24 * HOUR_S, "w": 7 * 24 * HOUR_S}


def parse_time(text: str) -> float | None:
    """An ISO-8601 date or time (``2026-07-13``, ``2026-07-13T05:00``, ``...Z``, ``...+02:00``; UTC unless it
    says otherwise) as epoch seconds; None if it is not one."""
    text = text.strip()
    if text[-1:] in ("Z", "z"):
        text = text[:-1] + "+00:00"  # Python 3.10's fromisoformat does not take 'Z'
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def parse_since(text: str, *, now: float | None = None) -> float:
    """``--since``: a duration back from now (``90m``, ``24h``, ``7d``, ``2w``) or an ISO-8601 date or time."""
    ago = _AGO_RE.fullmatch(text.strip().lower())
    if ago:
        return (time.time() if now is None else now) - int(ago.group(1)) * _UNIT_S[ago.group(2)]
    when = parse_time(text) if text.strip() else None
    if when is None:
        raise ValidationError(f"--since {text!r:.40} is not a time: use a duration back from now (90m, 24h, 7d, 2w) "
                              f"or an ISO-8601 date or time (2026-07-13, 2026-07-13T05:00Z; UTC unless it says "
                              f"otherwise)")
    return when


def iso_time(epoch: float) -> str:
    """``2026-07-13T05:00:00Z``: how the Tinker API writes a UTC time."""
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- the Tinker API's billing views -----------------------------------------------------------------------------

def billing_window(starting_on: str, ending_before: str, *, now: float | None = None) -> tuple[int, int]:
    """The query of ``GET /api/v1/billing/usage/events`` (the SDK's ``GetBillingUsageRequest``), checked as the
    Tinker API documents it: RFC 3339 times on UTC hour boundaries, ``starting_on`` not in the future,
    ``ending_before`` after it and at most 14 days after it. Epoch seconds; ValidationError otherwise."""
    bounds = []
    for name, text in (("starting_on", starting_on), ("ending_before", ending_before)):
        when = parse_time(text) if isinstance(text, str) and text.strip() else None
        if when is None:
            raise ValidationError(f"{name} {text!r:.40} is not an RFC 3339 time: use e.g. 2026-07-13T05:00:00Z")
        if when % HOUR_S:
            raise ValidationError(f"{name} {text!r:.40} is not on a UTC hour boundary: use e.g. "
                                  f"{iso_time(hour_of(when))}")
        bounds.append(int(when))
    start, end = bounds
    if start > (time.time() if now is None else now):
        raise ValidationError(f"starting_on {starting_on!r:.40} is in the future")
    if end <= start:
        raise ValidationError(f"ending_before {ending_before!r:.40} must be after starting_on {starting_on!r:.40}")
    if end - start > BILLING_MAX_WINDOW_S:
        raise ValidationError("ending_before must be at most 14 days after starting_on: ask for several windows")
    return start, end


def _event_infos(counts: Mapping[str, int]) -> list[dict[str, Any]]:
    infos: list[dict[str, Any]] = []
    if counts.get("training_tokens"):
        infos.append({"type": "training", "token_count": counts["training_tokens"]})
    if counts.get("prefill_tokens"):
        infos.append({"type": "sampling_prefill", "cached": False, "token_count": counts["prefill_tokens"]})
    if counts.get("cached_prefill_tokens"):
        infos.append({"type": "sampling_prefill", "cached": True, "token_count": counts["cached_prefill_tokens"]})
    if counts.get("sampled_tokens"):
        infos.append({"type": "sampling_sample", "token_count": counts["sampled_tokens"]})
    if counts.get("checkpoints"):
        infos.append({"type": "checkpoint", "count": counts["checkpoints"]})
    return infos


def billing_usage_view(rows: Iterable[UsageRow], *, starting_on: float, ending_before: float,
                       session_metadata: Mapping[str, Mapping[str, str] | None] | None = None) -> dict[str, Any]:
    """The JSON body of ``GET /api/v1/billing/usage/events`` (``tinker.types.BillingUsageResponse``) for
    ``rows`` (one tenant's, normally) in hours ``starting_on`` <= hour < ``ending_before``.

    One event per hour, session and kind (training, sampling_prefill cached or not, sampling_sample,
    checkpoint), ordered by bucket then descending token count, as the API does. ``user_id`` and ``user_name``
    are the tenant (the API key's name); ``session_metadata`` (session id -> its user_metadata) fills
    ``sessions``. Not known here, so null: base_model, project_id, every cost and rate, cost_data_through.
    Storage (GB-hours) is not measured: no storage events.
    """
    metadata = session_metadata or {}
    events: list[dict[str, Any]] = []
    for row in rows:
        if not starting_on <= row.hour < ending_before:
            continue
        for info in _event_infos(row.counts):
            events.append({
                "bucket_start": iso_time(row.hour), "bucket_end": iso_time(row.hour + HOUR_S),
                "base_model": None, "user_id": row.tenant, "user_name": row.tenant,
                "session_id": row.session_id or None, "project_id": None, "estimated_cost_usd": None,
                "effective_rate_usd_per_million_tokens": None, "effective_rate_usd_per_gigabyte_month": None,
                "event_info": info,
            })
    events.sort(key=lambda e: (e["bucket_start"], -e["event_info"].get("token_count", 0), e["user_id"],
                               e["session_id"] or "", e["event_info"]["type"], e["event_info"].get("cached", False)))
    sessions: dict[str, dict[str, Any]] = {}
    for event in events:
        sid = event["session_id"]
        if sid is not None and sid not in sessions:
            user_metadata = metadata.get(sid)
            sessions[sid] = {"user_metadata": None if user_metadata is None else dict(user_metadata)}
    return {"data": events, "sessions": sessions, "cost_data_through": None}


def checkpoint_storage_view(tenant: str, checkpoint_count: int, size_bytes: int) -> dict[str, Any]:
    """The JSON body of ``GET /api/v1/billing/usage/checkpoints/current``
    (``tinker.types.CurrentCheckpointStorageUsageResponse``) for a tenant's live checkpoints, which the gateway's
    records count. Gigabytes are 10**9 bytes; no rates or costs here (null)."""
    data = [] if checkpoint_count <= 0 else [{
        "project_id": None, "org_user_urn": tenant, "user_email": None, "user_name": tenant,
        "checkpoint_count": checkpoint_count, "size_bytes": size_bytes, "size_gigabytes": size_bytes / 1e9,
        "estimated_monthly_cost_usd": None,
    }]
    return {"effective_rate_usd_per_gigabyte_month": None, "data": data}


def _int(raw: bytes | None) -> int:
    try:
        return int(raw) if raw else 0
    except ValueError:
        return 0
