"""Quotas, backpressure, usage and revocation per API key, through a real gateway, worker and Redis, with the
official SDK (0.38.0) where it is the client: its own queue-state logger and its own 429 retries.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.conftest import start_named_worker
from tests.helpers import make_batch
from tests.test_gateway import ADAM, fb_proto, post, result, sdk_batch
from tinkerq import keys
from tinkerq.launcher.processes import free_port, gateway_command, gateway_up, start_process, wait_for
from tinkerq.quotas import Limits
from tinkerq.settings import Settings
from tinkerq.store import RedisStore
from tinkerq.tenants import ApiKeys
from tinkerq.usage import Usage

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.timeout(240)
NAME = "tinkerq-test/limits"


@pytest.fixture(scope="module")
def worker(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[subprocess.Popen]:
    log = tmp_path_factory.mktemp("logs") / "limits-worker.log"
    # Four LoRA sessions fill it: a fifth create waits for room (paused_capacity).
    proc = start_named_worker(model_dir, redis_url, NAME, log, env={
        "TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir), "TINKERQ_MAX_LORA_SESSIONS": "4"})
    yield proc
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def gateway(redis_url: str, worker, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("logs") / "limits-gateway.log"
    port = free_port()
    proc = start_process(gateway_command(redis_url, port), log, {"TINKERQ_GATEWAY_POLL_S": "1",
                                                                 "TINKERQ_GATEWAY_SESSION_STALE_S": "4"})
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: gateway_up(url), 60, "tinkerq gateway", proc, log)
    yield url, log
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def api_keys(redis_url: str) -> Iterator[ApiKeys]:
    made = ApiKeys.open(Settings(broker_url=redis_url))
    yield made
    made.close()


def new_key(api_keys: ApiKeys, **limits: int) -> tuple[str, str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    return name, api_keys.create(name, Limits(**limits))


@pytest.fixture(autouse=True)
def _quiet_sdk(monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


def create_run(url: str, key: str, session: str, n: int) -> dict:
    return post(url, "create_model", key, {"session_id": session, "model_seq_id": n, "base_model": NAME,
                                           "lora_config": {"rank": 2, "seed": n}}).json()


def poll_once(url: str, key: str, request_id: str):
    return post(url, "retrieve_future", key, {"request_id": request_id, "allow_metadata_only": False})


def test_token_rate_holds_requests_in_order_and_the_sdk_logs_paused_rate_limit(gateway, api_keys, caplog,
                                                                                monkeypatch):
    """Over max_tokens_per_minute, a forward_backward waits (polls say paused_rate_limit, which the SDK's own
    QueueStateLogger reports), and the run's next requests wait behind it: nothing is dropped or reordered."""
    import tinker.lib.queue_state_logger as qsl

    monkeypatch.setattr(qsl, "PAUSE_GRACE_PERIOD", 0)  # the SDK reports a pause after 15 min; here at once
    url, _ = gateway
    big = make_batch(np.random.default_rng(60), 8, min_len=30, max_len=31)
    small = make_batch(np.random.default_rng(61), 1, min_len=20, max_len=21)
    limit = sum(d.model_input.length for d in big)  # the first request empties the bucket
    _, key = new_key(api_keys, max_tokens_per_minute=limit)
    tc = (tinker.ServiceClient(base_url=url, api_key=key)
          .create_lora_training_client(NAME, rank=2, seed=1).result(timeout=120))
    tc.forward_backward(sdk_batch(big), "cross_entropy").result(timeout=60)
    with caplog.at_level(logging.WARNING, logger=qsl.__name__):
        start = time.monotonic()
        held = tc.forward_backward(sdk_batch(small), "cross_entropy")
        step = tc.optim_step(tinker.AdamParams(**ADAM))
        out = held.result(timeout=60)
        step.result(timeout=60)
        waited = time.monotonic() - start
    # 20 tokens at limit/60 tokens per second: seconds, not minutes (a bound, not a timing to meet).
    assert waited >= 60 * 20 / limit * 0.5, waited
    assert out.metrics["loss:sum"] > 0
    paused = [r.getMessage() for r in caplog.records if "is paused" in r.getMessage()]
    assert paused and "max_tokens_per_minute" in paused[0], caplog.text


def test_sampling_over_its_inflight_cap_gets_429_and_the_sdk_retries(gateway, api_keys):
    url, log = gateway
    _, key = new_key(api_keys, max_sampling_inflight=1)
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    sampler = sc.create_sampling_client(base_model=NAME).result(timeout=120)
    # Long enough that the first is still sampling when the others arrive, even on a loaded machine (with 16
    # tokens each, one CI run saw every request finish before the next one came, and no 429).
    params = tinker.SamplingParams(max_tokens=128, seed=3)
    futures = [sampler.sample(prompt=tinker.ModelInput.from_ints([1, 2, 3 + i]), num_samples=2,
                              sampling_params=params) for i in range(6)]
    outs = [f.result(timeout=120) for f in futures]
    assert all(len(o.sequences) == 2 for o in outs)
    assert "/asample -> 429" in log.read_text() and "max_sampling_inflight" in log.read_text()


def test_training_clients_over_the_cap_wait_for_an_unload(gateway, api_keys):
    url, _ = gateway
    _, key = new_key(api_keys, max_training_clients=1)
    session = post(url, "create_session", key, {}).json()["session_id"]
    first = result(url, key, create_run(url, key, session, 0)["request_id"]).json()["model_id"]
    second = create_run(url, key, session, 1)["request_id"]
    waiting = poll_once(url, key, second)
    assert waiting.status_code == 408 and waiting.json()["queue_state"] == "paused_rate_limit", waiting.text
    assert "max_training_clients" in waiting.json()["queue_state_reason"]
    result(url, key, post(url, "unload_model", key, {"model_id": first}).json()["request_id"])
    made = result(url, key, second).json()
    assert made["type"] == "create_model", made
    result(url, key, post(url, "unload_model", key, {"model_id": made["model_id"]}).json()["request_id"])


def test_a_full_fleet_makes_creates_wait_with_paused_capacity(gateway, api_keys):
    """The worker holds its maximum of LoRA sessions: a create waits (paused_capacity, with the worker's reason)
    instead of failing, and goes on once a session is unloaded."""
    url, _ = gateway
    _, key = new_key(api_keys)
    session = post(url, "create_session", key, {}).json()["session_id"]
    held: list[str] = []  # sessions made until the worker is full (earlier tests' runs may hold slots too)
    for n in range(5):
        third = create_run(url, key, session, n)["request_id"]
        deadline = time.monotonic() + 30
        while (r := poll_once(url, key, third)).status_code == 408 and r.json()["queue_state"] == "active":
            assert time.monotonic() < deadline, r.text
        if r.status_code != 200:
            break
        held.append(r.json()["model_id"])
    assert r.status_code == 408 and r.json()["queue_state"] == "paused_capacity", r.text
    assert "TINKERQ_MAX_LORA_SESSIONS" in r.json()["queue_state_reason"]
    result(url, key, post(url, "unload_model", key, {"model_id": held[0]}).json()["request_id"])
    made = result(url, key, third).json()
    assert made["type"] == "create_model", made
    for model_id in [*held[1:], made["model_id"]]:
        result(url, key, post(url, "unload_model", key, {"model_id": model_id}).json()["request_id"])


def test_usage_totals_are_exactly_what_the_sdk_sent(gateway, api_keys, redis_url):
    url, _ = gateway
    tenant, key = new_key(api_keys, keep_checkpoints=1)
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(NAME, rank=2, seed=2).result(timeout=120)
    batches = [make_batch(np.random.default_rng(70 + i), 3, max_len=16) for i in range(3)]
    for batch in batches:
        tc.forward_backward(sdk_batch(batch), "cross_entropy").result(timeout=60)
    tc.forward(sdk_batch(batches[0]), "cross_entropy").result(timeout=60)
    paths = [tc.save_weights_for_sampler(name=f"u{i}").result(timeout=60).path for i in range(2)]
    sampler = sc.create_sampling_client(model_path=paths[-1]).result(timeout=120)
    out = sampler.sample(prompt=tinker.ModelInput.from_ints([5, 6, 7, 8]), num_samples=3,
                         sampling_params=tinker.SamplingParams(max_tokens=5, seed=4)).result(timeout=60)
    assert out.prompt_cache_hit_tokens == 0
    store = redis.Redis.from_url(redis_url)
    totals = Usage(RedisStore(store)).totals(tenant)
    assert totals["training_tokens"] == sum(d.model_input.length for b in [*batches, batches[0]] for d in b)
    assert totals["prefill_tokens"] == 4 and totals["cached_prefill_tokens"] == 0
    assert totals["requests_forward_backward"] == 3 and totals["requests_forward"] == 1
    assert totals["requests_sample"] == 1
    assert totals["sampled_tokens"] == sum(len(s.tokens) for s in out.sequences)
    assert totals["checkpoints"] == 2 and totals["checkpoint_bytes"] > 0
    # keep_checkpoints=1: the older sampler checkpoint went, on disk and from the run's list.
    listed = tinker.RestClient(base_url=url, api_key=key).list_checkpoints(tc.model_id).result(timeout=30).checkpoints
    assert [c.tinker_path for c in listed] == [paths[-1]]
    # The SDK's own billing call reads the same numbers.
    hour = time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime())
    later = time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(time.time() + 3600))
    events = tinker.AdminClient(base_url=url, api_key=key).get_billing_usage(hour, later).result(timeout=30)
    training = sum(e.event_info.token_count for e in events.data if e.event_info.type == "training")
    assert training == totals["training_tokens"]
    store.close()


def test_revoking_a_key_ends_its_sessions_on_the_workers(gateway, api_keys, redis_url, capsys):
    from tinkerq.launcher.main import main

    url, _ = gateway
    tenant, key = new_key(api_keys)
    session = post(url, "create_session", key, {}).json()["session_id"]
    model_id = result(url, key, create_run(url, key, session, 0)["request_id"]).json()["model_id"]
    r = post(url, "forward_backward", key, fb_proto(model_id, 1, make_batch(np.random.default_rng(80), 1)),
             proto=True)
    assert result(url, key, r.json()["request_id"]).status_code == 200
    store = redis.Redis.from_url(redis_url)
    worker_session = json.loads(store.get(keys.gateway_record("run", model_id)))["info"]["model_id"]
    assert store.get(keys.session_home(worker_session)) is not None
    assert main(["keys", "revoke", tenant, "--broker", redis_url]) == 0
    assert "closed 1 training run(s)" in capsys.readouterr().out
    assert store.get(keys.session_home(worker_session)) is None  # the worker's memory is free
    store.close()
    time.sleep(1.2)  # the gateway's key cache (1 s)
    assert post(url, "get_info", key, {"model_id": model_id}).status_code == 401


def test_a_silent_session_gives_its_client_slot_back(gateway, api_keys):
    """An SDK process that exited without unloading stops heartbeating: at the key's cap, its run is closed to
    make room (TINKERQ_GATEWAY_SESSION_STALE_S, 4 s here)."""
    url, _ = gateway
    _, key = new_key(api_keys, max_training_clients=1)
    gone = post(url, "create_session", key, {}).json()["session_id"]
    result(url, key, create_run(url, key, gone, 0)["request_id"])
    live = post(url, "create_session", key, {}).json()["session_id"]
    request_id = create_run(url, key, live, 0)["request_id"]
    deadline = time.monotonic() + 60
    while (r := poll_once(url, key, request_id)).status_code == 408:
        post(url, "session_heartbeat", key, {"session_id": live})
        assert time.monotonic() < deadline, r.text
    assert r.json()["type"] == "create_model", r.text
    result(url, key, post(url, "unload_model", key, {"model_id": r.json()["model_id"]}).json()["request_id"])


def test_a_flood_of_polls_is_bounded_and_disturbs_no_one(gateway, api_keys):
    """64 concurrent polls of one held future each get one answer (try_again with its queue_state, or the
    result), another tenant's requests go on meanwhile, and the other tenant cannot see the future (404)."""
    from concurrent.futures import ThreadPoolExecutor

    url, _ = gateway
    big = make_batch(np.random.default_rng(90), 8, min_len=30, max_len=31)
    _, key = new_key(api_keys, max_tokens_per_minute=sum(d.model_input.length for d in big))
    _, other = new_key(api_keys)
    session = post(url, "create_session", key, {}).json()["session_id"]
    model_id = result(url, key, create_run(url, key, session, 0)["request_id"]).json()["model_id"]
    first = post(url, "forward_backward", key, fb_proto(model_id, 1, big), proto=True).json()["request_id"]
    held = post(url, "forward_backward", key, fb_proto(model_id, 2, big[:1]), proto=True).json()["request_id"]
    with ThreadPoolExecutor(64) as pool:
        polls = [pool.submit(poll_once, url, key, held) for _ in range(64)]
        other_session = post(url, "create_session", other, {}).json()["session_id"]
        other_run = result(url, other, create_run(url, other, other_session, 0)["request_id"]).json()
        assert other_run["type"] == "create_model"
        answers = [p.result(timeout=60) for p in polls]
    assert {a.status_code for a in answers} <= {200, 408}
    assert any(a.status_code == 408 and a.json()["queue_state"] == "paused_rate_limit" for a in answers)
    assert poll_once(url, other, held).status_code == 404
    assert result(url, key, first).status_code == 200 and result(url, key, held).status_code == 200
    for k, m in ((key, model_id), (other, other_run["model_id"])):
        result(url, k, post(url, "unload_model", k, {"model_id": m}).json()["request_id"])
