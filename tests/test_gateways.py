"""Several gateways serve one fleet: the official SDK (0.38.0) alternates between two real `tinkerq gateway`
processes on every call (tests/alternating_proxy.py), and keeps going when one of them is killed mid-run.

Every record and future lives in Redis (gateway/futures.py): a poll of a future made by another gateway is
answered, and a dead gateway's pending futures are adopted by the gateway that polls them next.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.alternating_proxy import AlternatingProxy
from tests.conftest import start_named_worker
from tests.helpers import make_batch
from tests.test_gateway import result, sdk_batch, start_gateway
from tinkerq import types
from tinkerq.gateway.records import Records
from tinkerq.keys import gateway_answer, gateway_record, session_home
from tinkerq.launcher.processes import free_port
from tinkerq.settings import Settings
from tinkerq.store import RedisStore
from tinkerq.tenants import ApiKeys

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.timeout(300)
NAME = "tinkerq-test/two-gateways"
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}


@pytest.fixture(scope="module")
def worker(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[subprocess.Popen]:
    log = tmp_path_factory.mktemp("logs") / "two-gateways-worker.log"
    proc = start_named_worker(model_dir, redis_url, NAME, log, env={"TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir)})
    yield proc
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def key(redis_url: str) -> Iterator[str]:
    api_keys = ApiKeys.open(Settings(broker_url=redis_url))
    yield api_keys.create(f"two-gw-{os.getpid()}")
    api_keys.close()


@pytest.fixture
def gateways(redis_url: str, worker, tmp_path: Path) -> Iterator[tuple[list[subprocess.Popen], AlternatingProxy]]:
    started = [start_gateway(redis_url, tmp_path / f"gw{i}.log") for i in range(2)]
    proxy = AlternatingProxy([url for _, url in started], free_port()).start()
    yield [proc for proc, _ in started], proxy
    proxy.stop()
    for proc, _ in started:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


def library_run(redis_url: str, chunks: list[list[types.Datum]]) -> tuple[float, float]:
    """The producer library's numbers for the same rank-4 LoRA run: the first step's loss, and the forward loss
    of ``chunks[0]`` after one AdamW step on every chunk."""
    from tinkerq.producer import ServiceClient

    ours = ServiceClient(broker_url=redis_url)
    try:
        tc = ours.create_lora_training_client(NAME, rank=4, seed=5).result(timeout=120)
        first = [tc.forward_backward(chunk, "cross_entropy") for chunk in chunks]
        tc.optim_step(types.AdamParams(**ADAM)).result(timeout=120)
        after = tc.forward(chunks[0], "cross_entropy").result(timeout=120).metrics["loss:sum"]
        tc.close()
        return first[0].result(timeout=120).metrics["loss:sum"], after
    finally:
        ours.close()


def sdk_run(tc, chunks: list[list[types.Datum]], between=None) -> tuple[float, float]:
    """The same run through the SDK; ``between()`` runs once the first forward_backward is submitted."""
    first = tc.forward_backward(sdk_batch(chunks[0]), "cross_entropy")
    if between is not None:
        between()
    rest = [tc.forward_backward(sdk_batch(chunk), "cross_entropy") for chunk in chunks[1:]]
    loss = first.result(timeout=120).metrics["loss:sum"]
    for f in rest:
        f.result(timeout=120)
    tc.optim_step(tinker.AdamParams(**ADAM)).result(timeout=120)
    return loss, tc.forward(sdk_batch(chunks[0]), "cross_entropy").result(timeout=120).metrics["loss:sum"]


def test_the_sdk_alternating_between_two_gateways(gateways, key, redis_url, monkeypatch):
    """Every call goes to the other gateway than the one before: the run's numbers equal the library's, and a
    sampler made through one gateway samples through the other."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    _, proxy = gateways
    chunks = [make_batch(np.random.default_rng(40 + i), 2, max_len=12) for i in range(2)]
    sc = tinker.ServiceClient(base_url=proxy.url, api_key=key)
    tc = sc.create_lora_training_client(NAME, rank=4, seed=5).result(timeout=120)
    got = sdk_run(tc, chunks)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=120)
    out = sampler.sample(prompt=tinker.ModelInput.from_ints([1, 2, 3]), num_samples=2,
                         sampling_params=tinker.SamplingParams(max_tokens=4, seed=1)).result(timeout=120)
    assert len(out.sequences) == 2 and all(len(s.tokens) == 4 for s in out.sequences)
    assert got == pytest.approx(library_run(redis_url, chunks), rel=1e-6)
    polls = {gw for path, gw in proxy.log if path.endswith("/retrieve_future")}
    submits = {gw for path, gw in proxy.log if path.endswith("/forward_backward")}
    assert len(polls) == 2 and len(submits) == 2, proxy.log


def test_a_gateway_killed_mid_run_loses_nothing(gateways, worker, key, redis_url, tmp_path, monkeypatch):
    """The gateway that took a forward_backward is killed (-9) before the worker answers it: the SDK's polls
    reach the other gateway, which adopts the future, and the run goes on with the numbers of an uninterrupted
    run (the re-post was answered from the worker's kept reply, not applied twice)."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    procs, proxy = gateways
    chunks = [make_batch(np.random.default_rng(50 + i), 2, max_len=12) for i in range(2)]
    sc = tinker.ServiceClient(base_url=proxy.url, api_key=key)
    tc = sc.create_lora_training_client(NAME, rank=4, seed=5).result(timeout=120)
    killed: list[int] = []

    def kill_the_gateway_that_took_it() -> None:
        os.kill(worker.pid, signal.SIGSTOP)  # the answer cannot come before the kill
        try:
            deadline = time.monotonic() + 30
            while not any(path.endswith("/forward_backward") for path, _ in proxy.log):
                assert time.monotonic() < deadline, "the SDK never submitted its forward_backward"
                time.sleep(0.02)
            taker = next(gw for path, gw in proxy.log if path.endswith("/forward_backward"))
            index = proxy.backends.index(taker)
            procs[index].kill()
            procs[index].wait(10)
            killed.append(index)
        finally:
            os.kill(worker.pid, signal.SIGCONT)

    got = sdk_run(tc, chunks, between=kill_the_gateway_that_took_it)
    assert got == pytest.approx(library_run(redis_url, chunks), rel=1e-6)
    survivor_log = (tmp_path / f"gw{1 - killed[0]}.log").read_text()
    assert "adopting ForwardBackward request" in survivor_log, survivor_log[-3000:]


def test_a_create_run_again_by_another_gateway_opens_no_second_worker_session(gateways, key, redis_url, monkeypatch):
    """A gateway that dies after the worker built a run's session but before it recorded the run: the gateway
    that adopts the create gets that same worker session back (its id comes from the run's), not a second one
    left open on the worker with nobody to use or close it."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    _, proxy = gateways
    sc = tinker.ServiceClient(base_url=proxy.url, api_key=key)
    model_id = sc.create_lora_training_client(NAME, rank=4, seed=5).result(timeout=120).model_id
    store = RedisStore(redis.Redis.from_url(redis_url))
    records = Records(store)
    request_id = records.get_claim(f"create:{model_id}")
    future = json.loads(store.get(gateway_record("future", request_id)))
    run = json.loads(store.get(gateway_record("run", model_id)))
    homes = set(store.scan(session_home("*")))
    # What a gateway killed between the worker's answer and add_run leaves: the future, no run, no answer.
    store.delete(gateway_record("run", model_id))
    store.delete(gateway_answer(request_id))
    future["owner"] = "gw-killed-before-it-recorded-the-run"
    store.set(gateway_record("future", request_id), json.dumps(future).encode(), 600)
    answer = result(proxy.backends[1], key, request_id)  # the poll adopts the create and runs it again
    assert answer.status_code == 200 and answer.json()["model_id"] == model_id, answer.text
    again = json.loads(store.get(gateway_record("run", model_id)))
    assert again["info"]["model_id"] == run["info"]["model_id"]  # the same worker session
    assert set(store.scan(session_home("*"))) <= homes  # and no new one anywhere
