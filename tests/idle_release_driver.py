"""Run in a fresh process by tests/test_idle_release.py (one embedded fleet per process: Celery shares task
registrations).

An embedded worker (the worker's own assembly, on the in-memory store) serves the model given as argv[1]; the
automatic snapshots go under argv[2]. A LoRA session trains a step; then a release starts, and while the outbox
records the session parked, its client sends another request, which the compute loop runs. The release must keep
the session (a request came), its record must say live again, and the request's answer must be a run's that was
never released. Then a plain release parks it, and its client's next request restores it. Prints one JSON line.
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


def main() -> None:
    from tinkerq.producer import ServiceClient
    from tinkerq.worker.core.embedded import EmbeddedFleet
    from tinkerq.worker.recovery.idle_release import IdleRelease

    settings = Settings(device="cpu", dtype="float32", checkpoint_dir=sys.argv[2])
    data = make_batch(np.random.default_rng(5), 3, min_len=10, max_len=30)
    adam = types.AdamParams(learning_rate=1e-2)
    result: dict[str, object] = {}
    with EmbeddedFleet(sys.argv[1], settings) as fleet, ServiceClient(settings=fleet.settings) as sc:
        service = fleet.worker.service
        store = service.connection.store

        def home(model_id: str) -> SessionHome | None:
            return SessionHome.loads(store.get(keys.session_home(model_id)))

        def run(tc) -> list[float]:  # a step, then a forward whose loss shows the step (sent together)
            futures = [tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam),
                       tc.forward(data, "cross_entropy")]
            return [float(futures[-1].result(timeout=120).metrics["loss:sum"])]

        reference = sc.create_lora_training_client(sys.argv[1], rank=4, seed=3).result(timeout=120)
        want = run(reference) + run(reference)
        reference.close()

        tc = sc.create_lora_training_client(sys.argv[1], rank=4, seed=3).result(timeout=120)
        got = run(tc)
        mid = tc.model_id
        position = service.scheduler.position(mid)

        # While the outbox records it parked, a request comes and runs: the release must keep the session.
        record = IdleRelease._record
        late_losses: list[float] = []
        late = threading.Thread(target=lambda: late_losses.extend(run(tc)))

        def record_while_a_request_runs(self: IdleRelease, parking) -> None:
            late.start()
            deadline = time.monotonic() + 60
            while service.scheduler.position(mid) < position + 3 and time.monotonic() < deadline:
                time.sleep(0.01)  # its forward_backward, optim_step and forward ran (answers queued behind this)
            record(self, parking)
            result["parked_while_it_ran"] = bool(home(mid) and home(mid).parked)
            result["ran_first"] = service.scheduler.position(mid) == position + 3

        IdleRelease._record = record_while_a_request_runs  # type: ignore[method-assign]
        try:
            result["released_meanwhile"] = service.idle.release(mid, 0.0)
        finally:
            IdleRelease._record = record  # type: ignore[method-assign]
        late.join(120)
        got += late_losses
        service.outbox.flush(30)
        result["kept"] = mid in service.slots
        result["live_again"] = bool(home(mid) and not home(mid).parked and home(mid).worker == service.worker_id)

        # Idle now: released, and back on its client's next request with the same numbers.
        result["released"] = service.idle.release(mid, 0.0)
        result["out"] = mid not in service.slots
        result["parked_at"] = home(mid).seq_id if home(mid) and home(mid).parked else None
        result["last_request"] = position + 3
        after = float(tc.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"])
        result["back"] = mid in service.slots
        tc.close()
    result.update(want=[*want, want[-1]], got=[*got, after])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
