"""Run in a fresh process by tests/test_idle_release.py (one embedded fleet per process: Celery shares task
registrations).

An embedded worker (the worker's own assembly, on the in-memory store) holds at most two LoRA sessions and serves
the model given as argv[1]; the automatic snapshots go under argv[2]. Sessions A and B train; A goes idle. B sends
six requests and a third session is asked for (all taken while the compute loop is held, so the creation runs
first): A is released to make room, and the store's write of A's parked record is held. Meanwhile B's requests must
still compute (the compute loop does not wait for the release), and the new session must wait. (The worker's one
transport thread waits for a creation it took, as for any: requests sent after it are taken once it is made.) Once
the write goes through, the new session is made and A is parked. Then A's client comes back: A is restored after B
(the longest idle now) is released for it, and answers as before; then B's, the same way. Prints one JSON line.

With argv[3] "stuck", the write stays held past the release's wait and the creation's (both shortened here to
``STUCK_RELEASE_WAIT_S`` and ``STUCK_DEFER_S``), as in a Redis outage longer than the creation's wait: A, whose
release could not be recorded, is closed and the new session made while the write is still held; once it goes
through, the new session answers, A's client is told its session was closed, and B is untouched.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np

from tests.helpers import make_batch
from tinkerq import keys, types
from tinkerq.records import SessionHome
from tinkerq.settings import Settings
from tinkerq.store import MemoryStore

IDLE_TTL_S = 0.2  # TINKERQ_SESSION_IDLE_TTL_S: idle longer than this, a session may make room
STUCK_RELEASE_WAIT_S = 1.0  # "stuck": worker/recovery/idle_release.py's RELEASE_WAIT_S (30 s)
STUCK_DEFER_S = 3.0  # "stuck": the scheduler's max_defer_s (60 s), how long a creation waits for room


def _wait(condition, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def main() -> None:
    from tinkerq.producer import ServiceClient
    from tinkerq.worker.core.embedded import EmbeddedFleet
    from tinkerq.worker.recovery import idle_release

    stuck = sys.argv[3:] == ["stuck"]
    if stuck:
        idle_release.RELEASE_WAIT_S = STUCK_RELEASE_WAIT_S

    held_key: list[bytes | str] = []  # the session-record key whose writes wait for `gate`
    gate, blocked = threading.Event(), threading.Event()
    gate.set()
    original_set = MemoryStore.set

    def set_(self: MemoryStore, key: object, value: object, *args: object, **kwargs: object) -> object:
        if held_key and key == held_key[0] and not gate.is_set():
            blocked.set()
            gate.wait()
        return original_set(self, key, value, *args, **kwargs)  # type: ignore[arg-type]

    MemoryStore.set = set_  # type: ignore[method-assign,assignment]

    settings = Settings(device="cpu", dtype="float32", checkpoint_dir=sys.argv[2], max_lora_sessions=2,
                        session_idle_ttl_s=IDLE_TTL_S)
    data = make_batch(np.random.default_rng(8), 3, min_len=10, max_len=30)
    adam = types.AdamParams(learning_rate=1e-2)
    result: dict[str, object] = {}
    with EmbeddedFleet(sys.argv[1], settings) as fleet, ServiceClient(settings=fleet.settings) as sc:
        service = fleet.worker.service
        store = service.connection.store
        if stuck:
            service.scheduler.max_defer_s = STUCK_DEFER_S

        def parked(model_id: str) -> bool:
            home = SessionHome.loads(store.get(keys.session_home(model_id)))
            return home is not None and home.parked

        def lora(seed: int):
            return sc.create_lora_training_client(sys.argv[1], rank=4, seed=seed)

        a, b = lora(1).result(timeout=120), lora(2).result(timeout=120)
        for tc in (a, b):
            tc.forward_backward(data, "cross_entropy").result(timeout=120)
            tc.optim_step(adam).result(timeout=120)
        want_a = float(a.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"])
        time.sleep(2 * IDLE_TTL_S)
        b.forward(data, "cross_entropy").result(timeout=120)  # B was used last: A is the longest idle
        time.sleep(2 * IDLE_TTL_S)

        # B's six requests, then a third session, both taken while the compute loop is held (so B's wait in its lane
        # when the creation runs: a creation goes first among training work); A is released to make room, and its
        # parked record's write is held.
        held_key.append(keys.session_home(a.model_id))
        gate.clear()
        hold = threading.Event()
        holder = threading.Thread(target=service.run_control, args=(hold.wait,))
        holder.start()
        before = service.scheduler.position(b.model_id)
        futures = [f for _ in range(3) for f in (b.forward_backward(data, "cross_entropy"), b.optim_step(adam))]
        lane = service.scheduler._lanes[b.model_id]  # a test's look inside: how many of B's requests were taken
        result["b_taken"] = _wait(lambda: len(lane.ordering.buffered) == 6)
        newcomer = lora(3)
        result["creation_taken"] = _wait(lambda: len(service.scheduler._creates) == 1)
        hold.set()
        holder.join(30)
        result["release_started"] = blocked.wait(60)
        deadline = time.monotonic() + 20  # under the 30 s a release waited on the compute loop before
        while time.monotonic() < deadline and service.scheduler.position(b.model_id) - before < 6:
            time.sleep(0.05)
        result["b_moved_while_held"] = service.scheduler.position(b.model_id) - before
        result["release_still_held"] = not gate.is_set() and blocked.is_set()
        result["newcomer_waited"] = not newcomer.done()
        result["a_in_memory_while_held"] = a.model_id in service.slots
        if stuck:
            _stuck(result, service, a, b, newcomer, futures, gate, data)
            print(json.dumps(result))
            return
        gate.set()
        c = newcomer.result(timeout=120)
        for f in futures:
            f.result(timeout=120)
        want_b = float(b.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"])
        result["a_parked"] = parked(a.model_id) and a.model_id not in service.slots
        result["sessions"] = sorted(service.slots) == sorted([b.model_id, c.model_id])

        # A comes back: at the limit again, B (the longest idle) is released for it, on the adopter's thread.
        time.sleep(2 * IDLE_TTL_S)
        c.forward(data, "cross_entropy").result(timeout=120)  # C used last: B is the longest idle
        time.sleep(2 * IDLE_TTL_S)
        got_a = float(a.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"])
        result["a_back"] = [got_a, want_a]
        result["b_parked"] = parked(b.model_id) and b.model_id not in service.slots
        result["sessions_after"] = sorted(service.slots) == sorted([a.model_id, c.model_id])
        time.sleep(2 * IDLE_TTL_S)  # and B comes back too (C, the longest idle now, makes room)
        got_b = float(b.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"])
        result["b_back"] = [got_b, want_b]
        result["releases"] = service.metrics.idle_releases._value.get()
        for tc in (a, b, c):
            tc.close()
    print(json.dumps(result))


def _stuck(result: dict[str, object], service, a, b, newcomer, futures, gate: threading.Event, data) -> None:
    """The write of A's parked record stays held past the creation's wait: A is closed, the new session made."""
    from tinkerq.errors import TinkerqError

    made = _wait(lambda: len(service.slots) == 2 and a.model_id not in service.slots, 4 * STUCK_DEFER_S + 10)
    result["made_while_held"] = made and not gate.is_set()
    result["a_closed_while_held"] = a.model_id not in service.slots and not gate.is_set()
    gate.set()  # Redis is back: the outbox's writes (then the answers) go through
    c = newcomer.result(timeout=120)
    result["newcomer_made"] = c.model_id in service.slots
    for f in futures:
        f.result(timeout=120)
    result["b_open"] = b.model_id in service.slots
    result["c_trains"] = float(c.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"]) > 0
    try:
        a.forward(data, "cross_entropy").result(timeout=120)
        result["a_error"] = None
    except TinkerqError as exc:
        result["a_error"] = [type(exc).__name__, str(exc)]
    result["a_parked"] = a.model_id in service.idle.released
    result["releases"] = service.metrics.idle_releases._value.get()
    for tc in (b, c):
        tc.close()


if __name__ == "__main__":
    main()
