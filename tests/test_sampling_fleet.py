"""Sampling across workers: published snapshots, `--role sampler` workers, saved weights, the base model,
and a sampling worker killed with requests in its batch."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import start_worker_process
from tests.helpers import make_batch
from tests.test_sampling import NEVER, PROMPT, post_sample
from tinkerq import errors, keys, types
from tinkerq.launcher.processes import wait_for
from tinkerq.wire import messages

pytestmark = pytest.mark.timeout(240)


def _records(conn, model: str) -> dict[str, dict]:
    return {r["worker"]: r for r in conn.workers_serving(model)}


@pytest.fixture(scope="module")
def sampler_worker(worker, model_dir: Path, redis_url: str, checkpoint_dir: Path,
                   tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """A second worker of the same model, `--role sampler`: (its id, its process, its log)."""
    from tinkerq.connection import Connection
    from tinkerq.settings import Settings

    log = tmp_path_factory.mktemp("sampler-logs") / "worker.log"
    conn = Connection.open(Settings(broker_url=redis_url))
    before = set(_records(conn, str(model_dir)))
    proc = start_worker_process(model_dir, redis_url, log, extra=["--role", "sampler"], env={
        "TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir), "TINKERQ_HEARTBEAT_S": "1"})
    wait_for(lambda: bool(set(_records(conn, str(model_dir))) - before), 90, "sampler worker", proc, log)
    (worker_id,) = set(_records(conn, str(model_dir))) - before
    assert _records(conn, str(model_dir))[worker_id]["role"] == "sampler"
    yield worker_id, proc, log
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)
    conn.close()


def _sample_on(service, worker: str, source: dict, seed: int, num: int = 3, max_tokens: int = 16):
    body = messages.encode_sample_request(source, PROMPT, num, types.SamplingParams(max_tokens=max_tokens, seed=seed))
    return post_sample(service, worker, body).result(timeout=120)


def _same(a: types.SampleResponse, b: types.SampleResponse) -> None:
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    for x, y in zip(a.sequences, b.sequences, strict=True):
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def _trained_snapshot(tc, seed: int):
    """One fb + optim_step on ``tc``, then a snapshot: (its sampling client, its source)."""
    tc.forward_backward(make_batch(np.random.default_rng(seed), 4))
    tc.optim_step(types.AdamParams(learning_rate=5e-2))
    sampler = tc.save_weights_and_get_sampling_client()
    return sampler, {"snapshot": sampler.sampler_id}


def test_second_worker_samples_a_published_snapshot_identically(service, sampler_worker):
    sampler_id, _, log = sampler_worker
    tc = service.create_training_client(service.get_server_capabilities().supported_models[0].model_name)
    try:
        assert tc.info.worker != sampler_id  # a sampler worker takes no training sessions
        sampler, source = _trained_snapshot(tc, 31)
        on_trainer = _sample_on(service, tc.info.worker, source, seed=11)
        on_sampler = _sample_on(service, sampler_id, source, seed=11)
        _same(on_trainer, on_sampler)
        assert "loaded published snapshot " + sampler.sampler_id in log.read_text()
        # Requests of one client spread over both workers (round robin), all from the same snapshot.
        outs = [sampler.sample(PROMPT, 3, types.SamplingParams(max_tokens=16, seed=11)) for _ in range(4)]
        for out in outs:
            _same(out.result(timeout=120), on_trainer)
    finally:
        tc.close()


def test_second_worker_samples_a_published_lora_snapshot_identically(service, sampler_worker, model_dir):
    """A LoRA snapshot travels as its adapter only and is sampled over the other worker's own base."""
    sampler_id, _, log = sampler_worker
    tc = service.create_lora_training_client(str(model_dir), rank=4, seed=3)
    try:
        sampler, source = _trained_snapshot(tc, 32)
        on_trainer = _sample_on(service, tc.info.worker, source, seed=12)
        on_sampler = _sample_on(service, sampler_id, source, seed=12)
        _same(on_trainer, on_sampler)
        assert f"loaded published snapshot {sampler.sampler_id} (a LoRA adapter" in log.read_text()
        base = _sample_on(service, sampler_id, {"base": True}, seed=12)
        assert [s.logprobs for s in base.sequences] != [s.logprobs for s in on_sampler.sequences]  # it adapts
    finally:
        tc.close()


def test_sampling_client_from_saved_weights_and_from_the_base_model(service, model_dir, checkpoint_dir):
    tc = service.create_training_client(str(model_dir))
    try:
        untrained = tc.save_weights_and_get_sampling_client()
        base = service.create_sampling_client(base_model=str(model_dir))
        assert base.get_base_model() == str(model_dir)
        params = types.SamplingParams(max_tokens=16, seed=21)
        _same(base.sample(PROMPT, 3, params).result(timeout=60), untrained.sample(PROMPT, 3, params).result(timeout=60))

        tc.forward_backward(make_batch(np.random.default_rng(32), 4))
        tc.optim_step(types.AdamParams(learning_rate=5e-2))
        path = tc.save_weights_for_sampler("for-sampling").result(timeout=60).path
        assert json.loads((Path(path) / "tinkerq_weights.json").read_text())["base_model"] == str(model_dir)
        saved = service.create_sampling_client(model_path=path)  # base model read from the directory
        trained = tc.save_weights_and_get_sampling_client()
        from_dir = saved.sample(PROMPT, 3, params).result(timeout=60)
        _same(from_dir, trained.sample(PROMPT, 3, params).result(timeout=60))
        base_again = base.sample(PROMPT, 3, params).result(timeout=60)
        assert [s.logprobs for s in from_dir.sequences] != [s.logprobs for s in base_again.sequences]
        assert tc.create_sampling_client(path).model_path == path

        with pytest.raises(errors.UserError, match=r"tinkerq_weights\.json"):
            service.create_sampling_client(model_path=str(checkpoint_dir / "missing"))
        outside = service.create_sampling_client(model_path="/etc", base_model=str(model_dir))
        err = outside.sample(PROMPT, 1, params).exception(timeout=30)
        assert isinstance(err, errors.UserError) and "outside" in err.message
        with pytest.raises(errors.UnknownModelError, match="no worker serves"):
            service.create_sampling_client(base_model="no-such-model")
    finally:
        tc.close()


def test_a_killed_sampling_worker_loses_no_request(service, sampler_worker, model_dir, redis_url):
    """kill -9 of a worker with sample requests in its batch and queue: they go to the other worker."""
    sampler_id, proc, _ = sampler_worker
    sampler = service.create_sampling_client(base_model=str(model_dir))
    params = types.SamplingParams(max_tokens=100, seed=41, stop=NEVER)
    futures = [sampler.sample(PROMPT, 4, params) for _ in range(8)]  # round robin: half to each worker
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    for future in futures:
        out = future.result(timeout=120)
        assert [len(s.tokens) for s in out.sequences] == [100] * 4
    # The reaper of the surviving worker removes the dead worker's intake list.
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        wait_for(lambda: not r.exists(keys.sample_queue(sampler_id)), 60, "dead worker's sample queue removed")
    finally:
        r.close()
