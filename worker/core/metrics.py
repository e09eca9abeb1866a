"""The worker's own Prometheus metrics: what Flower's endpoint cannot know (tokens, queue wait, tokens/s).

Served over HTTP by ``tinkerq worker --metrics-port PORT`` (``TINKERQ_METRICS_PORT``); each worker has its
own registry, so several services in one process (the embedded fleet, tests) never collide.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tinkerq_requests", "Requests applied, by operation and outcome",
                                ["op", "outcome"], registry=r)
        self.queue_wait = Histogram("tinkerq_queue_wait_seconds", "From the producer's send to the start of "
                                    "application (includes waiting for predecessors)", ["op"], buckets=_SECONDS,
                                    registry=r)
        self.compute = Histogram("tinkerq_compute_seconds", "Time applying a request", ["op"], buckets=_SECONDS,
                                 registry=r)
        self.tokens = Counter("tinkerq_tokens", "Tokens processed (loss calls) or generated (sampling)", ["op"],
                              registry=r)
        self.tokens_per_second = Gauge("tinkerq_tokens_per_second", "Throughput of the latest request", ["op"],
                                       registry=r)
        self.sessions = Gauge("tinkerq_sessions", "Training sessions held by this worker", registry=r)
        # Sharded workers (rank 0) only.
        self.shard_group_up = Gauge("tinkerq_shard_group_up", "1 while this worker's shard group is formed, 0 while "
                                    "it waits for a failed shard to come back", registry=r)
        self.shard_group_failures = Counter("tinkerq_shard_group_failures", "Times the shard group broke (a shard "
                                            "died or hung)", registry=r)
        self.auto_snapshots = Counter("tinkerq_auto_snapshots", "Automatic snapshots of training sessions written",
                                      registry=r)
        self.auto_snapshot_seconds = Histogram("tinkerq_auto_snapshot_seconds", "Time a session paused while its "
                                               "automatic snapshot was written", buckets=_SECONDS, registry=r)
        self.adoptions = Counter("tinkerq_adoptions", "Training sessions of lost workers adopted here (snapshot + "
                                 "journal replayed)", registry=r)
        self.idle_releases = Counter("tinkerq_idle_releases", "Training sessions released from memory after "
                                     "TINKERQ_SESSION_RELEASE_IDLE_S idle, or to make room (parked)", registry=r)
        self.idle_resumes = Counter("tinkerq_idle_resumes", "Parked training sessions restored here for their "
                                    "returning client", registry=r)
        self.journal_entries = Gauge("tinkerq_journal_entries", "Requests in the journals of this worker's sessions "
                                     "(applied since their latest automatic snapshot)", registry=r)
        self.shard_state_bytes = Gauge("tinkerq_shard_state_bytes", "Parameters + gradients + AdamW state held by "
                                       "the fullest shard, at the latest optim_step", registry=r)

    def watch_sessions(self, sessions: Callable[[], list[dict[str, Any]]]) -> None:
        """Per-session gauges read at scrape time (labelled by model id, so one series per session held here):
        ``sessions`` returns :meth:`worker.service.WorkerService.session_stats`'s dicts."""
        self.registry.register(_SessionCollector(sessions))

    def adoptions_count(self) -> int:
        return int(self.registry.get_sample_value("tinkerq_adoptions_total") or 0)

    def count(self, counter: str) -> int:
        """A counter's total (``tinkerq_idle_releases``...), for `inspect stats`."""
        return int(self.registry.get_sample_value(f"{counter}_total") or 0)

    def watch_sampling(self, rows: Callable[[], int], compute_seconds: Callable[[], dict[str, float]]) -> None:
        """Gauges read at scrape time: the sampling batch's rows, and compute time by kind (worker/turns.py)."""
        Gauge("tinkerq_sampling_rows", "Sampling rows waiting or decoding in this worker's batch",
              registry=self.registry).set_function(rows)
        turns = Gauge("tinkerq_compute_turn_seconds", "Compute seconds used by training and by sampling since "
                      "the worker started (their shares, when both have work, are balanced)", ["kind"],
                      registry=self.registry)
        for kind in ("train", "sample"):
            turns.labels(kind=kind).set_function(functools.partial(_seconds_of, compute_seconds, kind))

    def watch_lora(self, passes: Callable[[], tuple[int, int]]) -> None:
        """Counters read at scrape time from the LoRA pass loop: passes run, and the requests they held (their
        ratio is the mean number of sessions sharing a forward/backward pass)."""
        Gauge("tinkerq_lora_passes", "Mixed LoRA forward/backward passes run", registry=self.registry
              ).set_function(lambda: passes()[0])
        Gauge("tinkerq_lora_pass_requests", "LoRA requests run in those passes", registry=self.registry
              ).set_function(lambda: passes()[1])

    def observe(self, op: str, status: str, timing: dict[str, float]) -> None:
        self.requests.labels(op=op, outcome=status).inc()
        if "queue_wait_s" in timing:
            self.queue_wait.labels(op=op).observe(timing["queue_wait_s"])
        if "compute_s" in timing:
            self.compute.labels(op=op).observe(timing["compute_s"])
        if timing.get("tokens"):
            self.tokens.labels(op=op).inc(timing["tokens"])
            self.tokens_per_second.labels(op=op).set(timing.get("tokens_per_s", 0.0))

    def serve(self, port: int, address: str = "0.0.0.0") -> Any:
        """Serve ``/metrics`` on ``port``; returns the HTTP server (its ``shutdown()`` stops it)."""
        server, _ = start_http_server(port, addr=address, registry=self.registry)
        return server


class _SessionCollector:
    """``tinkerq_session_journal_entries`` and ``tinkerq_session_snapshot_age_seconds`` per training session.

    A session with no automatic snapshot yet has no snapshot-age sample (absent rather than NaN, so
    ``max(tinkerq_session_snapshot_age_seconds)`` stays meaningful); its journal then holds every request."""

    def __init__(self, sessions: Callable[[], list[dict[str, Any]]]) -> None:
        self.sessions = sessions

    def describe(self) -> list[Metric]:
        return []  # not probed at registration: the sessions are read at each scrape only

    def collect(self) -> Iterator[Metric]:
        journal = GaugeMetricFamily("tinkerq_session_journal_entries", "Requests in the session's journal "
                                    "(applied since its latest automatic snapshot, plus that snapshot's own)",
                                    labels=["model_id"])
        age = GaugeMetricFamily("tinkerq_session_snapshot_age_seconds", "Seconds since the session's latest "
                                "automatic snapshot (no sample before its first)", labels=["model_id"])
        for s in self.sessions():
            journal.add_metric([s["model_id"]], s["journal_entries"])
            if s["snapshot_age_s"] is not None:
                age.add_metric([s["model_id"]], s["snapshot_age_s"])
        yield journal
        yield age


def stats_step(stats: Callable[[], dict[str, Any]]) -> type:
    """A Celery consumer bootstep adding ``{"tinkerq": stats()}`` to the worker's ``inspect stats`` answer, which
    Flower's worker page shows under Stats.

    It also replaces the answer's ``broker`` block (Celery's Connection step, before this one) by a copy whose
    transport options hold plain values only: the intake's dead-letter handle (worker/core/runtime.py) there would
    make the whole answer fail to encode."""
    from celery import bootsteps

    class TinkerqStats(bootsteps.StartStopStep):  # (a plain Step is not kept in the consumer's steps)
        name = "tinkerq-stats"
        requires = ("celery.worker.consumer.connection:Connection",)

        def info(self, c: Any) -> dict[str, Any]:
            out: dict[str, Any] = {}
            try:
                out["tinkerq"] = stats()
            except Exception as exc:  # never fail the whole stats answer
                out["tinkerq"] = {"error": repr(exc)}
            if getattr(c, "connection", None) is not None:
                broker = c.connection.info()
                broker.pop("password", None)
                broker.pop("alternates", None)
                broker["transport_options"] = {k: v if isinstance(v, (str, int, float, bool, type(None)))
                                               else f"<{type(v).__name__}>"
                                               for k, v in (broker.get("transport_options") or {}).items()}
                out["broker"] = broker
            return out

    return TinkerqStats


def _seconds_of(compute_seconds: Callable[[], dict[str, float]], kind: str) -> float:
    return compute_seconds()[kind]
