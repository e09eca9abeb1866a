"""Idle release (docs/reliability.md): a training session idle for TINKERQ_SESSION_RELEASE_IDLE_S leaves its worker's
memory, parked; its client's next request restores it, with the numbers of a run never released. With journaling
off it cannot come back, and its next request says why."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.conftest import start_worker_process
from tests.helpers import make_batch
from tinkerq import errors, keys, types
from tinkerq.connection import Connection
from tinkerq.launcher.processes import free_port, wait_for
from tinkerq.producer import ServiceClient
from tinkerq.settings import Settings

pytestmark = pytest.mark.timeout(300)
ADAM = types.AdamParams(learning_rate=1e-2)
IDLE_S = 3  # TINKERQ_SESSION_RELEASE_IDLE_S in these workers
PROMPT = types.ModelInput.from_ints([3, 4, 5])
PARAMS = types.SamplingParams(max_tokens=5, seed=7)


class Worker:
    def __init__(self, model_dir, redis_url, tmp_path, name: str, env: dict[str, str], extra: list[str]) -> None:
        self.name, self.log, self.port = f"{name}-{uuid.uuid4().hex[:8]}", tmp_path / f"{name}.log", free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.checkpoint_dir = tmp_path / f"{name}-checkpoints"
        self.proc = start_worker_process(model_dir, redis_url, self.log, {
            "TINKERQ_HEARTBEAT_S": "1", "TINKERQ_CHECKPOINT_DIR": str(self.checkpoint_dir), **env},
            extra=["--name", self.name, "--metrics-port", str(self.port), *extra])


@pytest.fixture(scope="module")
def workers(model_dir, redis_url, tmp_path_factory):
    """The two workers of this module, started together (each test uses one)."""
    tmp_path = tmp_path_factory.mktemp("idle")
    started = {
        # Full-parameter sessions: one at a time, and a session idle 0.2 s makes room for a new one.
        "journaled": Worker(model_dir, redis_url, tmp_path, "idle", {
            "TINKERQ_SESSION_RELEASE_IDLE_S": str(IDLE_S), "TINKERQ_AUTO_SNAPSHOT_STEPS": "1000",
            "TINKERQ_SESSION_IDLE_TTL_S": "0.2"}, ["--max-sessions", "1"]),
        # Journaling off: a released session cannot come back. One full session at a time: one idle 0.2 s is
        # closed to make room for a new one.
        "unjournaled": Worker(model_dir, redis_url, tmp_path, "idle-off", {
            "TINKERQ_SESSION_RELEASE_IDLE_S": str(IDLE_S), "TINKERQ_JOURNAL_MAX_ENTRIES": "0",
            "TINKERQ_SESSION_IDLE_TTL_S": "0.2"}, ["--max-sessions", "1"]),
    }
    conn = Connection.open(Settings(broker_url=redis_url))
    try:
        for w in started.values():
            wait_for(lambda w=w: bool(conn.workers_serving(w.name)), 120, f"tinkerq worker {w.name}", w.proc, w.log)
        yield started
    finally:
        conn.close()
        for w in started.values():
            w.proc.terminate()
        for w in started.values():
            w.proc.wait(30)


def _metric(url: str, name: str) -> float:
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _home(store: redis.Redis, model_id: str) -> dict | None:
    raw = store.get(keys.session_home(model_id))
    return None if raw is None else json.loads(raw)


def _parked(store: redis.Redis, model_id: str) -> bool:
    home = _home(store, model_id)
    return home is not None and home["parked_at"] is not None


def _outputs(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def test_released_sessions_come_back_with_the_numbers_of_a_run_never_released(workers, redis_url):
    w = workers["journaled"]
    name, url = w.name, w.url
    store = redis.Redis.from_url(redis_url)
    sc = ServiceClient(broker_url=redis_url)
    rng = np.random.default_rng(70)
    batches = [make_batch(rng, 2, max_len=16) for _ in range(3)]
    probe = make_batch(rng, 2, max_len=16)
    kinds = {"full": lambda: sc.create_training_client(name),
             "lora": lambda: sc.create_lora_training_client(name, rank=4, seed=5)}

    def first_half(tc):
        """Steps, a sampler, and a pending gradient (in the snapshot the release takes)."""
        futures = [tc.forward_backward(batches[0], "cross_entropy"), tc.optim_step(ADAM),
                   tc.forward_backward(batches[1], "cross_entropy")]
        outs = [_outputs(futures[0].result(timeout=120)), _outputs(futures[2].result(timeout=120))]
        sampler = tc.save_weights_and_get_sampling_client().result(timeout=120)
        return outs, sampler

    def second_half(tc):
        futures = [tc.optim_step(ADAM), tc.forward_backward(batches[2], "cross_entropy"), tc.optim_step(ADAM),
                   tc.forward(probe, "cross_entropy")]
        return [_outputs(futures[1].result(timeout=120)), _outputs(futures[3].result(timeout=120))]

    def tokens(sampler):
        return [s.tokens for s in sampler.sample(PROMPT, 2, PARAMS).result(timeout=120).sequences]

    try:
        # The uninterrupted runs: pipelined, never idle, closed at once.
        want = {}
        for kind, open_client in kinds.items():
            tc = open_client().result(timeout=120)
            outs, sampler = first_half(tc)
            want[kind] = (outs + second_half(tc), tokens(sampler))
            tc.close()
        assert _metric(url, "tinkerq_idle_releases_total") == 0  # so they were never released

        clients = {kind: open_client().result(timeout=120) for kind, open_client in kinds.items()}
        got = {kind: first_half(tc) for kind, tc in clients.items()}
        for tc in clients.values():
            wait_for(lambda tc=tc: _parked(store, tc.model_id), 60, "the session to be released", w.proc, w.log)
        # Out of the worker's memory (the record says parked just before the session is dropped).
        wait_for(lambda: _metric(url, "tinkerq_sessions") == 0, 30, "the sessions to be dropped")
        for kind, (_, sampler) in got.items():  # sampling clients of a parked session keep sampling
            assert tokens(sampler) == want[kind][1], kind
        for kind, tc in clients.items():
            outs = got[kind][0] + second_half(tc)  # the client comes back: restored, then answered
            for got_arrays, want_arrays in zip(outs, want[kind][0], strict=True):
                for a, b in zip(got_arrays, want_arrays, strict=True):
                    np.testing.assert_array_equal(a, b)  # bitwise: CPU, one thread, the same requests
            assert not _parked(store, tc.model_id)
        assert _metric(url, "tinkerq_idle_resumes_total") == 2

        # A new full session needs the place of the idle one (--max-sessions 1): that one is released, parked
        # (before idle release, it was closed for good). The 0.5 s: idle longer than TINKERQ_SESSION_IDLE_TTL_S.
        time.sleep(0.5)
        newcomer = sc.create_training_client(name).result(timeout=120)
        newcomer.forward_backward(batches[0], "cross_entropy").result(timeout=120)
        assert _parked(store, clients["full"].model_id)

        # Closing a parked session removes its snapshot and record, without restoring it.
        wait_for(lambda: _parked(store, clients["lora"].model_id), 60, "the LoRA session to be released again",
                 w.proc, w.log)
        for tc in clients.values():
            snapshot = Path(w.checkpoint_dir, tc.model_id, "state", ".auto")
            assert snapshot.is_dir()
            tc.close()
            assert _home(store, tc.model_id) is None and not snapshot.exists()
        assert _metric(url, "tinkerq_idle_resumes_total") == 2
        newcomer.close()
    finally:
        sc.close()


def test_without_journaling_a_released_session_says_why_it_cannot_come_back(workers, redis_url):
    w = workers["unjournaled"]
    sc = ServiceClient(broker_url=redis_url)
    try:
        tc = sc.create_training_client(w.name).result(timeout=120)
        batch = make_batch(np.random.default_rng(71), 2, max_len=16)
        tc.forward_backward(batch, "cross_entropy").result(timeout=120)
        wait_for(lambda: _metric(w.url, "tinkerq_idle_releases_total") == 1, 60, "the session to be released",
                 w.proc, w.log)
        assert _metric(w.url, "tinkerq_sessions") == 0
        with pytest.raises(errors.UnknownModelError) as gone:
            tc.optim_step(ADAM).result(timeout=60)
        message = gone.value.message
        assert "released" in message and f"s idle (TINKERQ_SESSION_RELEASE_IDLE_S={IDLE_S})" in message, message
        assert "TINKERQ_JOURNAL_MAX_ENTRIES=0" in message and "create a new training client" in message, message
        assert gone.value.details["released_idle_s"] >= IDLE_S
        # The worker goes on serving.
        fresh = sc.create_training_client(w.name).result(timeout=120)
        fresh.forward_backward(batch, "cross_entropy").result(timeout=120)
        fresh.close()
    finally:
        sc.close()


def test_without_journaling_a_session_closed_to_make_room_says_why(workers, redis_url):
    """At the session limit (one here), a new session closes an idle one that cannot be parked; that one's client
    is told why, and what to do, not only that its session is gone."""
    w = workers["unjournaled"]
    sc = ServiceClient(broker_url=redis_url)
    try:
        batch = make_batch(np.random.default_rng(72), 2, max_len=16)
        releases = _metric(w.url, "tinkerq_idle_releases_total")
        tc = sc.create_training_client(w.name).result(timeout=120)
        tc.forward_backward(batch, "cross_entropy").result(timeout=120)
        time.sleep(0.5)  # idle longer than TINKERQ_SESSION_IDLE_TTL_S (0.2 s), well under the release's IDLE_S
        newcomer = sc.create_training_client(w.name).result(timeout=120)
        newcomer.forward_backward(batch, "cross_entropy").result(timeout=120)
        assert _metric(w.url, "tinkerq_idle_releases_total") == releases  # tc was closed, not released
        with pytest.raises(errors.UnknownModelError) as gone:
            tc.optim_step(ADAM).result(timeout=60)
        message = gone.value.message
        for part in (f"{tc.model_id} was closed on worker", "to make room for a new session",
                     "TINKERQ_JOURNAL_MAX_ENTRIES=0", "create a new training client"):
            assert part in message, (part, message)
        newcomer.forward_backward(batch, "cross_entropy").result(timeout=120)  # the worker goes on serving
        newcomer.close()
    finally:
        sc.close()


@pytest.mark.timeout(200)
def test_a_request_that_comes_while_a_release_is_recorded_keeps_the_session(model_dir, tmp_path):
    """The release's writes leave on the outbox, off the compute loop, so a request can run between them and the
    release's end: the session must then stay, its record say live again, and its numbers be a run's never
    released; released later, it is parked after its last request and comes back."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "tests.idle_release_driver", str(model_dir), str(tmp_path)],
                          cwd=root, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ran_first"] and result["parked_while_it_ran"], result  # the race did happen
    assert result["released_meanwhile"] is False and result["kept"] and result["live_again"], result
    assert result["released"] is True and result["out"], result
    assert result["parked_at"] == result["last_request"], result
    assert result["back"], result
    assert result["got"] == result["want"], result  # bitwise: CPU, the same requests in the same order


@pytest.mark.timeout(300)
def test_making_room_for_a_new_session_does_not_stop_the_compute_loop(model_dir, tmp_path):
    """At the LoRA session limit, a new session makes an idle one leave (released, parked). While the store holds
    the write of its parked record, another session's requests (taken before) still compute, and the new session
    waits; once the write goes through, the new session is made. A parked session coming back at the limit makes
    room the same way (its restore waits, on the transport's thread), and answers as before it left."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "tests.make_room_driver", str(model_dir), str(tmp_path)],
                          cwd=root, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["b_taken"] and result["creation_taken"] and result["release_started"], result
    # B's 3 x (forward_backward, optim_step), waiting behind the creation, all ran while the release was held
    assert result["b_moved_while_held"] == 6 and result["release_still_held"], result
    assert result["newcomer_waited"] and result["a_in_memory_while_held"], result
    assert result["a_parked"] and result["sessions"], result
    assert result["b_parked"] and result["sessions_after"], result
    assert result["a_back"][0] == result["a_back"][1], result  # bitwise: restored from its snapshot
    assert result["b_back"][0] == result["b_back"][1], result
    assert result["releases"] == 3, result  # A for the newcomer, B for A, C for B


def test_a_release_that_cannot_be_recorded_in_time_closes_the_session_and_the_new_one_is_made(model_dir, tmp_path):
    """Making room while Redis stays away longer than a creation waits (the store's write of the parked record held
    past both bounds, shortened in the driver): the idle session, which could not be parked, is closed, and the new
    session is made, without waiting for Redis. Once the write goes through, the new session answers and trains, the
    other session's requests are answered, and the closed session's client is told to create a new one."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "tests.make_room_driver", str(model_dir), str(tmp_path), "stuck"],
                          cwd=root, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["b_taken"] and result["creation_taken"] and result["release_started"], result
    assert result["b_moved_while_held"] == 6 and result["newcomer_waited"], result
    assert result["made_while_held"] and result["a_closed_while_held"], result
    assert result["newcomer_made"] and result["b_open"] and result["c_trains"], result
    name, message = result["a_error"]
    assert name == "UnknownModelError", result
    for part in ("was closed on worker", "to make room for a new session", "its release could not be recorded",
                 "is Redis reachable", "create a new training client"):
        assert part in message, (part, message)
    assert not result["a_parked"] and result["releases"] == 0, result  # closed, not released
    assert "to make room for a new one: it was idle and its release could not be recorded" in proc.stderr
