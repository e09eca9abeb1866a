"""Automatic snapshots: a worker killed with SIGKILL costs at most TINKERQ_AUTO_SNAPSHOT_STEPS steps.

The lost requests' WorkerLostError names the session's latest automatic snapshot; resuming from it on
another worker and sending the requests after it again gives bitwise the weights of a run never
interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.conftest import start_named_worker
from tests.helpers import make_batch
from tinkerq import errors, keys, types
from tinkerq.launcher.processes import wait_for
from tinkerq.producer import ServiceClient

pytestmark = pytest.mark.timeout(300)
ADAM = types.AdamParams(learning_rate=1e-2)
EVERY = 2  # TINKERQ_AUTO_SNAPSHOT_STEPS in these workers


def _worker(model_dir: Path, redis_url: str, name: str, checkpoint_dir: Path, log: Path):
    # Adoption off (no journal): this is the case where the caller resumes by hand (tests/test_adoption.py has
    # the automatic one).
    return start_named_worker(model_dir, redis_url, name, log, env={
        "TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir), "TINKERQ_AUTO_SNAPSHOT_STEPS": str(EVERY),
        "TINKERQ_JOURNAL_MAX_ENTRIES": "0"})


def _pairs(tc, batches) -> None:
    """fb + optim_step per batch, all submitted before any is awaited."""
    futures = [(tc.forward_backward(b, "cross_entropy"), tc.optim_step(ADAM)) for b in batches]
    for fb, step in futures:
        fb.result(timeout=120)
        step.result(timeout=120)


def _logprobs(tc, batch) -> list[np.ndarray]:
    out = tc.forward(batch, "cross_entropy").result(timeout=120)
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_killed_workers_session_resumes_exactly_from_its_automatic_snapshot(model_dir, redis_url, tmp_path, lora):
    name = f"snap-{uuid.uuid4().hex[:8]}"
    checkpoint_dir = tmp_path / "checkpoints"
    rng = np.random.default_rng(40)
    batches = [make_batch(rng, 2, max_len=16) for _ in range(5)]
    probe = make_batch(rng, 3, max_len=16)
    first = _worker(model_dir, redis_url, name, checkpoint_dir, tmp_path / "w1.log")
    sc = ServiceClient(broker_url=redis_url)
    second = None
    try:
        open_client = (lambda: sc.create_lora_training_client(name, rank=4, seed=3)) if lora else \
            (lambda: sc.create_training_client(name))
        tc = open_client().result(timeout=120)
        _pairs(tc, batches[:4])  # steps 2 and 4 are snapshotted: the latest is after request 8 (the 4th step)
        record = json.loads(redis.Redis.from_url(redis_url).get(keys.auto_snapshot(tc.model_id)))
        assert record["seq_id"] == 8 and Path(record["path"]).is_dir()
        _pairs(tc, batches[4:5])  # step 5: not snapshotted (every 2)

        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
        with pytest.raises(errors.WorkerLostError) as lost:
            tc.forward(probe, "cross_entropy").result(timeout=60)
        assert record["path"] in str(lost.value) and "request 8" in str(lost.value)

        second = _worker(model_dir, redis_url, name, checkpoint_dir, tmp_path / "w2.log")
        resumed = sc.create_training_client_from_state_with_optimizer(record["path"]).result(timeout=120)
        _pairs(resumed, batches[4:5])  # the requests after the snapshot, sent again
        fresh = open_client().result(timeout=120)  # the uninterrupted run, on the same worker
        _pairs(fresh, batches)
        for got, want in zip(_logprobs(resumed, probe), _logprobs(fresh, probe), strict=True):
            np.testing.assert_array_equal(got, want)  # bitwise: CPU, one thread, the same requests

        # Closing a session removes its snapshot: the record and the directory.
        store = redis.Redis.from_url(redis_url)
        fresh_record = json.loads(store.get(keys.auto_snapshot(fresh.model_id)))
        assert Path(fresh_record["path"]).is_dir()
        fresh.close()
        assert store.get(keys.auto_snapshot(fresh.model_id)) is None
        assert not Path(fresh_record["path"]).exists()
        resumed.close()
    finally:
        sc.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)


def test_users_cannot_write_over_the_automatic_snapshot(training_client):
    with pytest.raises(errors.ValidationError, match="not starting with"):
        training_client.save_state(".auto").result(timeout=60)


def test_a_deterministic_worker_trains_and_samples_with_the_same_numbers(model_dir, redis_url, tmp_path):
    """TINKERQ_DETERMINISTIC=1 (for bitwise replays of bfloat16 on GPUs) turns torch's deterministic algorithms
    on; every kernel a worker uses has one on the CPU, and the numbers do not change."""
    import subprocess
    import sys

    code = ("import torch; from tinkerq.settings import Settings; "
            "from tinkerq.worker.loading.models import configure_torch; "
            "configure_torch(Settings(deterministic=1), 1); print(torch.are_deterministic_algorithms_enabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"

    rng = np.random.default_rng(41)
    batches = [make_batch(rng, 2, max_len=16) for _ in range(2)]
    probe = make_batch(rng, 2, max_len=16)
    results = []
    for deterministic in ("1", "0"):
        name = f"det-{deterministic}-{uuid.uuid4().hex[:6]}"
        proc = start_named_worker(model_dir, redis_url, name, tmp_path / f"{name}.log",
                                  env={"TINKERQ_DETERMINISTIC": deterministic})
        sc = ServiceClient(broker_url=redis_url)
        try:
            tc = sc.create_lora_training_client(name, rank=4, seed=2).result(timeout=120)
            _pairs(tc, batches)
            sampler = tc.save_weights_and_get_sampling_client().result(timeout=120)
            tokens = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2,
                                    types.SamplingParams(max_tokens=5, seed=9)).result(timeout=120)
            results.append((_logprobs(tc, probe), [s.tokens for s in tokens.sequences]))
            tc.close()
        finally:
            sc.close()
            proc.terminate()
            proc.wait(30)
    (det_logprobs, det_tokens), (logprobs, tokens_) = results
    assert det_tokens == tokens_
    for got, want in zip(det_logprobs, logprobs, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sampling_snapshots_outlive_their_worker_once_snapshotted(model_dir, redis_url, tmp_path, lora):
    """The automatic snapshot publishes the session's sampling snapshots: after its worker is killed, another
    worker samples them (the same tokens) without asking the dead owner."""
    name = f"pub-{uuid.uuid4().hex[:8]}"
    checkpoint_dir = tmp_path / "checkpoints"
    rng = np.random.default_rng(42)
    first = _worker(model_dir, redis_url, name, checkpoint_dir, tmp_path / "w1.log")
    second = _worker(model_dir, redis_url, name, checkpoint_dir, tmp_path / "w2.log")
    sc = ServiceClient(broker_url=redis_url)
    try:
        # start_named_worker returns once the name is served: by the first worker already. Wait for both.
        wait_for(lambda: len(sc.connection.workers_serving(name)) == 2, 120, "the second worker", second,
                 tmp_path / "w2.log")
        tc = (sc.create_lora_training_client(name, rank=4, seed=4) if lora else sc.create_training_client(name))
        tc = tc.result(timeout=120)
        _pairs(tc, [make_batch(rng, 2, max_len=16)])
        sampler = tc.save_weights_and_get_sampling_client().result(timeout=120)
        prompt, params = types.ModelInput.from_ints([3, 4, 5]), types.SamplingParams(max_tokens=6, seed=11)
        before = [s.tokens for s in sampler.sample(prompt, 2, params).result(timeout=120).sequences]
        _pairs(tc, [make_batch(rng, 2, max_len=16)])  # step 2: the automatic snapshot, which publishes it
        from tinkerq.wire import codec

        record = redis.Redis.from_url(redis_url)
        wait_for(lambda: {"weights", "file"} & set(codec.unpackb(record.get(keys.snapshot(sampler.sampler_id)))),
                 60, "the sampler's weights to be published")
        pid = next(r["pid"] for r in sc.connection.workers_serving(name) if r["worker"] == tc.info.worker)
        holder = first if first.pid == pid else second
        assert holder.pid == pid
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
        # Answered without the dead owner: a worker that had to ask it to publish the weights would wait
        # worker/sampling/snapshots.py's PUBLISH_WAIT_S (60 s) and answer WorkerError ("did not publish it"), which
        # result() would raise. The timeout is only a hang guard, above that wait.
        after = [s.tokens for s in sampler.sample(prompt, 2, params).result(timeout=120).sequences]
        assert after == before
    finally:
        sc.close()
        for proc in (first, second):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
