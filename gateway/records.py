"""What the gateway remembers in Redis, per tenant: sessions, training runs, sampling sessions, checkpoints.

Kept in Redis (not in the gateway's memory) so that a restarted gateway, or a second one behind the same
load balancer, still knows who owns what: a tenant's ids and ``tinker://`` paths resolve for that tenant
only, and everything else answers as if it did not exist. Each record is a JSON map with its ``tenant``,
under :func:`tinkerq.keys.gateway_record`'s key, read and written through the store seam.

Checkpoint paths are Tinker's: ``tinker://<training run>/weights/<name>`` (save_state) and
``tinker://<training run>/sampler_weights/<name>`` (save_weights_for_sampler). A record maps one to the
directory the worker wrote; the directory name never comes from the path itself. A checkpoint saved with
``ttl_seconds`` has a record that expires with it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tinkerq import keys
from tinkerq.store import KeyValueStore, Put, Transaction, Write, ZAdd, ZRemove

# Sessions and training runs are kept a week after their last use; checkpoints until their ttl (or forever).
IDLE_TTL_S = 7 * 24 * 3600

# path segment -> Tinker's checkpoint_type
SEGMENTS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


class PathError(ValueError):
    """A string that is not a tinker:// checkpoint path this gateway makes."""


@dataclass(frozen=True)
class TinkerPath:
    run: str  # the training run (model id) that saved it
    segment: str  # "weights" | "sampler_weights"
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.run}/{self.segment}/{self.name}"

    @property
    def checkpoint_type(self) -> str:
        return SEGMENTS[self.segment]

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    @classmethod
    def parse(cls, path: Any) -> TinkerPath:
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise PathError(f"{path!r} is not a checkpoint path: expected tinker://<run>/weights/<name> or "
                            f"tinker://<run>/sampler_weights/<name>, as save_state / save_weights_for_sampler give")
        parts = path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] not in SEGMENTS or not _ID_RE.match(parts[0]) or not _NAME_RE.match(parts[2]):
            raise PathError(f"{path!r} is not a checkpoint path: expected tinker://<run>/weights/<name> or "
                            f"tinker://<run>/sampler_weights/<name> (names: 1-128 characters of [A-Za-z0-9_.-])")
        return cls(parts[0], parts[1], parts[2])


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise PathError(f"checkpoint name {name!r} must be 1-128 characters of [A-Za-z0-9_.-]")
    return name


class Records:
    """Tenant-owned JSON records in the fleet's store (key names: :func:`tinkerq.keys.gateway_record`). ``get``
    returns None for another tenant's record.

    Every call is tried once (the store ``with_retry(0)``): the gateway makes them inline, on its event loop,
    so a Redis outage must not hold it; it raises BrokerUnavailableError, answered 503 (the SDK retries).
    """

    def __init__(self, store: KeyValueStore) -> None:
        self.store = store.with_retry(0)

    def put(self, table: str, ident: str, record: dict[str, Any], *, ttl_s: float | None = IDLE_TTL_S) -> None:
        put = self.written(table, ident, record, ttl_s=ttl_s)
        self.store.set(put.key, put.value, put.ttl_s)

    @staticmethod
    def written(table: str, ident: str, record: dict[str, Any], *, ttl_s: float | None = IDLE_TTL_S) -> Put:
        """The write that :meth:`put` makes, to join other writes."""
        assert "tenant" in record
        return Put(keys.gateway_record(table, ident), _dumps(record), ttl_s)

    def get_with(self, table: str, ident: str, tenant: str, other: str) -> tuple[dict[str, Any] | None, bytes | None]:
        """:meth:`get`, and the value of the key ``other`` read with it (one round trip)."""
        raw, value = self.store.get_many([keys.gateway_record(table, ident), other])
        return _owned(raw, tenant), value

    def put_new(self, table: str, ident: str, record: dict[str, Any], *, ttl_s: float = IDLE_TTL_S) -> bool:
        """Store ``record`` unless ``ident`` exists (for anyone): False then."""
        return self.store.set_if_absent(keys.gateway_record(table, ident), _dumps(record), ttl_s)

    def get(self, table: str, ident: str, tenant: str) -> dict[str, Any] | None:
        return _owned(self.store.get(keys.gateway_record(table, ident)), tenant)

    def delete(self, table: str, ident: str) -> None:
        self.store.delete(keys.gateway_record(table, ident))

    def scan(self, table: str, tenant: str, prefix: str = "") -> list[dict[str, Any]]:
        """Every record of ``table`` whose id starts with ``prefix`` that ``tenant`` owns."""
        return [record for _, record in self.scan_items(table, tenant, prefix)]

    def scan_items(self, table: str, tenant: str, prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
        """(id, record) of every record of ``table`` whose id starts with ``prefix`` that ``tenant`` owns."""
        names = self.store.scan(keys.gateway_records_pattern(table, prefix))
        head = len(keys.gateway_record(table, ""))
        owned = ((name[head:], _owned(raw, tenant)) for name, raw in zip(names, self.store.get_many(names),
                                                                         strict=True))
        return [(ident, record) for ident, record in owned if record is not None]

    def update(self, table: str, ident: str, tenant: str, change: Callable[[dict[str, Any]], None], *,
               ttl_s: float = IDLE_TTL_S) -> dict[str, Any] | None:
        """Apply ``change`` to ``tenant``'s record atomically and store it (None: no such record of ``tenant``).
        A write by anyone in between makes it read and apply again (WATCH), so concurrent updates of one record
        (a session's heartbeat, finish and project) never undo each other. ``change`` may raise: nothing is
        written then."""
        key = keys.gateway_record(table, ident)

        def run(t: Transaction) -> dict[str, Any] | None:
            record = _owned(t.get(key), tenant)
            if record is None:
                return None
            change(record)
            t.write(Put(key, _dumps(record), ttl_s))
            return record

        return self.store.transaction(run, [key], what=f"updating a {table} record")

    def touch(self, table: str, ident: str, ttl_s: float = IDLE_TTL_S) -> None:
        self.store.expire(keys.gateway_record(table, ident), ttl_s)

    # -- first-come claims, shared by every gateway ---------------------------------------------------------

    def claim(self, what: str, value: str, *, ttl_s: float = IDLE_TTL_S, after: Sequence[Write] = ()) -> str | None:
        """Claim ``what`` for ``value``: None if this call got it, else the value of whoever did first. ``after``:
        writes applied first, in the same step (one round trip), whoever gets the claim."""
        raw = self.store.claim_after(after, keys.gateway_claim(what), value.encode(), ttl_s)
        return None if raw is None else raw.decode()

    def get_claim(self, what: str) -> str | None:
        raw = self.store.get(keys.gateway_claim(what))
        return None if raw is None else raw.decode()

    # -- per training run: its highest sequence id and last request time (sorted sets: atomic max, no read) --

    def raise_top(self, model_id: str, seq_id: int) -> None:
        """Remember that ``seq_id`` of ``model_id`` is taken (the run's top only grows) and when it came."""
        self.store.write_many(top_raised(model_id, seq_id))

    def top(self, model_id: str) -> int:
        """The run's highest sequence id taken so far (0: none)."""
        return int(self.store.zset_score(keys.GATEWAY_RUN_TOPS, model_id) or 0)

    def last_request(self, model_id: str) -> float | None:
        return self.store.zset_score(keys.GATEWAY_LAST_REQUEST, model_id)

    def forget_run(self, model_id: str) -> None:
        self.store.write_many([ZRemove(keys.GATEWAY_RUN_TOPS, [model_id]),
                               ZRemove(keys.GATEWAY_LAST_REQUEST, [model_id])])


def top_raised(model_id: str, seq_id: int) -> list[Write]:
    """The writes of :meth:`Records.raise_top`, to join other writes."""
    return [ZAdd(keys.GATEWAY_RUN_TOPS, model_id, seq_id, only_greater=True),
            ZAdd(keys.GATEWAY_LAST_REQUEST, model_id, time.time())]


def _dumps(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode()


def _owned(raw: bytes | None, tenant: str) -> dict[str, Any] | None:
    record = json.loads(raw) if raw is not None else None
    return record if isinstance(record, dict) and record.get("tenant") == tenant else None


def checkpoint_record(tenant: str, path: TinkerPath, directory: str, run: dict[str, Any],
                      ttl_seconds: int | None, user_metadata: dict[str, str] | None) -> dict[str, Any]:
    now = time.time()
    return {
        "tenant": tenant, "tinker_path": str(path), "checkpoint_id": path.checkpoint_id,
        "checkpoint_type": path.checkpoint_type, "run": path.run, "directory": directory,
        "base_model": run["base_model"], "lora": run.get("lora"), "optimizer": run.get("optimizer"), "time": now,
        "expires_at": None if ttl_seconds is None else now + ttl_seconds, "user_metadata": user_metadata,
    }
