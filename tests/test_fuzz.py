"""A worker fed thousands of hostile messages keeps serving: nothing it reads can stop it (issue: hardening)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.fuzz_messages import KINDS, base_message, fuzz_messages
from tests.helpers import make_batch
from tinkerq import keys
from tinkerq.launcher.processes import ROOT, wait_for
from tinkerq.wire import codec, messages
from tinkerq.worker import memory

pytestmark = pytest.mark.timeout(240)

PER_QUEUE = 2600  # >= 5000 messages in all


def rss_mb(pid: int) -> float:
    return memory.rss_bytes(pid) / 2**20


def _reply(r: redis.Redis, task_id: str) -> dict | None:
    raw = r.get(keys.reply(task_id))
    return None if raw is None else codec.unpackb(raw)


def test_worker_survives_thousands_of_hostile_messages(training_client, worker, redis_url, model_dir):
    tc = training_client
    r = redis.Redis.from_url(redis_url)
    probe = make_batch(np.random.default_rng(70), 3)
    before = tc.forward(probe).result(timeout=60)
    rss_before = rss_mb(worker.pid)
    inbox = tc.service._dispatch.inbox
    worker_queue, model_queue = tc._queue, keys.model_queue(str(model_dir))
    batch = (fuzz_messages(0, PER_QUEUE, inbox, worker_queue)
             + fuzz_messages(1, PER_QUEUE, inbox, model_queue))
    assert {kind for kind, _ in batch} == set(KINDS)

    # A poison message delivered again and again (as kombu restores one after a crash): dead-lettered by the
    # (max_deliveries + 1)-th delivery, before it is processed again.
    poison = base_message(inbox, worker_queue)
    poison["headers"]["redelivered"] = True
    poison["properties"]["delivery_info"]["redelivered"] = True
    poison_raw = json.dumps(poison).encode()

    # Answered to the sender when its task id and inbox can be read: a pickle message, a foreign task name.
    answered = {}
    for name, patch in (("pickle", ("content-type", "application/x-python-serialize")),
                        ("chord", ("task", "celery.chord_unlock"))):
        m = base_message(inbox, worker_queue)
        target = m if name == "pickle" else m["headers"]
        target[patch[0]] = patch[1]
        answered[m["headers"]["id"]] = json.dumps(m).encode()

    started = time.monotonic()
    pipe = r.pipeline(transaction=False)
    for i, (_, raw) in enumerate(batch):
        pipe.lpush(worker_queue if i < PER_QUEUE else model_queue, raw)
        if i % 500 == 499:
            pipe.execute()
    for raw in answered.values():
        pipe.lpush(worker_queue, raw)
    for _ in range(5):
        pipe.lpush(worker_queue, poison_raw)
    pipe.execute()

    wait_for(lambda: r.llen(worker_queue) == 0 and r.llen(model_queue) == 0, 120, "the worker to drain its queues",
             worker, worker.log_path)
    drained = time.monotonic() - started
    assert worker.poll() is None, "the worker process died"

    # It keeps answering, and the open session is bitwise what it was.
    after = tc.forward(probe).result(timeout=60)
    assert after.metrics == before.metrics
    for a, b in zip(before.loss_fn_outputs, after.loss_fn_outputs, strict=True):
        assert np.array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())
    # Still registered and beating (its consumer loop runs).
    assert [m.model_name for m in tc.service.get_server_capabilities().supported_models] == [str(model_dir)]
    beat = r.zscore(keys.HEARTBEATS, tc.info.worker)
    assert beat is not None
    wait_for(lambda: (r.zscore(keys.HEARTBEATS, tc.info.worker) or 0) > beat, 30, "a heartbeat after the flood",
             worker, worker.log_path)

    for task_id in answered:
        reply = _reply(r, task_id)
        assert reply is not None and reply["ok"] is False, task_id
        assert reply["error"]["category"] == "user" and "refused" in reply["error"]["message"]
    # The poison's copies past max_deliveries were dead-lettered with that reason (the worker's log: the dead-letter
    # list keeps the newest 1,000, and the model queue's flood may still be going past it). Its answer is an error
    # either way: the intake may take all five copies in one pop (TINKERQ_INTAKE_BATCH), so the dead-letter answer of
    # a late copy can come before the refusal of an early one, which then replaces it.
    poison_id = poison["headers"]["id"]
    assert _reply(r, poison_id)["ok"] is False
    refused = [line for line in worker.log_path.read_text(errors="replace").splitlines()
               if "dead-lettered" in line and f"(task id {poison_id}," in line]
    assert sorted(int(re.search(r"delivered (\d+) times without being answered", line).group(1))
                  for line in refused) == [4, 5], refused

    # Dead letters are kept, bounded, with reasons and bytes, and readable from the CLI.
    dead = r.llen(keys.DEAD_LETTERS)
    assert 0 < dead <= 1000
    newest = codec.unpackb(r.lindex(keys.DEAD_LETTERS, 0))
    assert newest["reason"] and isinstance(newest["raw"], bytes) and newest["worker"] == tc.info.worker
    cli = subprocess.run([sys.executable, "-m", "tinkerq.launcher.main", "dead", "--broker", redis_url,
                          "list", "--limit", "3"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and f"{dead} dead letter(s)" in cli.stdout, cli.stderr
    log = worker.log_path.read_text()
    assert "Unrecoverable error" not in log

    rss_after = rss_mb(worker.pid)
    print(f"\n{len(batch) + 7} messages drained in {drained:.1f} s; worker RSS {rss_before:.0f} MB -> "
          f"{rss_after:.0f} MB; {dead} dead letters kept")
    assert rss_after < rss_before + 64, (rss_before, rss_after)


def test_a_forged_model_id_is_refused_and_writes_nothing(training_client, checkpoint_dir, tmp_path):
    """create_model / save_state with a path-like model_id: refused before any file is touched."""
    from tests.helpers import send_raw

    tc = training_client
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    before = sorted(p.name for p in Path(checkpoint_dir).iterdir())
    for model_id in (f"../../{outside.name}", str(outside), "A" * 32, uuid.uuid4().hex + "/x"):
        for op, body in (("create_model", {"base_model": tc.info.base_model}), ("save_state", {"name": "x"}),
                         ("save_weights_for_sampler", {"name": "x"})):
            envelope = messages.make_envelope(op, model_id, 1, {"inline": codec.packb(body)})
            err = send_raw(tc, op, envelope).exception(timeout=30)
            assert err is not None and err.category == "user" and "model_id" in err.message, (op, model_id, err)
    # Malformed at tinkerq's own layer: answered (above) and kept as dead letters too.
    r = redis.Redis.from_url(tc.service.settings.broker_url)
    newest = codec.unpackb(r.lindex(keys.DEAD_LETTERS, 0))
    assert "model_id" in newest["reason"] and newest["queue"].startswith("task tinkerq.")
    assert sorted(p.name for p in Path(checkpoint_dir).iterdir()) == before
    assert [p.name for p in outside.iterdir()] == ["keep"] and (outside / "keep").read_text() == "mine"
