"""Usage accounting per tenant and session (tinkerq/usage.py), `tinkerq usage`, and the Tinker API's billing
views, on a private redis-server (the store's scripts) and the in-memory store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
from tinker import types as tinker_types

from tinkerq.errors import ValidationError
from tinkerq.launcher.processes import ROOT
from tinkerq.store import KeyValueStore, MemoryStore, RedisStore
from tinkerq.usage import (
    COUNTERS,
    Usage,
    UsageRow,
    billing_usage_view,
    billing_window,
    checkpoint_storage_view,
    hour_of,
    parse_since,
    request_counter,
)

pytestmark = pytest.mark.timeout(60)

TINKERQ = Path(sys.executable).parent / "tinkerq"
H = 1_780_000_000 // 3600 * 3600  # an hour's start, in 2026


def _name() -> str:
    return f"u-{uuid.uuid4().hex[:8]}"  # the Redis is shared by the test session: names never collide


def test_counts_add_up_in_hour_buckets_per_session(store: KeyValueStore):
    usage, t = Usage(store), _name()
    now = time.time()
    hour = hour_of(now)
    assert usage.record(t, "s1", {"training_tokens": 100, request_counter("forward_backward"): 1}, at=hour + 1)
    assert usage.record(t, "s1", {"training_tokens": 50, "checkpoints": 0}, at=hour + 3599)  # the same hour
    assert usage.record(t, "s2", {"sampled_tokens": 7, "prefill_tokens": 30, "cached_prefill_tokens": 20}, at=now)
    assert usage.record(t, "", {"checkpoints": 1, "checkpoint_bytes": 4096}, at=hour - 1)  # the hour before
    assert usage.rows(t) == [
        UsageRow(t, "", hour - 3600, {"checkpoints": 1, "checkpoint_bytes": 4096}),
        UsageRow(t, "s1", hour, {"training_tokens": 150, "requests_forward_backward": 1}),
        UsageRow(t, "s2", hour, {"sampled_tokens": 7, "prefill_tokens": 30, "cached_prefill_tokens": 20}),
    ]
    assert [r.session_id for r in usage.rows(t, since=hour + 10)] == ["s1", "s2"]  # the bucket holding `since`
    totals = usage.totals(t)
    assert set(COUNTERS) <= set(totals) and totals["training_tokens"] == 150 and totals["checkpoint_bytes"] == 4096
    assert totals["requests_forward_backward"] == 1 and totals["sampled_tokens"] == 7
    assert usage.totals(_name()) == dict.fromkeys(COUNTERS, 0) and usage.rows(_name()) == []


def test_rows_of_every_tenant(store: KeyValueStore):
    usage, a, b = Usage(store), _name(), _name()
    usage.record(a, "x", {"training_tokens": 1})
    usage.record(b, "y", {"training_tokens": 2})
    rows = [r for r in usage.rows() if r.tenant in (a, b)]
    assert [(r.tenant, r.counts["training_tokens"]) for r in rows] == sorted([(a, 1), (b, 2)])
    assert usage.rows(since=time.time() + 7200) == []


def test_a_request_is_counted_once_even_when_answered_twice(store: KeyValueStore):
    usage, t = Usage(store), _name()
    gateways = [Usage(store) for _ in range(8)]
    barrier = threading.Barrier(len(gateways))
    applied: list[bool] = []

    def answer(u: Usage) -> None:
        barrier.wait()
        applied.append(u.record(t, "s", {"sampled_tokens": 10}, once="req-1"))

    threads = [threading.Thread(target=answer, args=(u,)) for u in gateways]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sorted(applied) == [False] * 7 + [True]
    assert usage.record(t, "s", {"sampled_tokens": 10}, once="req-2")
    assert not usage.record(t, "s", {"sampled_tokens": 10}, once="req-2", at=time.time() + 3600)  # next hour too
    assert usage.totals(t)["sampled_tokens"] == 20


def test_only_applied_records_reach_prometheus(store: KeyValueStore):
    prometheus = pytest.importorskip("prometheus_client")
    t = _name()

    def tokens(kind: str) -> float:
        return prometheus.REGISTRY.get_sample_value("tinkerq_tenant_tokens_total", {"tenant": t, "kind": kind}) or 0

    usage = Usage(store)
    usage.record(t, "s", {"training_tokens": 5, "cached_prefill_tokens": 3, "requests_sample": 2}, once="r")
    usage.record(t, "s", {"training_tokens": 5}, once="r")  # skipped: not counted here either
    assert tokens("training") == 5 and tokens("cached_prefill") == 3
    assert prometheus.REGISTRY.get_sample_value("tinkerq_tenant_requests_total", {"tenant": t, "kind": "sample"}) == 2


@pytest.mark.parametrize(("counts", "match"), [
    ({"Training": 1}, "not valid"), ({"a|b": 1}, "not valid"), ({"training_tokens": -1}, ">= 0"),
    ({"training_tokens": True}, ">= 0"), ({"training_tokens": 1.5}, ">= 0"),
])
def test_bad_counts_are_refused(counts, match):
    with pytest.raises(ValidationError, match=match):
        Usage(MemoryStore()).record("alice", "", counts)


def test_bad_names_and_settings_are_refused():
    usage = Usage(MemoryStore())
    with pytest.raises(ValidationError, match="tenant name"):
        usage.record("no spaces", "", {"training_tokens": 1})
    with pytest.raises(ValidationError, match="session_id"):
        usage.record("alice", "s" * 300, {"training_tokens": 1})
    with pytest.raises(ValidationError, match="once"):
        usage.record("alice", "", {"training_tokens": 1}, once="")
    with pytest.raises(ValidationError, match="keep_days"):
        Usage(MemoryStore(), keep_days=0)
    with pytest.raises(ValidationError, match="counter name"):
        request_counter("Bad Kind")


# -- --since ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "ago"), [("24h", 86400), ("7d", 7 * 86400), ("90m", 5400), ("2w", 14 * 86400),
                                           ("30s", 30), (" 1H ", 3600)])
def test_since_as_a_duration(text, ago):
    assert parse_since(text, now=1_000_000.0) == 1_000_000.0 - ago


@pytest.mark.parametrize(("text", "epoch"), [
    ("2026-07-13", 1_783_900_800), ("2026-07-13T05:00", 1_783_918_800), ("2026-07-13T05:00:00Z", 1_783_918_800),
    ("2026-07-13T07:00:00+02:00", 1_783_918_800),
])
def test_since_as_an_iso_time(text, epoch):
    assert parse_since(text) == epoch


@pytest.mark.parametrize("bad", ["", "yesterday", "24", "-3h", "2026-13-01", "h24"])
def test_a_bad_since_says_what_to_write(bad):
    with pytest.raises(ValidationError, match=r"is not a time: use a duration back from now \(90m, 24h, 7d, 2w\) or "
                                              r"an ISO-8601 date or time"):
        parse_since(bad)


# -- the Tinker API's billing views ----------------------------------------------------------------------------

def test_billing_usage_view_is_the_sdks_response():
    rows = [UsageRow("alice", "s1", H, {"training_tokens": 10, "sampled_tokens": 500, "requests_sample": 3}),
            UsageRow("alice", "", H, {"prefill_tokens": 40, "cached_prefill_tokens": 60, "checkpoints": 2,
                                      "checkpoint_bytes": 9}),
            UsageRow("alice", "s1", H + 3600, {"training_tokens": 7}),
            UsageRow("alice", "s1", H - 3600, {"training_tokens": 1}),  # before the window
            UsageRow("alice", "s2", H + 7200, {"training_tokens": 1})]  # at its (exclusive) end
    body = billing_usage_view(rows, starting_on=H, ending_before=H + 7200,
                              session_metadata={"s1": {"purpose": "rl"}})
    parsed = tinker_types.BillingUsageResponse.model_validate(json.loads(json.dumps(body)))
    got = [(e.bucket_start.timestamp(), e.session_id, e.event_info.type, getattr(e.event_info, "cached", None),
            getattr(e.event_info, "token_count", None) or getattr(e.event_info, "count", None)) for e in parsed.data]
    assert got == [  # by bucket, then descending token count (a checkpoint event has none: last)
        (H, "s1", "sampling_sample", None, 500), (H, None, "sampling_prefill", True, 60),
        (H, None, "sampling_prefill", False, 40), (H, "s1", "training", None, 10), (H, None, "checkpoint", None, 2),
        (H + 3600, "s1", "training", None, 7)]
    first = parsed.data[0]
    assert first.bucket_end.timestamp() == H + 3600 and first.user_id == first.user_name == "alice"
    assert first.base_model is None and first.estimated_cost_usd is None
    assert {sid: s.user_metadata for sid, s in parsed.sessions.items()} == {"s1": {"purpose": "rl"}}
    assert parsed.cost_data_through is None
    empty = billing_usage_view([], starting_on=H, ending_before=H + 3600)
    assert tinker_types.BillingUsageResponse.model_validate(empty).data == []


def test_checkpoint_storage_view_is_the_sdks_response():
    body = checkpoint_storage_view("alice", 3, 2_500_000_000)
    parsed = tinker_types.CurrentCheckpointStorageUsageResponse.model_validate(body)
    assert parsed.data[0].checkpoint_count == 3 and parsed.data[0].size_gigabytes == 2.5
    assert checkpoint_storage_view("alice", 0, 0)["data"] == []


def test_the_billing_window_is_checked_as_the_api_documents():
    sdk = tinker_types.GetBillingUsageRequest(starting_on="2026-07-13T00:00:00Z",
                                              ending_before="2026-07-14T00:00:00Z").model_dump(mode="json")
    start, end = billing_window(sdk["starting_on"], sdk["ending_before"], now=1_790_000_000)  # as the SDK sends it
    assert (start, end) == (1_783_900_800, 1_783_900_800 + 86400)
    now = 1_790_000_000
    for starting_on, ending_before, match in [
        ("2026-07-13T00:30:00Z", "2026-07-14T00:00:00Z", "hour boundary: use e.g. 2026-07-13T00:00:00Z"),
        ("soon", "2026-07-14T00:00:00Z", "not an RFC 3339 time"),
        ("2026-07-14T00:00:00Z", "2026-07-13T00:00:00Z", "must be after starting_on"),
        ("2026-07-01T00:00:00Z", "2026-07-16T00:00:00Z", "at most 14 days"),
        ("2027-01-01T00:00:00Z", "2027-01-02T00:00:00Z", "in the future"),
    ]:
        with pytest.raises(ValidationError, match=match):
            billing_window(starting_on, ending_before, now=now)


# -- tinkerq usage ------------------------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TINKERQ_BROKER_URL"}
    return subprocess.run([str(TINKERQ), *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`tinkerq ARGS` in this process (the console script itself takes a second or so each)."""
    from tinkerq.launcher.main import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_table_json_and_bad_since(redis_url: str, capsys: pytest.CaptureFixture[str]):
    client = redis.Redis.from_url(redis_url)
    usage, a, b = Usage(RedisStore(client)), _name(), _name()
    now = time.time()
    usage.record(a, "s1", {"training_tokens": 1000, "requests_forward_backward": 2}, at=now)
    usage.record(a, "s2", {"sampled_tokens": 50, "prefill_tokens": 300}, at=now - 3600)
    usage.record(b, "", {"checkpoints": 1, "checkpoint_bytes": 123456789}, at=now)

    out = _cli("usage", "--broker", redis_url, "--by", "session", "--since", "3h")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["KEY", "SESSION", "TRAINING", "PREFILL", "CACHED", "SAMPLED", "CHECKPOINTS",
                                "CKPT_BYTES", "REQUESTS"]
    assert len({len(line) for line in lines}) == 1  # aligned: numbers right-aligned to the header's width
    mine = {tuple(line.split()[:2]): line.split()[2:] for line in lines[1:-1] if line.split()[0] in (a, b)}
    assert mine == {(a, "s1"): ["1000", "0", "0", "0", "0", "0", "2"],
                    (a, "s2"): ["0", "300", "0", "50", "0", "0", "0"],
                    (b, "-"): ["0", "0", "0", "0", "1", "123456789", "0"]}
    assert lines[-1].split()[0] == "TOTAL"

    code, said, err = _main(capsys, "usage", "--broker", redis_url, "--key", a, "--by", "hour", "--json")
    assert code == 0, err
    report = json.loads(said)
    assert report["key"] == a and report["by"] == "hour" and report["since"].endswith("Z")
    assert [(r["hour"], r["key"], r["counts"]["training_tokens"]) for r in report["rows"]] == [
        (time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(now - 3600)), a, 0),
        (time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(now)), a, 1000)]
    assert report["totals"]["training_tokens"] == 1000 and report["totals"]["prefill_tokens"] == 300

    code, said, err = _main(capsys, "usage", "--broker", redis_url, "--since", "yesterday")
    assert code == 2 and said == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("tinkerq usage: [user error] --since 'yesterday' is not a time") and "24h" in err
    code, said, _ = _main(capsys, "usage", "--broker", redis_url, "--key", _name(), "--since", "2026-01-01")
    assert code == 0 and said.startswith("no usage recorded since 2026-01-01 00:00:00Z for key u-")
    client.close()


def test_the_tenants_index_is_read_at_most_once_a_minute_per_tenant(monkeypatch: pytest.MonkeyPatch):
    """Each answered request is recorded: a process that saw the tenants' index hold this hour for a tenant does
    not read it again for INDEX_KNOWN_S (one round trip less per request); past that it does, so an index Redis
    lost comes back."""
    from tinkerq import keys
    from tinkerq import usage as usage_module

    store, t = MemoryStore(), _name()
    usage = Usage(store)
    usage.record(t, "s", {"sampled_tokens": 1})
    assert {r.tenant for r in usage.rows()} == {t}
    store.delete(keys.USAGE_TENANTS)  # as a Redis that lost it
    usage.record(t, "s", {"sampled_tokens": 1})
    assert usage.rows() == []  # known to hold it: neither read nor written again
    assert {r.tenant for r in Usage(store).rows()} == set()
    Usage(store).record(t, "s", {"sampled_tokens": 1})  # another process reads it, and puts the tenant back
    assert {r.tenant for r in usage.rows()} == {t}
    store.delete(keys.USAGE_TENANTS)
    monkeypatch.setattr(usage_module, "INDEX_KNOWN_S", 0.0)  # what it knew is too old now: read, and put back
    usage.record(t, "s", {"sampled_tokens": 1})
    assert {r.tenant for r in usage.rows()} == {t}
    assert usage.totals(t)["sampled_tokens"] == 4
