"""Run in a fresh process by tests/test_outbox.py (one embedded fleet per process: Celery shares task registrations).

An embedded worker (the worker's own assembly, in this process, on the in-memory store) serves the model given as
argv[1]. Every store call is recorded with the thread that made it. A LoRA and a full session each run
forward_backward / optim_step / forward with claim-checked bodies (TINKERQ_CLAIM_CHECK_BYTES is set small by the
test); then the store's writes are held (an outage) while more requests are sent, and the script records how far
the sessions' orders moved during it. Prints one JSON line.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

from tests.helpers import make_batch
from tinkerq import keys, types
from tinkerq.records import SnapshotRecord
from tinkerq.settings import Settings
from tinkerq.store import MemoryStore


def main() -> None:
    from tinkerq.producer import ServiceClient
    from tinkerq.worker.core.embedded import EmbeddedFleet

    calls: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    restore_calls: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    sink = [calls]  # where the recorded calls go
    recording = threading.Event()
    writes_open = threading.Event()
    writes_open.set()

    def wrap(name: str) -> None:
        original = getattr(MemoryStore, name)

        def recorded(self: MemoryStore, *args: object, **kwargs: object) -> object:
            if recording.is_set():
                sink[0][threading.current_thread().name][name] += 1
            if name == "write_many":
                writes_open.wait()
            return original(self, *args, **kwargs)

        setattr(MemoryStore, name, recorded)

    for name in ("set", "set_if_absent", "get", "get_many", "delete", "expire", "push", "pop", "pop_tail",
                 "list_range", "length", "count", "write_many"):
        wrap(name)

    # An automatic snapshot after every optimizer step: written on the compute loop (files only), put in place and
    # recorded by the outbox.
    settings = Settings(device="cpu", dtype="float32", auto_snapshot_steps=1, claim_check_bytes=512,
                        checkpoint_dir=sys.argv[2])
    rng = np.random.default_rng(3)
    data = make_batch(rng, 6, min_len=20, max_len=40)
    adam = types.AdamParams(learning_rate=1e-3)
    with EmbeddedFleet(sys.argv[1], settings) as fleet, ServiceClient(settings=fleet.settings) as sc:
        service = fleet.worker.service
        recording.set()  # creating the sessions too: claims and session records are not the compute loop's
        clients = [sc.create_lora_training_client(sys.argv[1], rank=4, seed=1).result(timeout=120),
                   sc.create_training_client(sys.argv[1]).result(timeout=120)]
        losses = []
        for tc in clients:
            for _ in range(2):
                out = tc.forward_backward(data).result(timeout=120)
                losses.append(float(out.metrics["loss:sum"]))
                tc.optim_step(adam).result(timeout=120)
            tc.forward(data).result(timeout=120)
        recording.clear()

        # An outage of the store's writes: requests already taken still compute.
        writes_open.clear()
        before = {tc.model_id: service.scheduler.position(tc.model_id) for tc in clients}
        futures = [f for tc in clients for f in (tc.forward_backward(data), tc.optim_step(adam))]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            moved = {m: service.scheduler.position(m) - before[m] for m in before}
            if all(n >= 2 for n in moved.values()):
                break
            time.sleep(0.05)
        answered_during = sum(f.done() for f in futures)
        writes_open.set()
        answers = [f.result(timeout=120) for f in futures]
        after = [float(a.metrics.get("loss:sum", 0.0)) if i % 2 == 0 else 0.0 for i, a in enumerate(answers)]
        # Every answered optim_step's snapshot was put in place and recorded before its answer.
        store = service.connection.store
        snapshots = {tc.model_id: [service.scheduler.position(tc.model_id),
                                   SnapshotRecord.loads(store.get(keys.auto_snapshot(tc.model_id)))]
                     for tc in clients}
        snapshots = {m: [position, record.seq_id if record else None,
                         bool(record and (Path(record.path) / "tinkerq_state.json").is_file())]
                     for m, (position, record) in snapshots.items()}

        # A session released idle (its snapshot put in place and its record written by the outbox), then restored on
        # its client's return (Recovery.adopt, the code that adopts a lost worker's session: its journal read and
        # its record written on the transport's thread): the compute loop makes no store call for either.
        lora = clients[0]
        before_park = float(lora.forward(data).result(timeout=120).metrics["loss:sum"])
        sink[0] = restore_calls
        recording.set()
        parked = service.idle.release(lora.model_id, 0.0)
        parked_out = lora.model_id not in service.slots
        after_restore = float(lora.forward(data).result(timeout=120).metrics["loss:sum"])
        recording.clear()
        restore = {"parked": parked and parked_out, "back": lora.model_id in service.slots,
                   "losses": [before_park, after_restore], "calls": {k: dict(v) for k, v in restore_calls.items()}}
        for tc in clients:
            tc.close()

        # A shard group's idle ping (worker/sharding/host.py) runs on the compute loop, and only when it is idle.
        ran: list[str] = []
        idle = service.run_when_idle(lambda: ran.append(threading.current_thread().name))
        hold = threading.Event()
        busy_thread = threading.Thread(target=service.run_control, args=(hold.wait,))
        busy_thread.start()
        while service.compute.current is None:
            time.sleep(0.01)
        busy = service.run_when_idle(lambda: ran.append("while busy"))
        hold.set()
        busy_thread.join(10)
    print(json.dumps({"idle_ping": [idle, ran], "busy_ping": busy,
                      "calls": {k: dict(v) for k, v in calls.items()}, "losses": losses,
                      "moved_during_outage": moved, "answered_during_outage": answered_during,
                      "after": after, "snapshots": snapshots, "restore": restore}))


if __name__ == "__main__":
    main()
