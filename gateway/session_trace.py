"""A session's requests as a Perfetto trace: ``RestClient.export_session_trace`` / ``tinker session export-trace``.

What a trace is made of, the fleet records anyway: every request the gateway answers is a future (its record says
when it was accepted, what it is and for which run or sampler; gateway/futures.py), and its stored answer says
when it was ready, how large it was, what it used (the usage counts) and its metrics. Futures are forgotten
``gateway_keep_s`` after they are answered, so when an answer is first stored :meth:`SessionTrace.record` keeps
one line of it per request (``keys.gateway_session_trace``, a capped list per session, kept as long as the
session's record); a forward or forward_backward's loss metrics are the ones gateway/run_metrics.py keeps per
step.

The export (:func:`build`) is a Perfetto protobuf trace (``.pftrace``, built with the ``perfetto`` package's
protos): one track per training run and sampler of the session, one slice per request from acceptance to answer,
named by its operation, with its seq_id, sizes (tokens, answer bytes), usage counts, metrics and any error as the
slice's arguments. ``ui.perfetto.dev`` opens it. The SDK asks ``GET sessions/{id}/trace_export`` and downloads
the URL it answers; the URL is signed (gateway/signing.py), expires after an hour and carries no API key.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent
from perfetto.trace_builder.proto_builder import TraceProtoBuilder

from tinkerq import keys
from tinkerq.gateway.futures import Answer
from tinkerq.gateway.records import IDLE_TTL_S, Records
from tinkerq.gateway.run_metrics import RunMetrics
from tinkerq.store import Push, Write

log = logging.getLogger("tinkerq.gateway")

MAX_EVENTS = 100_000  # per session (about 300 bytes each); a longer session keeps its newest requests
URL_LIFETIME_S = 3600.0  # Tinker's: "the URL expires after about an hour"
PURPOSE = "session_trace"  # the signed URL's audience (gateway/signing.py)
_SEQUENCE = 1  # every packet of the trace is one writer's sequence


def session_of(job: dict[str, Any]) -> str | None:
    """The session a future's job belongs to: its own, or the one its run's or sampler's id starts with."""
    if isinstance(job.get("session_id"), str):
        return str(job["session_id"])
    target = job.get("model_id") or job.get("sampler_id")
    return str(target).split(":", 1)[0] if isinstance(target, str) else None


class SessionTrace:
    def __init__(self, records: Records, run_metrics: RunMetrics) -> None:
        self.records = records
        self.store = records.store
        self.run_metrics = run_metrics

    def record(self, request_id: str, answer: Answer, future: dict[str, Any]) -> list[Write]:
        """The write that keeps one line for the answered future ``request_id`` (its record: ``future``), made
        with the answer's announcement by the gateway that stored the answer first. Best effort: a line that
        cannot be made is logged, never the answer's failure."""
        try:
            job = future.get("job")
            session_id = None if not isinstance(job, dict) else session_of(job)
            if session_id is None or not isinstance(job, dict):
                return []
            body = answer.json or {}
            line = {
                "request_id": request_id, "kind": future.get("kind"), "op": job.get("op") or job.get("type"),
                "target": job.get("model_id") or job.get("sampler_id"), "seq_id": job.get("seq_id"),
                "start": float(future.get("created") or time.time()), "end": time.time(),
                "answer_bytes": len(answer.proto) if answer.proto is not None else len(json.dumps(body)),
                "counts": (answer.usage or {}).get("counts") or {},
                "metrics": body.get("metrics") if isinstance(body.get("metrics"), dict) else None,
                "error": body.get("error"), "category": body.get("category"),
            }
            return [Push(keys.gateway_session_trace(session_id), json.dumps(line, separators=(",", ":")).encode(),
                         ttl_s=IDLE_TTL_S, max_len=MAX_EVENTS)]
        except (ValueError, TypeError) as exc:
            log.warning("request %s: not kept for its session's trace (%s)", request_id, exc)
            return []

    def lines(self, session_id: str) -> list[dict[str, Any]]:
        """The session's kept requests, oldest first, each with the loss metrics of its step where kept."""
        found = [json.loads(raw) for raw in reversed(self.store.list_range(keys.gateway_session_trace(session_id),
                                                                            0, -1))]
        points: dict[str, dict[int, dict[str, Any]]] = {}
        for line in found:
            target, seq_id = line.get("target"), line.get("seq_id")
            if line.get("metrics") is None and isinstance(target, str) and ":train:" in target \
                    and isinstance(seq_id, int):
                if target not in points:
                    points[target] = {p["seq_id"]: p for p in self.run_metrics.points(target)}
                point = points[target].get(seq_id)
                if point is not None:
                    line["metrics"] = point.get("metrics")
        return sorted(found, key=lambda line: (line["start"], line["end"]))


def build(session_id: str, lines: list[dict[str, Any]]) -> bytes:
    """The Perfetto trace of a session's requests (``lines`` from :meth:`SessionTrace.lines`)."""
    builder = TraceProtoBuilder()
    tracks: dict[str, int] = {}

    def track(name: str) -> int:
        if name not in tracks:
            tracks[name] = len(tracks) + 1
            packet = builder.add_packet()
            packet.track_descriptor.uuid = tracks[name]
            packet.track_descriptor.name = name
        return tracks[name]

    track(f"session {session_id}")
    for line in lines:
        uuid = track(str(line.get("target") or f"session {session_id}"))
        begin = builder.add_packet()
        begin.timestamp = int(float(line["start"]) * 1e9)
        begin.trusted_packet_sequence_id = _SEQUENCE
        begin.track_event.type = TrackEvent.TYPE_SLICE_BEGIN
        begin.track_event.track_uuid = uuid
        begin.track_event.name = str(line.get("op") or line.get("kind"))
        for name, value in _arguments(line):
            annotation = begin.track_event.debug_annotations.add()
            annotation.name = name
            if isinstance(value, (bool, str)):
                annotation.string_value = str(value)
            elif isinstance(value, int):
                annotation.int_value = value
            else:
                annotation.double_value = float(value)
        end = builder.add_packet()
        end.timestamp = max(begin.timestamp, int(float(line["end"]) * 1e9))
        end.trusted_packet_sequence_id = _SEQUENCE
        end.track_event.type = TrackEvent.TYPE_SLICE_END
        end.track_event.track_uuid = uuid
    return bytes(builder.serialize())


def _arguments(line: dict[str, Any]) -> list[tuple[str, Any]]:
    args: list[tuple[str, Any]] = [("request_id", str(line["request_id"])), ("kind", str(line.get("kind")))]
    if isinstance(line.get("seq_id"), int):
        args.append(("seq_id", line["seq_id"]))
    args.append(("answer_bytes", int(line.get("answer_bytes") or 0)))
    args += [(f"usage.{name}", int(n)) for name, n in sorted((line.get("counts") or {}).items())]
    args += [(f"metrics.{name}", float(v)) for name, v in sorted((line.get("metrics") or {}).items())]
    if line.get("error"):
        args += [("error", str(line["error"])), ("error_category", str(line.get("category")))]
    return args
