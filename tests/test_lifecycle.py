"""A worker's lifecycle (worker/core/lifecycle.py): its parts start in the order their bootsteps require and stop the
other way, the same for `tinkerq worker` and the embedded fleet; shard-group pings and metrics only where they
apply. A recording stand-in for the assembled worker: no model, no Redis."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from tinkerq.worker.core.lifecycle import Lifecycle

pytestmark = pytest.mark.timeout(30)


@dataclass
class Recorder:
    calls: list[str] = field(default_factory=list)

    def part(self, name: str, **methods: str) -> SimpleNamespace:
        return SimpleNamespace(**{m: (lambda *a, _c=f"{name}.{m}", **k: self._record(_c)) for m in methods.values()})

    def _record(self, call: str) -> threading.Event:
        self.calls.append(call)
        return threading.Event()


@dataclass
class FakeWorker:
    registration: SimpleNamespace
    service: SimpleNamespace
    sampling: SimpleNamespace
    steps: list = field(default_factory=list)


def _worker(rec: Recorder, *, sharded: bool, metrics_port: int = 0) -> FakeWorker:
    shards = rec.part("shards", a="start_pings", b="shutdown") if sharded else None
    metrics = SimpleNamespace(serve=lambda port: rec._record(f"metrics.serve:{port}") and None)
    service = rec.part("service", a="start", b="close", c="start_watchdog", d="run_when_idle")
    service.shards, service.metrics = shards, metrics
    service.settings = SimpleNamespace(metrics_port=metrics_port)
    return FakeWorker(rec.part("registration", a="start", b="stop"), service, rec.part("sampling", a="start", b="stop"))


def test_a_worker_announces_first_and_withdraws_last_draining_compute_before_its_shard_group_stops():
    rec = Recorder()
    worker = _worker(rec, sharded=True)
    lifecycle = Lifecycle(worker)
    lifecycle.start()
    assert lifecycle.order == ["tinkerq.heartbeat", "tinkerq.shard-group", "tinkerq.compute", "tinkerq.watchdog",
                               "tinkerq.sample-intake"]
    assert rec.calls == ["registration.start", "shards.start_pings", "service.start", "service.start_watchdog",
                         "sampling.start"]
    rec.calls.clear()
    lifecycle.stop()
    lifecycle.stop()  # once
    assert rec.calls == ["sampling.stop", "service.close", "shards.shutdown", "registration.stop"]


def test_a_plain_worker_has_no_shard_group_step_and_metrics_only_with_a_port():
    rec = Recorder()
    worker = _worker(rec, sharded=False, metrics_port=9109)
    lifecycle = Lifecycle(worker)
    lifecycle.start()
    assert "tinkerq.shard-group" not in lifecycle.order and "tinkerq.metrics" in lifecycle.order
    assert rec.calls.index("service.start") < rec.calls.index("metrics.serve:9109") < rec.calls.index("sampling.start")
    assert not any(c.startswith("shards.") for c in rec.calls)


def test_the_embedded_fleet_and_the_worker_process_use_the_same_lifecycle():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "worker"
    for module in ("core/embedded.py", "core/runtime.py"):
        source = (root / module).read_text()
        assert "Lifecycle(" in source, module
        for part in ("registration.start", "sampling.start", "start_watchdog", "start_pings", "metrics.serve"):
            assert part not in source, f"{module} starts {part} itself, outside the lifecycle"
