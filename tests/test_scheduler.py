"""The scheduler (worker/scheduler.py) fed events: no torch, no Redis, no threads, no wall clock.

Order within a session, which requests share a LoRA pass, least-recently-served fairness between sessions,
and the compute balance between training and sampling (on a simulated clock: no timing asserted).
"""

from __future__ import annotations

import pytest

from tinkerq.worker.scheduler import Caller, Request, Scheduler

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _request(model_id: str, seq: int, op: str = "forward_backward") -> Request:
    envelope = {"v": 1, "op": op, "model_id": model_id, "seq_id": seq, "payload": {"inline": b"x" * 10}}
    return Request(op, envelope, [Caller(f"{model_id}-{seq}", None)], model_id=model_id, seq_id=seq)


def _serve(scheduler: Scheduler, work, kind: str = "train", seconds: float = 0.0) -> None:
    """What the compute loop does after running ``work``: record each request as applied, then finished."""
    for request, lane in zip(work.requests, work.lanes, strict=True):
        lane.ordering.applied(request.seq_id, ("ok", b"", {}))
    scheduler.finished(work, kind, seconds)


def test_a_session_runs_in_seq_order_whatever_the_arrival_order():
    s = Scheduler()
    lane = s.open("a")
    assert s.add(lane, _request("a", 3)) == "queued"
    assert s.add(lane, _request("a", 2)) == "queued"
    assert s.next() is None  # seq 1 has not arrived
    s.add(lane, _request("a", 1))
    order = []
    while (work := s.next()) is not None:
        assert work.kind == "apply" and len(work.requests) == 1
        assert s.next() is None  # one request of a session at a time
        order.append(work.requests[0].seq_id)
        _serve(s, work)
    assert order == [1, 2, 3]


def test_a_redelivery_joins_the_waiting_or_running_request():
    s = Scheduler()
    lane = s.open("a")
    s.add(lane, _request("a", 1))
    assert s.add(lane, _request("a", 1)) == "joined"
    work = s.next()
    assert s.add(lane, _request("a", 1)) == "joined"  # while it runs
    assert [c.task_id for c in work.requests[0].callers] == ["a-1"] * 3


def test_a_lane_refuses_past_its_byte_bound_and_says_whether_it_drains():
    s = Scheduler()
    lane = s.open("a")
    lane.ordering.max_buffered_bytes = 3000  # about two entries
    s.add(lane, _request("a", 2))
    s.add(lane, _request("a", 3))
    assert s.add(lane, _request("a", 4)) == "full"
    assert not s.drains(lane)  # seq 1 is missing: the lane cannot make room by itself
    lane.ordering.max_buffered_bytes = 10_000
    s.add(lane, _request("a", 1))
    assert s.drains(lane)


def test_least_recently_served_first_a_backlog_does_not_hide_another_tenant():
    s = Scheduler()
    a, b = s.open("a"), s.open("b")
    for seq in range(1, 81):  # tenant A pipelines 80 requests
        s.add(a, _request("a", seq, "forward_backward" if seq % 2 else "optim_step"))
    served = []
    for _ in range(5):
        work = s.next()
        served.append(work.requests[0].model_id)
        _serve(s, work)
    s.add(b, _request("b", 1))  # then B sends one
    waited = 0
    while (work := s.next()).requests[0].model_id == "a":
        waited += 1
        _serve(s, work)
    assert waited == 0  # B goes next: it was served longest ago (never)
    _serve(s, work)
    assert s.next().requests[0].model_id == "a"


def test_three_tenants_take_turns():
    s = Scheduler()
    lanes = {m: s.open(m) for m in "abc"}
    for m, lane in lanes.items():
        for seq in range(1, 5):
            s.add(lane, _request(m, seq, "optim_step"))
    order = []
    while (work := s.next()) is not None:
        order.append(work.requests[0].model_id)
        _serve(s, work)
    assert order == list("abc" * 4)


def test_lora_loss_requests_of_the_same_kind_share_a_pass_full_ones_run_alone():
    s = Scheduler()
    base = object()
    l1, l2, l3 = s.open("l1", base), s.open("l2", base), s.open("l3", base)
    full = s.open("f")
    s.add(l1, _request("l1", 1))
    s.add(l2, _request("l2", 1))
    s.add(l3, _request("l3", 1, "forward"))  # another kind: not in the same pass
    s.add(full, _request("f", 1))
    kinds = []
    while (work := s.next()) is not None:
        kinds.append((work.kind, sorted(r.model_id for r in work.requests)))
        _serve(s, work)
    assert ("pass", ["l1", "l2"]) in kinds
    assert ("pass", ["l3"]) in kinds
    assert ("apply", ["f"]) in kinds
    assert len(kinds) == 3


def test_an_optim_step_of_a_lora_session_runs_alone_and_in_order():
    s = Scheduler()
    base = object()
    l1 = s.open("l1", base)
    s.add(l1, _request("l1", 1))
    s.add(l1, _request("l1", 2, "optim_step"))
    first = s.next()
    assert first.kind == "pass" and s.next() is None
    _serve(s, first)
    second = s.next()
    assert second.kind == "apply" and second.requests[0].op == "optim_step"


def test_control_work_and_session_creation_go_first():
    s = Scheduler()
    lane = s.open("a")
    s.add(lane, _request("a", 1))
    s.creates.append(_request("new", 0, "create_model"))
    from tinkerq.worker.scheduler import Work

    s.controls.append(Work("control", control=lambda: None))
    assert s.next().kind == "control"
    assert s.next().kind == "create"  # a new tenant was never served: before a-1, which arrived first
    assert s.next().kind == "apply"


def test_gaps_are_reported_after_the_timeout_only():
    clock = FakeClock()
    s = Scheduler(clock=clock)
    lane = s.open("a")
    s.add(lane, _request("a", 2))
    assert s.stalled(lane.ordering.buffered[2].since + 1.0, 5.0) == []
    assert s.stalled(lane.ordering.buffered[2].since + 6.0, 5.0) == [lane]
    dropped = s.drop_waiting(lane)
    assert [r.seq_id for r in dropped] == [2] and not lane.requests


def _balance(s: Scheduler, clock: FakeClock, units: dict[str, float], until: float) -> dict[str, int]:
    """Training (a session with endless requests) and sampling (an engine that always has rows) both want the
    compute; each unit takes its simulated seconds. Returns units done per side."""
    lane = s.lanes.get("t") or s.open("t")
    done = dict.fromkeys(units, 0)
    seq = lane.ordering.next_seq
    while clock.now < until:
        if "train" in units and seq not in lane.requests and lane.running is None:
            s.add(lane, _request("t", lane.ordering.next_seq, "optim_step"))
        s.sampling_busy = "sample" in units
        work = s.next()
        kind = "sample" if work.kind == "sample" else "train"
        clock.now += units[kind]
        done[kind] += 1
        if kind == "train":
            _serve(s, work, kind, units[kind])
        else:
            s.finished(work, kind, units[kind])
        seq = lane.ordering.next_seq
    s.sampling_busy = False
    return done


def test_training_and_sampling_share_the_compute_whatever_their_unit_sizes():
    clock = FakeClock()
    s = Scheduler(half_life_s=5.0, clock=clock)
    # Training requests of 0.5 s against decode steps of 10 ms: neither starves the other.
    done = _balance(s, clock, {"train": 0.5, "sample": 0.01}, until=20.0)
    share = s.seconds["sample"] / (s.seconds["sample"] + s.seconds["train"])
    assert 0.4 < share < 0.6, (s.seconds, done)
    assert done["sample"] > 20 * done["train"]  # many short units for each long one


def test_one_side_alone_gets_every_turn_and_comes_back_with_bounded_credit():
    clock = FakeClock()
    s = Scheduler(half_life_s=5.0, max_credit_s=1.0, clock=clock)
    _balance(s, clock, {"sample": 0.05}, until=30.0)  # a long sampling phase, no training
    assert s.seconds["train"] == 0.0 and s.seconds["sample"] == pytest.approx(30.0, abs=0.06)
    start = dict(s.seconds)
    _balance(s, clock, {"train": 0.1, "sample": 0.05}, until=40.0)
    gained = {k: s.seconds[k] - start[k] for k in start}
    # Training, back from idle, is ahead at first (its credit is capped), then the two share the time.
    assert 0.4 < gained["train"] / 10.0 < 0.7, gained
