"""Tenants' limits and the quotas checked against them (tinkerq/quotas.py), on a private redis-server and on the
in-memory store (the same answers from both)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from tinkerq.errors import UserError, ValidationError
from tinkerq.launcher.processes import wait_for
from tinkerq.quotas import LIMIT_NAMES, Limits, Quotas, check_limit, parse_limit, refusal
from tinkerq.store import KeyValueStore
from tinkerq.tenants import ApiKeys

pytestmark = pytest.mark.timeout(60)


def _tenant(store: KeyValueStore, **limits: int) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"  # the Redis is shared by the test session: names never collide
    ApiKeys(store).create(name, Limits(**limits))
    return name


# -- limits ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, -100])
def test_zero_and_negative_limits_are_refused_with_the_way_to_remove_one(bad):
    with pytest.raises(ValidationError, match=r"--max-training-clients must be at least 1, got -?\d+: to remove the "
                                              r"limit instead, pass --max-training-clients none"):
        check_limit("max_training_clients", bad)
    with pytest.raises(ValidationError, match="must be at least 1"):
        parse_limit("keep_checkpoints", str(bad))
    with pytest.raises(ValidationError, match="must be at least 1"):
        Limits(max_sampling_inflight=bad)


@pytest.mark.parametrize("bad", [True, 1.5, "3", 10**13])
def test_limits_that_are_not_whole_numbers_in_range_are_refused(bad):
    with pytest.raises(ValidationError, match="--max-tokens-per-minute"):
        check_limit("max_tokens_per_minute", bad)


def test_limits_parse_from_the_command_line():
    assert parse_limit("max_training_clients", "4") == 4
    assert parse_limit("max_training_clients", " none ") is None and parse_limit("keep_checkpoints", "NONE") is None
    with pytest.raises(ValidationError, match="whole number >= 1 or 'none', got 'lots'"):
        parse_limit("max_training_clients", "lots")
    with pytest.raises(ValidationError, match="unknown limit 'max_gpus'"):
        check_limit("max_gpus", 1)
    assert Limits(keep_checkpoints=3).updated({"keep_checkpoints": None, "max_training_clients": 2}) == \
        Limits(max_training_clients=2)
    assert Limits().describe() == "no limits"
    assert "tinkerq keys update alice --max-training-clients N" in refusal("max_training_clients", "alice", 2)


def test_limits_are_kept_with_the_key_updated_and_removed_with_it(store: KeyValueStore):
    api_keys = ApiKeys(store)
    name = _tenant(store, max_training_clients=2, max_tokens_per_minute=60_000)
    assert api_keys.limits(name) == Limits(max_training_clients=2, max_tokens_per_minute=60_000)
    after = api_keys.update_limits(name, {"max_training_clients": None, "keep_checkpoints": 5})
    assert after == Limits(max_tokens_per_minute=60_000, keep_checkpoints=5) == api_keys.limits(name)
    assert {t["name"]: t["limits"] for t in api_keys.list()}[name] == after
    with pytest.raises(ValidationError, match="at least 1"):
        api_keys.update_limits(name, {"keep_checkpoints": 0})
    with pytest.raises(ValidationError, match="no limit to change"):
        api_keys.update_limits(name, {})
    assert api_keys.limits(name) == after  # a refused update changed nothing
    api_keys.revoke(name)
    assert api_keys.limits(name) is None
    with pytest.raises(UserError, match="has no API key"):
        api_keys.update_limits(name, {"keep_checkpoints": 1})
    assert Quotas(store, cache_s=0).limits(name) == Limits()  # no key: no limits (and no access either)
    api_keys.create(name)
    assert api_keys.limits(name) == Limits()  # a new key starts without the old one's limits


def test_a_limit_change_applies_after_the_cache_time(store: KeyValueStore):
    name = _tenant(store, max_training_clients=1)
    cached, fresh = Quotas(store, cache_s=3600), Quotas(store, cache_s=0)
    assert cached.limits(name).max_training_clients == 1
    ApiKeys(store).update_limits(name, {"max_training_clients": 5})
    assert fresh.limits(name).max_training_clients == 5
    assert cached.limits(name).max_training_clients == 1  # documented: up to cache_s later


def test_a_hand_edited_stored_limit_is_ignored():
    assert Limits.from_fields([b"2", b"zero", b"-4", None]) == Limits(max_training_clients=2)
    assert len(LIMIT_NAMES) == 4


# -- training clients ------------------------------------------------------------------------------------------

def test_concurrent_training_clients_never_exceed_the_cap(store: KeyValueStore):
    name = _tenant(store, max_training_clients=3)
    gateways = [Quotas(store) for _ in range(16)]  # as many processes: each its own cache
    barrier = threading.Barrier(len(gateways))
    opened: list[str] = []

    def open_one(q: Quotas, model_id: str) -> None:
        barrier.wait()
        if q.try_open_training_client(name, model_id):
            opened.append(model_id)

    threads = [threading.Thread(target=open_one, args=(q, f"run-{i}")) for i, q in enumerate(gateways)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(opened) == 3 and sorted(gateways[0].training_clients(name)) == sorted(opened)
    q = gateways[0]
    assert q.try_open_training_client(name, opened[0])  # already counted: a retried create is not refused
    assert not q.try_open_training_client(name, "one-more")
    q.close_training_client(name, opened[0])
    assert q.try_open_training_client(name, "one-more")
    assert sorted(q.training_clients(name)) == sorted([*opened[1:], "one-more"])


def test_without_a_limit_training_clients_are_counted_not_capped(store: KeyValueStore):
    name = _tenant(store)
    q = Quotas(store)
    assert all(q.try_open_training_client(name, f"run-{i}") for i in range(20))
    assert len(q.training_clients(name)) == 20  # so a cap set later counts them


# -- samples in flight -----------------------------------------------------------------------------------------

def test_samples_in_flight_are_capped_and_ended(store: KeyValueStore):
    name = _tenant(store, max_sampling_inflight=2)
    q = Quotas(store)
    assert q.try_start_sample(name, "a") and q.try_start_sample(name, "b")
    assert not q.try_start_sample(name, "c") and q.samples_inflight(name) == 2
    assert q.try_start_sample(name, "a")  # the same request again: its lease renewed, not a third
    q.end_sample(name, "a")
    assert q.samples_inflight(name) == 1 and q.try_start_sample(name, "c")
    with pytest.raises(ValidationError, match="lease_s"):
        q.try_start_sample(name, "d", lease_s=0)


def test_an_abandoned_sample_frees_its_place_when_its_lease_ends(store: KeyValueStore):
    name = _tenant(store, max_sampling_inflight=1)
    q = Quotas(store)
    assert q.try_start_sample(name, "crashed-gateway", lease_s=0.05)  # never ended
    wait_for(lambda: q.samples_inflight(name) == 0, 10, "the lease to end")
    assert q.try_start_sample(name, "next")
    assert not q.try_start_sample(name, "one-too-many")


# -- tokens per minute -----------------------------------------------------------------------------------------

def test_tokens_over_the_rate_are_spaced_by_the_rate(store: KeyValueStore):
    name = _tenant(store, max_tokens_per_minute=600)  # 10 tokens a second, a bucket of 600
    q = Quotas(store)
    now = time.time()
    times = [q.schedule(name, f"run-{i}", tokens, now=now) - now for i, tokens in enumerate([300, 300, 300, 100])]
    # The first 600 tokens go at once; then each waits for its tokens to refill: 300 -> 30 s, 100 -> 10 s more.
    assert times == pytest.approx([0, 0, 30, 40], abs=1e-3)
    # Asked 40 s later: 1000 tokens were taken, so the bucket is full at now + 100 and holds 10 at now + 41.
    assert q.schedule(name, "run-x", 10, now=now + 40) - now == pytest.approx(100 - 60 + 1, abs=1e-3)
    assert q.schedule(name, "run-y", 1, now=now + 500) - now == pytest.approx(500, abs=1e-3)  # full again: at once


def test_concurrent_reservations_get_distinct_rate_spaced_times(store: KeyValueStore):
    name = _tenant(store, max_tokens_per_minute=600)
    gateways = [Quotas(store) for _ in range(20)]
    now = time.time()
    barrier = threading.Barrier(len(gateways))
    times: list[float] = []

    def reserve(q: Quotas, i: int) -> None:
        barrier.wait()
        times.append(q.schedule(name, f"run-{i}", 60, now=now) - now)

    threads = [threading.Thread(target=reserve, args=(q, i)) for i, q in enumerate(gateways)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # 10 x 60 tokens fill the bucket; each of the other 10 waits 6 s (60 tokens at 10/s) after the one before.
    assert sorted(times) == pytest.approx([0.0] * 10 + [6.0 * k for k in range(1, 11)], abs=1e-3)


def test_a_request_larger_than_the_bucket_goes_once_the_bucket_is_full(store: KeyValueStore):
    name = _tenant(store, max_tokens_per_minute=600)
    q = Quotas(store)
    now = time.time()
    assert q.schedule(name, "big", 1500, now=now) == pytest.approx(now, abs=1e-3)  # full bucket: at once
    # It took 1500 of 600: the 900 of debt refill in 90 s, then the next request's 60 tokens in 6 s.
    assert q.schedule(name, "next", 60, now=now) - now == pytest.approx(90 + 6, abs=1e-3)
    # A second big one waits until the bucket is full again (not for 1500 tokens: they would never fit): the
    # debt and the 60 tokens are back at now + 156.
    assert q.schedule(name, "big-2", 1500, now=now) - now == pytest.approx(156, abs=1e-3)


def test_a_runs_requests_keep_their_order(store: KeyValueStore):
    name = _tenant(store, max_tokens_per_minute=600)
    q = Quotas(store)
    now = time.time()
    q.schedule(name, "other", 600, now=now)  # another run empties the bucket
    delayed = q.schedule(name, "run", 300, now=now)
    assert delayed - now == pytest.approx(30, abs=1e-3)
    # optim_step takes no tokens: the bucket would let it go now, but it follows its run's forward_backward.
    assert q.schedule(name, "run", 0, now=now) == pytest.approx(delayed, abs=1e-3)
    assert q.schedule(name, "other-run", 0, now=now) == pytest.approx(now, abs=1e-3)  # not held by "run"
    with pytest.raises(ValidationError, match="tokens"):
        q.schedule(name, "run", -1, now=now)


def test_without_a_token_limit_only_the_runs_order_holds(store: KeyValueStore):
    name = _tenant(store, max_tokens_per_minute=60)
    q = Quotas(store, cache_s=0)
    now = time.time()
    held = q.schedule(name, "run", 120, now=now)  # 60 of debt: the next request of the run waits 60 s
    assert held == pytest.approx(now, abs=1e-3) and q.schedule(name, "run", 1, now=now) - now == \
        pytest.approx(61, abs=1e-3)
    ApiKeys(store).update_limits(name, {"max_tokens_per_minute": None})
    assert q.schedule(name, "run", 10**9, now=now) - now == pytest.approx(61, abs=1e-3)  # after its previous one
    assert q.schedule(name, "fresh-run", 10**9, now=now) == pytest.approx(now, abs=1e-3)
