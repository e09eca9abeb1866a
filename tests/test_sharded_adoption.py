"""Adoption of sharded sessions: a shard group's training session survives the loss of a shard or of the group.

Real processes: two `tinkerq worker` ranks (gloo on the CPU), a real redis-server, and unsharded workers. The
group journals every request and snapshots every EVERY optimizer steps (worker/recovery/). The run submits
FIRST pairs (forward_backward + optim_step) and waits for them (a snapshot after request 2 * EVERY, and
journaled requests after it), then submits the rest, pipelined, and kills at once, while they are pending:

* rank 1 (restarted by the test, as its supervisor would): rank 0 holds the session (full, or LoRA), and once
  the group has re-formed re-makes it from the snapshot + journal and runs the waiting requests, the interrupted
  one again;
* rank 0 (its follower exits): an unsharded worker of the model adopts the session;
* rank 1, never restarted: after TINKERQ_ADOPT_TIMEOUT_S rank 0 hands the session to an unsharded worker.

Every future answers without user action, each optimizer step once, and the final weights equal those of an
uninterrupted run of the same requests on an unsharded worker (within 1e-5: shards reduce in another order).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.conftest import WORKER_MICROBATCH_TOKENS, start_named_worker
from tests.helpers import make_batch, max_weight_diff
from tests.test_sharding import COLLECTIVE_TIMEOUT_S, ShardGroup
from tinkerq import keys, types
from tinkerq.launcher.processes import wait_for

pytestmark = pytest.mark.timeout(420)
ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01)
# LoRA's B starts at zero: AdamW's default eps (1e-12) would turn the shards' rounding into whole steps.
LORA_ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, eps=1e-3)
# The largest weight difference from an uninterrupted unsharded run (full, LoRA). A LoRA adapter's AdamW steps turn the
# last bits of small gradients into updates of up to the learning rate's size: the expert-parallel LoRA run of
# test_an_expert_parallel_groups_killed_shard_is_restarted... ended within 1.2e-6 on the AVX-512 CPU it was written on
# and within 3.9e-5 on 2026-12-04's AMD EPYC without AVX-512 (the same code; its losses within 1e-5 relative on both).
WEIGHT_TOLERANCE = {False: 1e-5, True: 1e-4}
LORA = {"rank": 4, "seed": 7}
EVERY = 4  # TINKERQ_AUTO_SNAPSHOT_STEPS of every worker here
FIRST = 5  # pairs answered before the kill: snapshot after request 8, requests 9 and 10 in the journal
PAIRS = 12


def _batches(seed: int) -> list[list[types.Datum]]:
    rng = np.random.default_rng(seed)
    return [make_batch(rng, int(rng.integers(1, 5)), max_len=24) for _ in range(PAIRS)]


def _submit(tc, batches) -> list[tuple]:
    adam = LORA_ADAM if tc.info.extra.get("lora") else ADAM
    return [(tc.forward_backward(b), tc.optim_step(adam)) for b in batches]


def _open(sc, name: str, lora: bool):
    if lora:
        return sc.create_lora_training_client(name, **LORA).result(timeout=120)
    return sc.create_training_client(name).result(timeout=120)


def _weight_diff(want: str, got: str, lora: bool) -> float:
    """The largest difference between two saved models (full) or adapters (LoRA)."""
    if lora:
        from safetensors.torch import load_file

        a, b = (load_file(str(Path(p) / "adapter_model.safetensors")) for p in (want, got))
        assert a.keys() == b.keys()
        return max(float((a[k] - b[k]).abs().max()) for k in a)
    from transformers import AutoModelForCausalLM

    return max_weight_diff(AutoModelForCausalLM.from_pretrained(want), got)


def _env(checkpoints: Path, **extra: str) -> dict[str, str]:
    return {"TINKERQ_CHECKPOINT_DIR": str(checkpoints), "TINKERQ_AUTO_SNAPSHOT_STEPS": str(EVERY),
            "TINKERQ_MICROBATCH_TOKENS": str(WORKER_MICROBATCH_TOKENS), "TINKERQ_HEARTBEAT_S": "1", **extra}


def _group(model_dir, redis_url, tmp_path: Path, service, extra: tuple[str, ...] = (), **env: str) -> ShardGroup:
    group = ShardGroup(model_dir, redis_url, tmp_path, tmp_path / "checkpoints", f"sharded-{uuid.uuid4().hex[:8]}")
    group.env.update(_env(tmp_path / "checkpoints", **env))
    group.start(1, extra)
    time.sleep(1.0)
    group.start(0, extra)
    group.wait_serving(service.connection)
    return group


def _unsharded(model_dir, redis_url, tmp_path: Path, name: str):
    """An unsharded worker serving ``name`` from the same checkpoint directory, once it is registered itself."""
    log = tmp_path / "unsharded.log"
    proc = start_named_worker(model_dir, redis_url, name, log, env=_env(tmp_path / "checkpoints"))
    r = redis.Redis.from_url(redis_url)
    wait_for(lambda: any(json.loads(r.get(k) or b"{}").get("pid") == proc.pid
                         for k in r.scan_iter(keys.serving_pattern(name))), 120, "the unsharded worker", proc, log)
    proc.log_path = log  # type: ignore[attr-defined]
    return proc


def _kill_mid_run(tc, batches, proc) -> tuple[list[tuple], float]:
    """FIRST pairs answered, the rest submitted, then ``proc`` SIGKILLed while they are pending."""
    for fb, step in _submit(tc, batches[:FIRST]):
        fb.result(timeout=120)
        step.result(timeout=120)
    rest = _submit(tc, batches[FIRST:])
    os.kill(proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait(30)
    assert not all(f.done() for pair in rest for f in pair), "the kill fell after the run: nothing was pending"
    return rest, killed_at


def _first_answer_after(pairs: list[tuple], since: float, settle: float = 0.0) -> float:
    """Seconds from ``since`` until one of the requests still pending ``settle`` seconds after it is answered. (An
    answer the group computed before the kill can reach the client a little after it: ``settle`` leaves those out.
    Every answer is still checked by _check_run.)"""
    time.sleep(max(0.0, since + settle - time.monotonic()))
    pending = [f for pair in pairs for f in pair if not f.done()]
    assert pending, f"every request was answered within {settle:g} s of the kill"
    wait_for(lambda: any(f.done() for f in pending), 240, "an answer after the kill")
    return time.monotonic() - since


def _check_run(sc, tc, model_dir, batches, rest: list[tuple], tag: str, reference: str | None = None) -> float:
    """Every request answered OK, each optimizer step applied once; the final weights those of an uninterrupted
    run of the same requests on an unsharded worker (the session-wide one: a create_model sent to the group's name
    could reach a rank 0 still waiting for its group), or on the workers serving ``reference`` (the re-formed group
    itself). Returns the largest weight difference."""
    lora = bool(tc.info.extra.get("lora"))
    losses = [fb.result(timeout=240).metrics["loss:sum"] for fb, _ in rest]
    steps = [step.result(timeout=240).metrics["step:max"] for _, step in rest]
    assert steps == list(range(FIRST + 1, PAIRS + 1))
    got = tc.save_weights_for_sampler(f"{tag}-resumed").result(timeout=120).path
    ref = _open(sc, reference or str(model_dir), lora)
    try:
        assert ref.info.extra["shards"] == (tc.info.extra["shards"] if reference else 1)
        ref_futures = _submit(ref, batches)
        ref_losses = [fb.result(timeout=240).metrics["loss:sum"] for fb, _ in ref_futures[FIRST:]]
        want = ref.save_weights_for_sampler(f"{tag}-uninterrupted").result(timeout=120).path
    finally:
        ref.close()
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    diff = _weight_diff(want, got, lora)
    assert diff < WEIGHT_TOLERANCE[lora], diff
    return diff


def _replayed(log: str, pattern: str) -> tuple[int, int]:
    """(snapshot position, journaled requests replayed) from the line that reports a re-made session."""
    found = re.findall(pattern + r".*?snapshot after request (\d+) \+ (\d+) journaled request\(s\) replayed", log)
    assert len(found) == 1, log[-4000:]
    return int(found[0][0]), int(found[0][1])


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_killed_shard_is_restarted_and_its_group_resumes_the_session_exactly(
        service, model_dir, redis_url, tmp_path, lora):
    batches = _batches(210)
    group = _group(model_dir, redis_url, tmp_path, service, TINKERQ_ADOPT_TIMEOUT_S="180")
    try:
        tc = _open(service, group.name, lora)
        assert tc.info.extra["shards"] == 2 and bool(tc.info.extra.get("lora")) == lora
        rest, killed_at = _kill_mid_run(tc, batches, group.procs[1])
        group.start(1)  # its supervisor's job in a deployment
        first = _first_answer_after(rest, killed_at)
        diff = _check_run(service, tc, model_dir, batches, rest, "restart")
        log = (group.logs / f"{group.name}-rank0.log").read_text()
        snapshot, replayed = _replayed(log, f"re-made session {tc.model_id} after its shard group re-formed")
        assert snapshot >= 2 * EVERY and snapshot % (2 * EVERY) == 0 and replayed >= 1, (snapshot, replayed)
        # The request running when the group failed was not applied: it ran again on the re-made session.
        assert "was interrupted by the shard group's failure: it runs again" in log, log[-4000:]
        assert "ShardGroupError" not in log
        # Same session, same worker: no other worker took it.
        home = json.loads(redis.Redis.from_url(redis_url).get(keys.session_home(tc.model_id)))
        assert home["worker"] == tc.info.worker and home["adopted_from"] is None
        print(f"\nrestarted shard ({'LoRA' if lora else 'full'}): first answer {first:.1f} s after the kill; "
              f"snapshot after request {snapshot}, "
              f"{replayed} replayed; weights within {diff:.2e}")
        tc.close()
    finally:
        group.stop()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_an_expert_parallel_groups_killed_shard_is_restarted_and_the_session_resumes_exactly(
        service, redis_url, tmp_path, lora):
    """The same with ``--expert-parallel`` on a tiny Qwen3-MoE (each rank holds 4 of its 8 experts): the group's
    snapshots and journal re-make the session with its experts split again (a LoRA tenant's expert factors with
    them), and the run ends where an uninterrupted one on the same group does. (Against an unsharded worker the
    weights differ by what expert parallelism's other reduction order gives, 1e-6 to 1.1e-4 on the CPUs seen, the
    same with or without the kill: tests/test_expert_parallel.py checks that equality.)"""
    from tinkerq.recipes.families import build_family

    moe = build_family("qwen3_moe", tmp_path / "qwen3-moe", seed=12)
    batches = _batches(212)
    ep = ("--expert-parallel",)
    group = _group(moe, redis_url, tmp_path, service, ep, TINKERQ_ADOPT_TIMEOUT_S="180")
    try:
        tc = _open(service, group.name, lora)
        assert tc.info.extra["shards"] == 2 and bool(tc.info.extra.get("lora")) == lora
        rest, killed_at = _kill_mid_run(tc, batches, group.procs[1])
        group.start(1, ep)
        _first_answer_after(rest, killed_at)
        diff = _check_run(service, tc, moe, batches, rest, "ep-restart", reference=group.name)
        log = (group.logs / f"{group.name}-rank0.log").read_text()
        snapshot, replayed = _replayed(log, f"re-made session {tc.model_id} after its shard group re-formed")
        assert snapshot >= 2 * EVERY and snapshot % (2 * EVERY) == 0 and replayed >= 1, (snapshot, replayed)
        assert log.count("expert parallel over 2 ranks") >= 2  # the session, and again once re-made
        print(f"\nrestarted shard (expert parallel, {'LoRA' if lora else 'full'}): snapshot after request "
              f"{snapshot}, {replayed} replayed; weights within {diff:.2e}")
        tc.close()
    finally:
        group.stop()


def test_a_killed_rank_0s_session_is_adopted_by_an_unsharded_worker_exactly(
        service, model_dir, redis_url, tmp_path):
    batches = _batches(211)
    group = _group(model_dir, redis_url, tmp_path, service)
    unsharded = None
    try:
        tc = service.create_training_client(group.name).result(timeout=120)  # the group alone serves the name yet
        assert tc.info.extra["shards"] == 2
        unsharded = _unsharded(model_dir, redis_url, tmp_path, group.name)
        rest, killed_at = _kill_mid_run(tc, batches, group.procs[0])
        first = _first_answer_after(rest, killed_at)
        diff = _check_run(service, tc, model_dir, batches, rest, "rank0")
        home = json.loads(redis.Redis.from_url(redis_url).get(keys.session_home(tc.model_id)))
        assert home["adopted_from"] == tc.info.worker and home["worker"] != tc.info.worker
        snapshot, replayed = _replayed(unsharded.log_path.read_text(),
                                       f"adopted session {tc.model_id} of lost worker {tc.info.worker}")
        assert snapshot >= 2 * EVERY and snapshot % (2 * EVERY) == 0 and replayed >= 1, (snapshot, replayed)
        # The follower lost its rendezvous with rank 0 and exits, for its supervisor to restart it.
        assert group.procs[1].wait(COLLECTIVE_TIMEOUT_S + 60) != 0
        print(f"\nkilled rank 0: first answer {first:.1f} s after the kill; snapshot after request {snapshot}, "
              f"{replayed} replayed; weights within {diff:.2e}")
        tc.close()
    finally:
        group.stop()
        if unsharded is not None:
            unsharded.terminate()
            unsharded.wait(30)


def test_a_group_that_does_not_re_form_hands_its_session_to_another_worker(
        service, model_dir, redis_url, tmp_path):
    batches = _batches(212)
    bound = 4.0
    group = _group(model_dir, redis_url, tmp_path, service, TINKERQ_ADOPT_TIMEOUT_S=f"{bound:g}")
    unsharded = None
    try:
        tc = service.create_training_client(group.name).result(timeout=120)
        assert tc.info.extra["shards"] == 2
        unsharded = _unsharded(model_dir, redis_url, tmp_path, group.name)
        rest, killed_at = _kill_mid_run(tc, batches, group.procs[1])  # and never restarted
        # (CI on 2026-12-05: a request the group finished just before the kill was answered 0.12 s after it)
        first = _first_answer_after(rest, killed_at, settle=1.0)
        assert first > bound  # held, then handed over
        diff = _check_run(service, tc, model_dir, batches, rest, "handoff")
        home = json.loads(redis.Redis.from_url(redis_url).get(keys.session_home(tc.model_id)))
        assert home["adopted_from"] == tc.info.worker and home["worker"] != tc.info.worker
        _replayed(unsharded.log_path.read_text(), f"adopted session {tc.model_id} of lost worker {tc.info.worker}")
        log = (group.logs / f"{group.name}-rank0.log").read_text()
        assert "handing its 1 session(s) to the other worker(s) of the model" in log, log[-4000:]
        assert group.procs[0].poll() is None  # rank 0 lives on, silent until its group re-forms
        print(f"\nhanded over after {bound:g} s: first answer {first:.1f} s after the kill; weights within {diff:.2e}")
        tc.close()
    finally:
        group.stop()
        if unsharded is not None:
            unsharded.terminate()
            unsharded.wait(30)
