"""The scheduler (worker/core/scheduler.py) fed events: no torch, no Redis, no threads, no wall clock.

Order within a session, which requests share a LoRA pass, least-recently-served fairness between sessions,
and the compute balance between training and sampling (on a simulated clock: no timing asserted).
"""

from __future__ import annotations

import pytest

from tinkerq.errors import MalformedMessageError, WorkerError
from tinkerq.worker.core.ordering import Ordering
from tinkerq.worker.core.scheduler import Caller, Request, Scheduler, Work

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _request(model_id: str, seq: int, op: str = "forward_backward", datums: int | None = 1) -> Request:
    envelope = {"v": 1, "op": op, "model_id": model_id, "seq_id": seq, "payload": {"inline": b"x" * 10}}
    return Request(op, envelope, [Caller(f"{model_id}-{seq}", None)], model_id=model_id, seq_id=seq, datums=datums)


def _serve(scheduler: Scheduler, work, kind: str = "train", seconds: float = 0.0, *, sent: bool = True,
           rows: int = 0) -> None:
    """What the compute loop and the outbox do after running ``work``: each request applied, then finished (the
    sampling engine holding ``rows``; and its answer sent)."""
    for request in work.requests:
        scheduler.applied(request, ("ok", b"", {}))
    scheduler.finished(work, kind, seconds, sampling_rows=rows)
    if sent:
        for request in work.requests:
            scheduler.sent(request)


def _admit(s: Scheduler, request: Request) -> str:
    return s.admit(request).verdict


def test_a_session_runs_in_seq_order_whatever_the_arrival_order():
    s = Scheduler()
    s.open("a")
    assert _admit(s, _request("a", 3)) == "queued"
    assert _admit(s, _request("a", 2)) == "queued"
    assert s.next() is None  # seq 1 has not arrived
    _admit(s, _request("a", 1))
    order = []
    while (work := s.next()) is not None:
        assert work.kind == "apply" and len(work.requests) == 1
        assert s.next() is None  # one request of a session at a time
        order.append(work.requests[0].seq_id)
        _serve(s, work)
    assert order == [1, 2, 3] and s.position("a") == 3


def test_a_redelivery_joins_the_waiting_running_or_unsent_request():
    s = Scheduler()
    s.open("a")
    _admit(s, _request("a", 1))
    assert _admit(s, _request("a", 1)) == "joined"
    work = s.next()
    assert _admit(s, _request("a", 1)) == "joined"  # while it runs
    _serve(s, work, sent=False)
    assert _admit(s, _request("a", 1)) == "joined"  # applied, its answer not sent yet: it joins that answer
    assert [c.task_id for c in work.requests[0].callers] == ["a-1"] * 4
    for request in work.requests:
        s.sent(request)
    repeat = s.admit(_request("a", 1))  # sent: answered from the kept replies
    assert repeat.verdict == "repeat" and repeat.reply == ("ok", b"", {})


def test_a_repeat_whose_answer_is_no_longer_kept_is_refused_not_applied_again():
    s = Scheduler()
    s.open("a", ordering=Ordering(kept_replies=1))
    for seq in (1, 2):
        _admit(s, _request("a", seq))
        _serve(s, s.next())
    old = s.admit(_request("a", 1))
    assert old.verdict == "refused" and isinstance(old.error, MalformedMessageError)
    assert "no longer kept" in old.error.message and s.position("a") == 2


def test_a_full_lane_makes_the_transport_wait_only_when_it_will_drain():
    s = Scheduler()
    s.open("a", ordering=Ordering(max_buffered_bytes=3000))  # about two entries
    _admit(s, _request("a", 2))
    _admit(s, _request("a", 3))
    behind_a_gap = s.admit(_request("a", 4))  # seq 1 is missing: the lane cannot make room by itself
    assert behind_a_gap.verdict == "refused" and "until seq 1 arrives" in behind_a_gap.error.message
    s.close("a")
    s.open("a", ordering=Ordering(max_buffered_bytes=3000))
    _admit(s, _request("a", 1))
    _admit(s, _request("a", 2))
    assert _admit(s, _request("a", 3)) == "wait"  # full of requests that will run: backpressure
    _serve(s, s.next())
    assert _admit(s, _request("a", 3)) == "queued"  # room came


def test_a_broken_session_refuses_everything_but_close_and_its_waiting_requests_are_returned():
    s = Scheduler()
    s.open("a")
    for seq in (2, 3):
        _admit(s, _request("a", seq))
    waiting = s.break_session("a", "it broke", WorkerError)
    assert sorted(r.seq_id for r in waiting) == [2, 3] and s.broken("a") == "it broke"
    refused = s.admit(_request("a", 4))
    assert refused.verdict == "refused" and isinstance(refused.error, WorkerError)
    assert refused.error.details.get("session_broken")
    assert _admit(s, _request("a", 5, "close_model")) == "close"  # out of order: an unusable session can go
    assert _admit(s, _request("gone", 1)) == "unknown"


def test_least_recently_served_first_a_backlog_does_not_hide_another_tenant():
    s = Scheduler()
    s.open("a")
    s.open("b")
    for seq in range(1, 81):  # tenant A pipelines 80 requests
        _admit(s, _request("a", seq, "forward_backward" if seq % 2 else "optim_step"))
    for _ in range(5):
        _serve(s, s.next())
    _admit(s, _request("b", 1))  # then B sends one
    waited = 0
    while (work := s.next()).requests[0].model_id == "a":
        waited += 1
        _serve(s, work)
    assert waited == 0  # B goes next: it was served longest ago (never)
    _serve(s, work)
    assert s.next().requests[0].model_id == "a"


def test_three_tenants_take_turns():
    s = Scheduler()
    for m in "abc":
        s.open(m)
        for seq in range(1, 5):
            _admit(s, _request(m, seq, "optim_step"))
    order = []
    while (work := s.next()) is not None:
        order.append(work.requests[0].model_id)
        _serve(s, work)
    assert order == list("abc" * 4)


def test_lora_loss_requests_of_the_same_kind_share_a_pass_full_ones_run_alone():
    s = Scheduler()
    base = object()
    for m in ("l1", "l2", "l3"):
        s.open(m, base)
    s.open("f")
    _admit(s, _request("l1", 1))
    _admit(s, _request("l2", 1))
    _admit(s, _request("l3", 1, "forward"))  # another kind: not in the same pass
    _admit(s, _request("f", 1))
    kinds = []
    while (work := s.next()) is not None:
        kinds.append((work.kind, sorted(r.model_id for r in work.requests)))
        _serve(s, work)
    assert ("pass", ["l1", "l2"]) in kinds
    assert ("pass", ["l3"]) in kinds
    assert ("apply", ["f"]) in kinds
    assert len(kinds) == 3


def test_a_pass_is_bounded_in_datums_and_a_request_of_unknown_size_runs_alone():
    s = Scheduler(max_pass_datums=10)
    base = object()
    for m, datums in (("a", 4), ("b", 4), ("c", 4), ("d", None)):
        s.open(m, base)
        _admit(s, _request(m, 1, datums=datums))
    passes = []
    while (work := s.next()) is not None:
        passes.append(sorted(r.model_id for r in work.requests))
        _serve(s, work)
    assert sorted(passes) == [["a", "b"], ["c"], ["d"]]  # 4 + 4 fit in 10; a third 4 does not


def test_an_optim_step_of_a_lora_session_runs_alone_and_in_order():
    s = Scheduler()
    base = object()
    s.open("l1", base)
    _admit(s, _request("l1", 1))
    _admit(s, _request("l1", 2, "optim_step"))
    first = s.next()
    assert first.kind == "pass" and s.next() is None
    _serve(s, first)
    second = s.next()
    assert second.kind == "apply" and second.requests[0].op == "optim_step"


def test_control_work_and_session_creation_go_first():
    s = Scheduler()
    s.open("a")
    _admit(s, _request("a", 1))
    s.add_create(_request("new", 0, "create_model"))
    s.add_control(lambda: None)
    assert s.next().kind == "control"
    assert s.next().kind == "create"  # a new tenant was never served: before a-1, which arrived first
    assert s.next().kind == "apply"


def test_held_sessions_admit_but_do_not_run_and_an_interrupted_request_goes_back_first():
    s = Scheduler()
    s.open("a")
    s.open("b")
    _admit(s, _request("a", 1))
    running = s.next()
    assert s.hold(["a", "b"]) == ["a", "b"]
    assert s.requeue(running.requests[0])  # the group failed under it: it runs again once released
    s.finished(running, "train", 0.1, sampling_rows=0)
    assert _admit(s, _request("a", 2)) == "queued"
    assert s.next() is None and not s.idle("b")  # held: nothing runs, and a held session is not idle
    s.release("a")
    order = []
    while (work := s.next()) is not None:
        order.append(work.requests[0].seq_id)
        _serve(s, work)
    assert order == [1, 2]
    s.break_session("b", "gone", WorkerError)
    assert s.hold(["b"]) == []  # a broken session is not held


def test_work_refused_for_memory_is_refused_at_once_when_nothing_running_will_free_memory():
    s = Scheduler()
    s.open("a")
    _admit(s, _request("a", 1))
    work = s.next()
    assert not s.defer(work.requests[0])  # no sampling rows held: it can never fit by waiting


def test_work_refused_for_memory_waits_until_sampling_frees_rows():
    clock = FakeClock()
    s = Scheduler(max_defer_s=30.0, clock=clock)
    s.open("a")
    s.finished(Work("sample"), "sample", 0.0, sampling_rows=4)  # the sampling engine holds 4 rows
    _admit(s, _request("a", 1))
    work = s.next()
    assert work.kind == "apply"
    assert s.defer(work.requests[0])  # those rows will free memory: deferred, back in its place
    s.finished(work, "train", 0.0, sampling_rows=4)
    assert s.next().kind == "sample"  # a-1 waits for memory; the engine's turns go on
    s.finished(Work("sample"), "sample", 0.0, sampling_rows=4)
    assert s.next().kind == "sample"  # still 4 rows: nothing freed
    s.finished(Work("sample"), "sample", 0.0, sampling_rows=1)  # 3 rows finished: memory freed
    offered = [s.next() for _ in range(2)]  # train and sample take turns
    applies = [w for w in offered if w is not None and w.kind == "apply"]
    assert len(applies) == 1 and applies[0].requests[0] is work.requests[0]


def test_a_deferred_sample_or_creation_waits_in_front_of_its_queue():
    s = Scheduler()
    s.finished(Work("sample"), "sample", 0.0, sampling_rows=2)
    big, small = _request("s1", 0, "sample"), _request("s2", 0, "sample")
    s.add_sample(big)
    taken = s.next()
    assert taken.requests == [big] and s.defer(big)
    s.add_sample(small)
    s.finished(taken, "sample", 0.0, sampling_rows=2)
    assert s.next().requests == [small]  # the deferred one waits; the next one goes
    s.finished(Work("sample"), "sample", 0.0, sampling_rows=0)  # rows finished
    assert s.next().requests == [big]
    create = _request("new", 0, "create_model")
    s.finished(Work("sample"), "sample", 0.0, sampling_rows=1)
    s.add_create(create)
    work = s.next()
    assert work.kind == "create" and s.defer(create)
    s.finished(work, "train", 0.0, sampling_rows=1)
    assert s.next().kind == "sample"  # the creation waits for memory
    s.close("other")  # closing a session that is not here frees nothing
    s.open("x")
    s.close("x")  # closing one frees its memory: the creation is offered again
    s.finished(Work("sample"), "sample", 0.0, sampling_rows=1)
    kinds = {s.next().kind for _ in range(2)}
    assert "create" in kinds


def test_deferred_work_is_offered_again_after_its_bound_and_then_refused():
    clock = FakeClock()
    s = Scheduler(max_defer_s=30.0, clock=clock)
    s.open("a")
    s.finished(Work("sample"), "sample", 0.0, sampling_rows=2)  # rows that never finish
    _admit(s, _request("a", 1))
    work = s.next()
    assert s.defer(work.requests[0])
    s.finished(work, "train", 0.0, sampling_rows=2)
    clock.now += 10.0
    for _ in range(3):  # within its bound: only the engine's turns
        w = s.next()
        assert w.kind == "sample"
        s.finished(w, "sample", 0.0, sampling_rows=2)
    clock.now += 25.0
    offered = [s.next() for _ in range(2)]
    again = [w for w in offered if w is not None and w.kind == "apply"]
    assert len(again) == 1  # its bound passed: it runs once more
    assert not s.defer(again[0].requests[0])  # and, still not fitting, is refused


def test_a_creation_waiting_for_a_session_to_make_room_is_deferred_until_it_is_out_or_its_bound():
    """A new session at its kind's count limit waits while another is released to make room (its parked record on
    the outbox): deferred whether or not sampling holds rows, other work runs meanwhile, and it is offered again
    once the release settles (memory_freed, or the released session's close) or its bound passes."""
    clock = FakeClock()
    s = Scheduler(max_defer_s=30.0, clock=clock)
    s.open("busy")
    create = _request("new", 0, "create_model")
    s.add_create(create)
    work = s.next()
    assert work.kind == "create"
    assert not s.defer(create)  # nothing under way frees anything: refused
    assert s.defer(create, freeing=True)  # a session is on its way out: it waits
    s.finished(work, "train", 0.0, sampling_rows=0)
    _admit(s, _request("busy", 1))
    assert s.next().kind == "apply"  # another session's request runs meanwhile; the creation does not
    s.finished(Work("apply", lanes=[]), "train", 0.0, sampling_rows=0)
    assert s.next() is None and not s.has_work()
    s.memory_freed()  # the release settled
    again = s.next()
    assert again.kind == "create" and again.requests == [create]
    assert s.defer(create, freeing=True)  # not out yet (a write still on its way): it waits again
    clock.now += 10.0
    assert s.next() is None
    s.open("out")
    s.close("out")  # the released session is dropped: the creation goes
    assert s.next().requests == [create]
    assert s.defer(create, freeing=True)
    clock.now += 25.0  # 35 s since it was first deferred: past its bound, offered once more, then refused
    assert s.next().requests == [create]
    assert not s.defer(create, freeing=True)


def test_eviction_prefers_a_broken_session_then_the_longest_idle():
    s = Scheduler()
    for m in "abc":
        s.open(m)
    _admit(s, _request("c", 1))  # c has work waiting: never evicted
    last_used = {"a": 10.0, "b": 5.0, "c": 0.0}
    assert s.evictable(last_used, now=100.0, idle_s=50.0) == "b"
    assert s.evictable(last_used, now=100.0, idle_s=95.0) is None  # none idle long enough
    s.break_session("a", "broken", WorkerError)
    assert s.evictable(last_used, now=100.0, idle_s=95.0) == "a"


def test_an_adopter_restores_the_order_and_answers_repeats_as_the_lost_worker_did():
    s = Scheduler()
    s.open("a")
    s.restore("a", 5, kept=[(4, ("ok", b"r4", {})), (5, ("ok", b"r5", {}))],
              replayed=[(6, ("ok", b"r6", {})), (7, ("error", {"message": "m"}, {}))])
    assert s.position("a") == 7
    assert s.admit(_request("a", 4)).reply == ("ok", b"r4", {})
    assert s.admit(_request("a", 7)).reply[0] == "error"
    assert _admit(s, _request("a", 8)) == "queued"


def test_draining_answers_everything_waiting():
    s = Scheduler()
    s.open("a")
    _admit(s, _request("a", 1))
    _admit(s, _request("a", 3))
    s.add_create(_request("new", 0, "create_model"))
    s.add_sample(_request("smp", 0, "sample"))
    left = s.drain()
    assert sorted(r.op for r in left) == ["create_model", "forward_backward", "forward_backward", "sample"]
    assert not s.has_work()


def test_gaps_break_the_session_after_the_timeout_only():
    clock = FakeClock()
    s = Scheduler(clock=clock)
    s.open("a")
    waiting = _request("a", 2)
    waiting.received = clock.now
    _admit(s, waiting)

    def why(model_id, missing):
        return f"{model_id} never got {missing}"

    assert s.expire_gaps(clock.now + 1.0, 5.0, why) == []
    s.hold(["a"])
    assert s.expire_gaps(clock.now + 6.0, 5.0, why) == []  # held through a group outage: not a gap
    s.release("a")
    [(dropped, error)] = s.expire_gaps(clock.now + 6.0, 5.0, why)
    assert [r.seq_id for r in dropped] == [2] and error.message == "a never got 1"
    assert s.broken("a") == "a never got 1"
    assert s.admit(_request("a", 1)).verdict == "refused"  # the session is unusable now


def _balance(s: Scheduler, clock: FakeClock, units: dict[str, float], until: float) -> dict[str, int]:
    """Training (session "t", opened by the caller, with endless requests) and sampling (an engine that always
    has rows) both want the compute; each unit takes its simulated seconds. Returns units done per side."""
    done = dict.fromkeys(units, 0)
    rows = 1 if "sample" in units else 0
    s.finished(Work("sample"), "sample", 0.0, sampling_rows=rows)  # the engine holds rows (or not)
    while clock.now < until:
        if "train" in units:
            s.admit(_request("t", s.position("t") + 1, "optim_step"))  # one waiting (a repeat joins it)
        work = s.next()
        kind = "sample" if work.kind == "sample" else "train"
        clock.now += units[kind]
        done[kind] += 1
        if kind == "train":
            _serve(s, work, kind, units[kind], rows=rows)
        else:
            s.finished(work, kind, units[kind], sampling_rows=rows)
    s.finished(Work("sample"), "sample", 0.0, sampling_rows=0)
    return done


def test_training_and_sampling_share_the_compute_whatever_their_unit_sizes():
    clock = FakeClock()
    s = Scheduler(half_life_s=5.0, clock=clock)
    # Training requests of 0.5 s against decode steps of 10 ms: neither starves the other.
    s.open("t")
    done = _balance(s, clock, {"train": 0.5, "sample": 0.01}, until=20.0)
    share = s.seconds["sample"] / (s.seconds["sample"] + s.seconds["train"])
    assert 0.4 < share < 0.6, (s.seconds, done)
    assert done["sample"] > 20 * done["train"]  # many short units for each long one


def test_one_side_alone_gets_every_turn_and_comes_back_with_bounded_credit():
    clock = FakeClock()
    s = Scheduler(half_life_s=5.0, max_credit_s=1.0, clock=clock)
    s.open("t")
    _balance(s, clock, {"sample": 0.05}, until=30.0)  # a long sampling phase, no training
    assert s.seconds["train"] == 0.0 and s.seconds["sample"] == pytest.approx(30.0, abs=0.06)
    start = dict(s.seconds)
    _balance(s, clock, {"train": 0.1, "sample": 0.05}, until=40.0)
    gained = {k: s.seconds[k] - start[k] for k in start}
    # Training, back from idle, is ahead at first (its credit is capped), then the two share the time.
    assert 0.4 < gained["train"] / 10.0 < 0.7, gained
