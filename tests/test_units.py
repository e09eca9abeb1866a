"""Small pieces on their own: ordering, claim checks, settings, errors."""

from __future__ import annotations

import pytest

from tinkerq import errors
from tinkerq.errors import MalformedMessageError, error_from_wire
from tinkerq.settings import Settings, SettingsError
from tinkerq.store import MemoryStore
from tinkerq.wire.claimcheck import ClaimCheck


def test_ordering_runs_buffers_and_repeats():
    from tinkerq.worker.core.ordering import Ordering
    from tinkerq.worker.core.scheduler import Caller, Request

    o = Ordering()
    assert o.classify(1) == "run" and o.classify(3) == "buffer"
    third = Request("optim_step", {}, [Caller("t3", None)], model_id="m", seq_id=3)
    assert o.buffer(3, third)
    o.applied(1, "r1")
    assert o.pop_ready() is None  # 2 has not arrived
    assert o.classify(1) == "repeat" and o.reply_for(1) == "r1"
    o.applied(2, "r2")
    assert o.pop_ready() is third and not o.buffered


def test_claim_check_inline_blob_and_limits():
    store = MemoryStore()
    cc = ClaimCheck(store, threshold_bytes=10, ttl_s=60, max_bytes=100)
    assert cc.wrap(b"small") == {"inline": b"small"}
    ref = cc.wrap(b"x" * 50)
    assert "blob" in ref and cc.unwrap(ref) == b"x" * 50
    cc.discard(ref)
    with pytest.raises(MalformedMessageError, match="expired"):
        cc.unwrap(ref)
    with pytest.raises(MalformedMessageError, match="exceeds"):
        cc.wrap(b"x" * 101)
    with pytest.raises(MalformedMessageError, match="not a tinkerq blob"):
        cc.unwrap({"blob": "user:secrets"})


def test_memory_store_expires_keys():
    store = MemoryStore()
    store.set("tinkerq:a", b"1", ttl_s=-1)
    store.set("tinkerq:b", b"2", ttl_s=60)
    assert store.get("tinkerq:a") is None and store.scan("tinkerq:*") == ["tinkerq:b"]


def test_settings_from_env_and_errors():
    s = Settings.from_env({"TINKERQ_BROKER_URL": "redis://h:1/0", "TINKERQ_MAX_DATUMS": "7"}, max_sessions=2)
    assert (s.broker_url, s.max_datums, s.max_sessions, s.heartbeat_s) == ("redis://h:1/0", 7, 2, 5.0)
    with pytest.raises(SettingsError, match="TINKERQ_MAX_DATUMS"):
        Settings.from_env({"TINKERQ_MAX_DATUMS": "many"})
    with pytest.raises(SettingsError, match="redis://"):
        Settings.from_env({"TINKERQ_BROKER_URL": "amqp://x"})


def test_errors_cross_the_wire_with_their_category():
    err = errors.ValidationError("datum 3: bad", datum=3)
    back = error_from_wire(err.to_wire())
    assert type(back) is errors.ValidationError and back.category == "user" and back.details == {"datum": 3}
    assert isinstance(back, ValueError)
    assert error_from_wire({"type": "FutureError", "category": "user", "message": "m"}).category == "user"
    assert error_from_wire("garbage").category == "server"


@pytest.mark.parametrize("n_datums", [0, 1, 2, 3, 7, 16])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_rank_plans_cover_every_datum_once_with_equal_pass_counts(n_datums, ranks):
    import numpy as np

    from tinkerq.worker.training.batching import rank_plans

    lengths = np.random.default_rng(n_datums * 10 + ranks).integers(1, 60, n_datums).tolist()
    plans = rank_plans(lengths, ranks, budget_tokens=96)
    assert len(plans) == ranks and len({len(p) for p in plans}) == 1  # the same number of passes everywhere
    covered = [i for plan in plans for span in plan if span is not None for i in range(*span)]
    assert covered == list(range(n_datums))  # in order, never duplicated or dropped
    sizes = [sum(b - a for a, b in filter(None, plan)) for plan in plans]
    assert max(sizes) - min(sizes) <= 1
    for plan in plans:
        for span in filter(None, plan):
            a, b = span
            assert b - a == 1 or max(lengths[a:b]) * (b - a) <= 96  # within the micro-batch budget
        real = [s for s in plan if s is not None]
        assert plan[: len(real)] == real  # padding passes come last


def test_metric_totals_merged_across_ranks_equal_one_pass():
    import torch

    from tinkerq.worker.training.losses import Metric, MetricTotals

    g = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=g)
    where = torch.rand(6, 5, generator=g) > 0.3

    def metrics(rows):
        return {f"x:{r}": Metric(r, values[rows], where[rows]) for r in ("sum", "mean", "min", "max")}

    whole = MetricTotals()
    whole.add(metrics(slice(0, 6)))
    merged = MetricTotals()
    for rows in (slice(0, 2), slice(2, 6)):
        part = MetricTotals()
        part.add(metrics(rows))
        merged.merge(part.raw())
    assert merged.result() == pytest.approx(whole.result(), rel=1e-9)


def test_a_worker_that_stops_consuming_stops_beating(caplog):
    """Liveness means consuming: with the consumer loop silent and no task running, no heartbeat is sent.
    Counted, not timed: the beats the registration sends while the loop ticks, stops, and ticks again."""
    import logging
    import time

    from tinkerq import keys
    from tinkerq.launcher.processes import wait_for
    from tinkerq.store import MemoryStore
    from tinkerq.worker.recovery.registry import ConsumerLiveness, Registration

    class CountingStore(MemoryStore):
        beats = 0

        def beat(self, zset: str, member: str) -> None:
            super().beat(zset, member)
            self.beats += 1

    store = CountingStore()
    liveness = ConsumerLiveness(period_s=0.4)  # beats every 0.2 s; silent loop after 0.8 s without a tick
    liveness.enabled = True  # as when the consumer's event loop has started
    registration = Registration(store, "m", "w1", 0.4, consuming=liveness)
    caplog.set_level(logging.ERROR, logger="tinkerq.worker")
    stopped = "consumer loop has stopped taking messages"
    registration.start()
    try:
        first = store.beats
        while store.beats < first + 3:  # the loop ticks: the registration beats
            liveness.tick()
            time.sleep(0.05)
        assert stopped not in caplog.text
        # No ticks (a wedged loop), no task running: it says so once, and from that check on sends no beat.
        wait_for(lambda: stopped in caplog.text, 30, "the registration to notice the silent loop")
        silent = store.beats
        time.sleep(1.0)  # five of its checks
        assert store.beats == silent and not liveness()
        assert caplog.text.count(stopped) == 1
        liveness.tick()  # consuming again: beats resume
        wait_for(lambda: store.beats > silent, 30, "beats to resume")
    finally:
        registration.stop()
    assert "w1" not in store.ages(keys.HEARTBEATS)  # a stopped worker leaves the set at once


def test_a_registration_withdrawn_while_a_beat_waits_out_an_outage_is_not_left_announced():
    """A beat's write that waits on Redis through an outage lands after the worker withdrew (a shard group
    failing meanwhile, whose delete failed in the same outage): the model must not be announced again."""
    import threading

    from tinkerq.worker.recovery.registry import Registration

    class OutageStore(MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.down = False
            self.writing = threading.Event()
            self.back = threading.Event()

        def with_retry(self, retry_s: float) -> OutageStore:
            return self

        def set(self, key: str, value: bytes, ttl_s: float | None) -> None:
            if self.down:  # a write retried through the outage: it lands once Redis is back
                self.writing.set()
                assert self.back.wait(10)
            super().set(key, value, ttl_s)

        def delete(self, key: str) -> None:
            if self.down:
                raise ConnectionError("Redis is away")
            super().delete(key)

    store = OutageStore()
    registration = Registration(store, "m", "w1", 10.0)
    registration.beat()
    assert store.get(registration.key) is not None
    store.down = True
    beating = threading.Thread(target=registration.beat)
    beating.start()
    assert store.writing.wait(10)
    registration.withdraw()  # its delete fails: Redis is away
    store.down = False
    store.back.set()  # the beat's write lands now
    beating.join(10)
    assert store.get(registration.key) is None  # withdrawn, not re-announced until its TTL
    registration.resume()
    registration.beat()
    assert store.get(registration.key) is not None


def test_server_capabilities_are_computed_once_from_the_workers_registrations():
    """The producer and the gateway answer get_server_capabilities with the same computation."""
    from tinkerq.types import GetServerCapabilitiesResponse

    found = GetServerCapabilitiesResponse.from_workers([
        {"base_model": "b", "role": "sampler", "max_seq_len": 512},
        {"base_model": "a", "max_seq_len": 128},  # no role recorded: a trainer
        {"base_model": "b", "role": "sampler", "max_seq_len": 2048},
        {"base_model": "c", "role": "trainer"},
        {"base_model": "c", "role": "sampler", "max_seq_len": "many"},  # not a number: ignored
    ])
    assert [(m.model_name, m.trainable, m.sampleable, m.max_context_length) for m in found.supported_models] == [
        ("a", True, True, 128), ("b", False, True, 2048), ("c", True, True, None)]
