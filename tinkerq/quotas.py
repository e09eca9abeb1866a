"""Per-tenant limits and the quotas the gateway enforces with them, shared by every gateway through Redis.

An operator sets a tenant's :class:`Limits` with ``tinkerq keys create|update NAME --max-...``; they are fields
of the tenant's API key record (:mod:`tinkerq.tenants`), so they go when the key is revoked. Unset: no limit.

Several gateway processes serve one fleet, so the counts live in Redis, and each check-and-count is one store
transaction (:meth:`~tinkerq.store.KeyValueStore.transaction`, written here on the store's primitives; key names
in :mod:`tinkerq.keys`):

* training clients: a set of the tenant's open training runs, capped at ``max_training_clients``;
* samples in flight: a set of request ids, capped at ``max_sampling_inflight``; each entry is a lease (Redis
  time) that ends by itself, so a gateway that crashed mid-request cannot hold the tenant's capacity forever;
* tokens: ``max_tokens_per_minute`` is a token bucket kept as a GCRA "theoretical arrival time", and
  :meth:`Quotas.schedule` answers *when* a request may go rather than refusing it (backpressure, not errors).

``keep_checkpoints`` is only stored here: the gateway keeps the newest K checkpoints of each training run and
kind and deletes older ones.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinkerq import keys
from tinkerq.errors import ValidationError
from tinkerq.store import Put, Transaction, ZAdd, ZRemoveBelow

if TYPE_CHECKING:
    from tinkerq.store import KeyValueStore

log = logging.getLogger(__name__)

LIMIT_NAMES = ("max_training_clients", "max_sampling_inflight", "max_tokens_per_minute", "keep_checkpoints")
# Far above any real limit, and exact in Lua's doubles (2**53) and Redis's integers.
MAX_LIMIT = 10**12
NO_LIMIT = "none"  # how a limit is removed on the command line: --max-training-clients none
_CACHE_MAX_ENTRIES = 10_000


def option_of(name: str) -> str:
    """The command-line option that sets limit ``name``: max_training_clients -> --max-training-clients."""
    return "--" + name.replace("_", "-")


def check_limit(name: str, value: object) -> int | None:
    """``value`` if it is a valid setting of limit ``name``: None (no limit) or a whole number >= 1.

    0 and negative numbers are refused rather than read as "no limit" or "refuse everything": one clear
    answer, with how to remove a limit. Every writer of limits (the CLI, :class:`Limits`) checks here.
    """
    if name not in LIMIT_NAMES:
        raise ValidationError(f"unknown limit {name!r}: the limits are {', '.join(LIMIT_NAMES)}")
    if value is None:
        return None
    option = option_of(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{option} must be a whole number >= 1 or '{NO_LIMIT}', got {value!r:.40}")
    if value <= 0:
        raise ValidationError(f"{option} must be at least 1, got {value}: to remove the limit instead, pass "
                              f"{option} {NO_LIMIT}")
    if value > MAX_LIMIT:
        raise ValidationError(f"{option} must be at most {MAX_LIMIT}, got {value}: for no limit, pass "
                              f"{option} {NO_LIMIT}")
    return value


def parse_limit(name: str, text: str) -> int | None:
    """A limit as written on the command line: a whole number >= 1, or ``none`` for no limit."""
    if text.strip().lower() == NO_LIMIT:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        raise ValidationError(f"{option_of(name)} must be a whole number >= 1 or '{NO_LIMIT}', "
                              f"got {text!r:.40}") from None
    return check_limit(name, value)


@dataclass(frozen=True)
class Limits:
    """A tenant's limits; None: no limit. Invalid values (0, negative, not a whole number) raise ValidationError."""

    max_training_clients: int | None = None
    max_sampling_inflight: int | None = None
    max_tokens_per_minute: int | None = None
    keep_checkpoints: int | None = None  # newest K checkpoints kept per training run and kind

    def __post_init__(self) -> None:
        for name in LIMIT_NAMES:
            check_limit(name, getattr(self, name))

    def as_dict(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in LIMIT_NAMES}

    def updated(self, changes: dict[str, int | None]) -> Limits:
        """These limits with ``changes`` applied (a None value removes that limit)."""
        for name, value in changes.items():
            check_limit(name, value)
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line for people: ``max_training_clients=2, max_tokens_per_minute=60000`` or ``no limits``."""
        return ", ".join(f"{name}={value}" for name, value in self.as_dict().items() if value is not None) or \
            "no limits"

    @classmethod
    def from_fields(cls, values: Sequence[bytes | None]) -> Limits:
        """Limits as stored (one value per LIMIT_NAMES, decimal text; None: unset). A value that is not a valid
        limit (a hand-edited record) is ignored, with a warning: no limit rather than a gateway that fails."""
        found: dict[str, int | None] = {}
        for name, raw in zip(LIMIT_NAMES, values, strict=True):
            if raw is None:
                continue
            try:
                found[name] = check_limit(name, int(raw.decode()))
            except (ValueError, UnicodeDecodeError):  # ValidationError is a ValueError
                log.warning("ignoring the stored limit %s=%r: not a whole number >= 1", name, raw[:40])
        return cls(**found)


def refusal(limit_name: str, tenant: str, limit: int) -> str:
    """What to tell a tenant refused by one of its limits (the gateway answers it with the refusal)."""
    what = {"max_training_clients": f"{limit} training clients open: unload one before creating another",
            "max_sampling_inflight": f"{limit} sample requests in flight: wait for one to finish"}.get(
        limit_name, f"its {limit_name} of {limit}")
    return (f"API key {tenant!r} is at its limit of {what} (an operator can raise it: "
            f"tinkerq keys update {tenant} {option_of(limit_name)} N)")


class Quotas:
    """A tenant's limits and the counts checked against them, in the fleet's store (shared by all gateways).

    :meth:`limits` is cached for ``cache_s`` in this process (every request reads it): a changed limit applies
    within that long. The counts themselves are never cached: each check-and-count is one atomic store call.
    """

    def __init__(self, store: KeyValueStore, *, cache_s: float = 1.0) -> None:
        self.store = store
        self.cache_s = cache_s
        self._cache: dict[str, tuple[Limits, float]] = {}  # tenant -> (limits, monotonic expiry)
        self._lock = threading.Lock()

    def limits(self, tenant: str) -> Limits:
        """``tenant``'s limits (no limits for a tenant without a key)."""
        if self.cache_s > 0:
            with self._lock:
                hit = self._cache.get(tenant)
            if hit is not None and hit[1] > time.monotonic():
                return hit[0]
        fields = tenant_key_fields(self.store, tenant, list(LIMIT_NAMES))
        limits = Limits() if fields is None else Limits.from_fields(fields)
        if self.cache_s > 0:
            with self._lock:
                if len(self._cache) >= _CACHE_MAX_ENTRIES:
                    self._cache.clear()
                self._cache[tenant] = (limits, time.monotonic() + self.cache_s)
        return limits

    # -- training clients ---------------------------------------------------------------------------------------

    def try_open_training_client(self, tenant: str, model_id: str) -> bool:
        """Count ``model_id`` as one of ``tenant``'s open training clients; False (nothing counted) if the tenant
        already holds ``max_training_clients`` others. True for a model id already counted (a retried create).

        Counted until :meth:`close_training_client` (no lease: a training run outlives any one gateway).
        """
        cap = self.limits(tenant).max_training_clients
        return _join_capped(self.store, keys.training_clients(tenant), model_id, cap, None)

    def close_training_client(self, tenant: str, model_id: str) -> None:
        self.store.forget(keys.training_clients(tenant), model_id)

    def training_clients(self, tenant: str) -> list[str]:
        """The model ids counted as ``tenant``'s open training clients."""
        return _live_members(self.store, keys.training_clients(tenant))

    # -- samples in flight --------------------------------------------------------------------------------------

    def try_start_sample(self, tenant: str, request_id: str, *, lease_s: float = 600.0) -> bool:
        """Count sample request ``request_id`` as in flight for ``lease_s`` seconds (Redis time); False (nothing
        counted) if ``tenant`` already has ``max_sampling_inflight`` others in flight. The same id again renews
        its lease. A lease that ends uncounts the request by itself, so a crashed gateway leaks nothing for good.
        """
        if not lease_s > 0:
            raise ValidationError(f"lease_s must be > 0 seconds, got {lease_s!r}")
        cap = self.limits(tenant).max_sampling_inflight
        return _join_capped(self.store, keys.samples_inflight(tenant), request_id, cap, lease_s)

    def end_sample(self, tenant: str, request_id: str) -> None:
        self.store.forget(keys.samples_inflight(tenant), request_id)

    def samples_inflight(self, tenant: str) -> int:
        return len(_live_members(self.store, keys.samples_inflight(tenant)))

    # -- tokens per minute --------------------------------------------------------------------------------------

    def schedule(self, tenant: str, run_id: str, tokens: int, *, now: float | None = None) -> float:
        """The epoch second (>= ``now``) at which a request of ``tokens`` tokens of training run ``run_id`` may be
        posted; the caller waits until then. Never refuses: backpressure, not errors.

        The tenant's bucket holds ``max_tokens_per_minute`` tokens and refills at a 60th of that per second. A
        request goes once the bucket holds min(tokens, capacity), and takes all of its tokens: debt is allowed,
        so a request larger than the bucket goes as soon as the bucket is full (nothing starves, nothing is
        dropped) and the requests after it wait for the debt to refill. Each call reserves its tokens at once,
        so concurrent callers on any gateway get distinct, rate-spaced times.

        Per run, the answer is also >= the run's previous answer: a run's requests are posted in the order they
        were accepted, even a 0-token request (optim_step) behind a delayed forward_backward. A 0-token request
        takes nothing and waits for nothing else (not for the bucket's debt). With no token limit: max(now, the
        run's previous answer). Times are the callers' clocks (``time.time()``), so the
        gateways' clocks should agree (NTP); Redis keeps each key only a little past its last time.
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValidationError(f"tokens must be a whole number >= 0, got {tokens!r:.40}")
        at = time.time() if now is None else float(now)
        limit = self.limits(tenant).max_tokens_per_minute
        per_token_s = 60.0 / limit if limit else 0.0
        return _reserve_rate(self.store, keys.token_bucket(tenant), keys.run_schedule(tenant, run_id), at, tokens,
                             per_token_s, limit or 0)


def tenant_key_fields(store: KeyValueStore, tenant: str, fields: list[str]) -> list[bytes | None] | None:
    """``fields`` of ``tenant``'s API key record (:mod:`tinkerq.tenants`: limits are fields of it); None if the
    tenant has no key. Two reads: a record removed in between has no ``tenant`` field, and reads as no key."""
    digest = store.hash_fields([keys.TENANTS], [tenant])[0][0]
    if digest is None:
        return None
    found = store.hash_fields([keys.api_key(digest.decode())], ["tenant", *fields])[0]
    return None if found[0] != tenant.encode() else found[1:]


# -- the counts, written once on the store's primitives ---------------------------------------------------------

def _join_capped(store: KeyValueStore, zset: str, member: str, cap: int | None, lease_s: float | None) -> bool:
    """Holders are a sorted set scored by when their lease ends (store time; no lease: never). Drop ended leases,
    then admit ``member`` if it is already in or fewer than ``cap`` are (None: no cap)."""

    def join(t: Transaction) -> bool:
        now = t.now()
        if cap is not None:  # (no cap: nothing read, nothing to watch)
            t.watch(zset)
            live = [m for m, _ in t.zset_range(zset, now, math.inf)]
            if member not in live and len(live) >= cap:
                return False
        t.write(ZRemoveBelow(zset, now), ZAdd(zset, member, math.inf if lease_s is None else now + lease_s))
        return True

    return store.transaction(join, what=f"counting {zset}")


def _live_members(store: KeyValueStore, zset: str) -> list[str]:
    """The holders whose lease has not ended, soonest-ending first."""
    return [member for member, _ in store.zset_range(zset, store.now(), math.inf)]


# Past a token bucket's full time (or a run's scheduled time) its key is worth nothing; it is kept this much longer
# (clocks of gateways may differ a little).
_RATE_KEEP_S = 600.0


def _reserve_rate(store: KeyValueStore, bucket: str, run: str, now: float, tokens: int, per_token_s: float,
                  capacity: int) -> float:
    """A token bucket as a GCRA theoretical arrival time, and a run's latest scheduled time: the epoch second at
    which ``tokens`` may go (Quotas.schedule explains). A request needs min(tokens, capacity) tokens in the bucket
    to go and takes all of its tokens (debt); one of 0 tokens takes nothing and waits for nothing but its run.
    capacity 0: no rate limit, the run's order only."""

    def reserve(t: Transaction) -> float:
        raw_tat, raw_run = t.get_many([bucket, run])  # one round trip
        start = now
        if capacity > 0 and tokens > 0:
            tat = _float(raw_tat)
            start = max(now, tat + min(tokens, capacity) * per_token_s - capacity * per_token_s)
            new_tat = max(tat, start) + tokens * per_token_s
            t.write(Put(bucket, repr(new_tat).encode(), new_tat - now + _RATE_KEEP_S))
        start = max(start, _float(raw_run))
        t.write(Put(run, repr(start).encode(), max(0.0, start - now) + _RATE_KEEP_S))
        return start

    return store.transaction(reserve, [bucket, run], what=f"scheduling {run}")


def _float(raw: bytes | None) -> float:
    try:
        return float(raw) if raw else 0.0
    except ValueError:
        return 0.0
