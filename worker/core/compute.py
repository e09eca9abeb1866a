"""The compute loop: the one thread that owns the model and the device.

It asks the scheduler (worker/core/scheduler.py) for the next unit of work and runs it: building a session, one
request of one session, a LoRA pass over the loss requests of several sessions, or a turn of the sampling
engine (admitting the sample requests that arrived, then one prefill or decode step). Then it records each
request as applied in its session's order and hands the rest to the outbox (worker/core/outbox.py), which journals
it (worker/recovery/), answers its callers and tells Celery's event stream how it ended (worker/transport/events.py).
It never waits on the network: request bodies arrive fetched and decoded (``WorkerService.take_body``).
Nothing else touches the model, so no locks or turns are needed around it; the service's lock guards only the
scheduler's bookkeeping, never the compute.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from tinkerq.errors import (
    CapacityError,
    MalformedMessageError,
    ShardGroupError,
    TinkerqError,
    UnknownModelError,
    WorkerError,
)
from tinkerq.threads import NamedThread
from tinkerq.wire import codec, messages
from tinkerq.worker import memory
from tinkerq.worker.core.operations import run_pass, sample_response, tokens_of
from tinkerq.worker.core.scheduler import Request, Work
from tinkerq.worker.lora.batch import LossItem
from tinkerq.worker.training.sessions import RoomComing

if TYPE_CHECKING:
    from tinkerq.errors import ServerError
    from tinkerq.worker.core.metrics import WorkerMetrics
    from tinkerq.worker.core.operations import Operations
    from tinkerq.worker.core.outbox import Outbox
    from tinkerq.worker.core.scheduler import Scheduler
    from tinkerq.worker.core.service import Outcome
    from tinkerq.worker.recovery import Recovery
    from tinkerq.worker.sampling.torch_engine import TorchEngine
    from tinkerq.worker.training.session import Session
    from tinkerq.worker.training.sessions import Slot

log = logging.getLogger("tinkerq.worker")


class ComputeHost(Protocol):
    """What the compute loop uses of the worker that owns it (worker/core/service.py passes itself); nothing else."""

    worker_id: str
    cond: threading.Condition
    scheduler: Scheduler
    slots: dict[str, Slot]
    engine: TorchEngine
    operations: Operations
    outbox: Outbox
    recovery: Recovery
    metrics: WorkerMetrics

    def take_body(self, request: Request) -> tuple[bytes, Any]: ...
    def applied(self, slot: Slot, request: Request, raw: bytes | None, outcome: Outcome, *, runtime: float = ...,
                shared: str = ..., discard: Any = ...) -> None: ...
    def finish(self, request: Request, outcome: Outcome, *, runtime: float = ..., shared: str = ...,
               discard: Any = ...) -> None: ...
    def open_session(self, model_id: str, lora: Any, optimizer: Any = None) -> Slot: ...
    def close_session(self, model_id: str) -> None: ...
    def release_creation(self, model_id: str) -> None: ...
    def break_session(self, model_id: str, reason: str, error: type[ServerError] = ...) -> None: ...
    def model_info(self, session: Session) -> dict[str, Any]: ...
    def dead_letter(self, op: str, envelope: Any, task_id: str | None, exc: MalformedMessageError) -> None: ...


class ComputeLoop:
    def __init__(self, service: ComputeHost) -> None:
        self.service = service
        self.scheduler = service.scheduler
        self._cond = service.cond
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._large = False  # the unit of work that ran held a large request or reply
        self.current: Work | None = None  # what runs now (`inspect stats`, `tinkerq fleet status`)
        self.passes = 0  # LoRA passes run, and the requests they held (metrics, tests, benchmarks)
        self.pass_requests = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = NamedThread(target=self._run, name="tinkerq-compute", daemon=True)
            self._thread.start()

    def stop(self, drain_s: float = 30.0) -> None:
        """Finish the running unit and what is already queued (queued work for up to ``drain_s``), then stop;
        the caller answers what is left."""
        deadline = time.monotonic() + drain_s
        with self._cond:
            while self.alive and ((self.scheduler.has_work() and time.monotonic() < deadline)
                                  or self.current is not None):
                self._cond.wait(0.1)
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def is_current(self) -> bool:
        """Whether the calling thread is the compute loop."""
        return self._thread is not None and threading.current_thread() is self._thread

    def _run(self) -> None:
        while True:
            with self._cond:
                work = None
                while not self._stopping and (work := self.scheduler.next()) is None:
                    self._cond.wait(1.0)
                if self._stopping or work is None:
                    return
                self.current = work
            started = time.perf_counter()
            try:
                self.run(work)
            except Exception:  # run() answers every request itself; this is a last resort
                log.exception("the compute loop failed on a %s", work.kind)
            if self._large:
                # A large request or reply: once its answer is out and this loop no longer holds its body (the
                # outbox is FIFO, and run() has returned), give the freed memory back to the OS, off this loop.
                self._large = False
                self.service.outbox.put(memory.release_memory)
            with self._cond:
                self.current = None
                self.scheduler.finished(work, "sample" if work.kind == "sample" else "train",
                                        time.perf_counter() - started, sampling_rows=self.service.engine.load())
                self._cond.notify_all()

    def run(self, work: Work) -> None:
        """Run one unit of work on this thread (also called directly by in-process tests)."""
        if work.kind == "control":
            assert work.control is not None
            work.control()
        elif work.kind == "create":
            self._create(work.requests[0])
        elif work.kind == "apply":
            self._apply(work.requests[0])
        elif work.kind == "pass":
            self._pass(work.requests)
        elif work.kind == "sample":
            self._sample_turn(work.requests)

    # -- sessions ----------------------------------------------------------------------------------------------

    def _create(self, request: Request) -> None:
        service = self.service
        started = time.time()
        try:
            outcome = self._create_model(request)
            if outcome is None:  # deferred until memory frees (Scheduler.defer)
                return
        except TinkerqError as exc:
            outcome = ("error", exc.to_wire(), {})
        except Exception as exc:  # a bug: answer it, log it, keep serving
            log.exception("create_model failed")
            outcome = ("error", WorkerError(f"create_model failed in the worker: {type(exc).__name__}: "
                                            f"{exc}").to_wire(), {})
        service.finish(request, outcome, runtime=time.time() - started)

    def _create_model(self, request: Request) -> Outcome | None:
        """Build the session the transport claimed for this worker (worker/transport/creation.py ``admit``), or answer
        from
        the one already open. Its records (or the release of its claim) go out on the outbox before its answer."""
        service = self.service
        model_id = request.model_id
        assert model_id is not None and request.plan is not None
        lora, optimizer, claimed = request.plan
        if claimed:
            try:
                opened = service.open_session(model_id, lora, optimizer)
            except RoomComing as coming:  # another session is being released to make room: built once it is out
                with self._cond:
                    deferred = self.scheduler.defer(request, freeing=True)
                    self._cond.notify_all()
                if deferred:
                    log.info("create_model of %s waits for session %s to be released", model_id, coming.model_id)
                    return None
                service.outbox.put(lambda: service.release_creation(model_id))
                raise CapacityError(
                    f"worker {service.worker_id} could not make room for training session {model_id} within "
                    f"{self.scheduler.max_defer_s:g} s: session {coming.model_id}, released for it, is not out yet "
                    f"(is Redis reachable?); retry shortly") from None
            except BaseException as exc:
                if self._deferred(request, exc):  # the claim stands: it is built once memory frees
                    return None
                service.outbox.put(lambda: service.release_creation(model_id))
                raise
            service.outbox.put(lambda: service.recovery.write_home(opened.session))
            log.info("opened %s session %s (%d open)", opened.session.kind, model_id, len(service.slots))
        slot = service.slots.get(model_id)
        if slot is None:
            raise UnknownModelError(f"training session {model_id} was closed")
        return ("ok", codec.packb(service.model_info(slot.session)), {})

    # -- training ----------------------------------------------------------------------------------------------

    def _apply(self, request: Request) -> None:
        """Run one request of one session, in order."""
        service = self.service
        slot = service.slots.get(request.model_id or "")
        if slot is None:  # closed while it waited
            service.finish(request, ("error", UnknownModelError(
                f"training session {request.model_id} was closed").to_wire(), {}))
            return
        op, seq_id = request.op, request.seq_id
        assert seq_id is not None
        ref = request.envelope.get("payload")
        started = time.time()
        timing = queue_wait(request.envelope, started)
        raw: bytes | None = None  # the request's body, claim check unwrapped (for the journal)
        discard = None  # its claim-checked body, dropped once it was applied
        outcome: Outcome
        broken = ""
        if op not in service.operations.ops:
            outcome = ("error", MalformedMessageError(f"unknown operation {op!r}").to_wire(), timing)
        else:
            try:
                raw, decoded = service.take_body(request)
                try:
                    body, tokens = service.operations.ops[op](slot.session, decoded)
                except CapacityError as exc:
                    if self._deferred(request, exc, (raw, decoded)):
                        return
                    raise
                compute = time.time() - started
                timing.update(compute_s=compute, tokens=float(tokens))
                if tokens:
                    timing["tokens_per_s"] = tokens / compute if compute > 0 else 0.0
                outcome = ("ok", body, timing)
                discard = ref
                if op == "optim_step":
                    service.recovery.step_taken(slot)
            except TinkerqError as exc:
                if isinstance(exc, ShardGroupError) and service.recovery.group.rerun_later(slot, request):
                    return  # the shard group failed under it: it runs again on the re-made session
                outcome = ("error", exc.to_wire(), timing)
                if isinstance(exc, MalformedMessageError):
                    service.dead_letter(op, request.envelope, None, exc)
            except Exception as exc:  # state may be half-changed: refuse everything after it
                log.exception("%s seq %d of session %s failed", op, seq_id, slot.session.model_id)
                broken = (f"session {slot.session.model_id} is unusable since {op} seq {seq_id} failed in the "
                          f"worker ({type(exc).__name__}: {exc}); create a new training client")
                outcome = ("error", WorkerError(broken, session_broken=True).to_wire(), timing)
        runtime = time.time() - started
        self._large |= memory.is_large(ref, outcome)  # give freed buffers back once it is done with
        if op == "close_model" and outcome[0] == "ok":  # its records go before the answer does (the outbox's order)
            service.close_session(slot.session.model_id)
            service.metrics.observe(op, outcome[0], outcome[2])
            service.finish(request, outcome, runtime=runtime)
            return
        service.applied(slot, request, raw, outcome, runtime=runtime, discard=discard)
        if broken:  # state may be half-changed: every request of the session after this one is refused
            service.break_session(slot.session.model_id, broken, WorkerError)

    def _pass(self, requests: list[Request]) -> None:
        """Loss requests of several LoRA sessions (one each, next in their orders) as one pass."""
        service = self.service
        started = time.time()
        items: list[tuple[Request, Slot, LossItem, bytes]] = []
        backward = requests[0].op == "forward_backward"
        for request in requests:  # checked one by one: a refusal is that request's answer alone
            slot = service.slots.get(request.model_id or "")
            if slot is None:
                service.finish(request, ("error", UnknownModelError(
                    f"training session {request.model_id} was closed").to_wire(), {}))
                continue
            timing = queue_wait(request.envelope, started)
            try:
                raw, decoded = service.take_body(request)
                try:
                    item = service.operations.checked_loss(decoded, backward=backward, lora=True)
                except CapacityError as exc:
                    if self._deferred(request, exc, (raw, decoded)):
                        continue
                    raise
                item.target = slot.session  # type: ignore[assignment]
                slot.session.last_used = time.monotonic()
                items.append((request, slot, item, raw))
            except TinkerqError as exc:  # refused before the pass: answered now, in order
                if isinstance(exc, MalformedMessageError):
                    service.dead_letter(request.op, request.envelope, None, exc)
                self._settle(request, slot, None, ("error", exc.to_wire(), timing), started)
            except Exception as exc:  # a bug while checking it; nothing was changed, so the session goes on
                log.exception("%s of session %s could not be checked", request.op, request.model_id)
                self._settle(request, slot, None, ("error", WorkerError(
                    f"{request.op} failed in the worker: {type(exc).__name__}: {exc}").to_wire(), timing), started)
        if not items:
            return
        self._run_pass([item for _, _, item, _ in items], backward)  # the scheduler bounded it in datums
        shared = f"pass {self.passes} of {len(items)} request(s)"
        for request, slot, item, raw in items:
            if isinstance(item.error, ShardGroupError) and service.recovery.group.rerun_later(slot, request):
                continue  # the shard group failed under the pass: it runs again on the re-made session
            timing = queue_wait(request.envelope, started)
            compute = time.time() - started
            discard = None
            if item.output is not None:
                tokens = tokens_of(item)
                timing.update(compute_s=compute, tokens=float(tokens), tokens_per_s=tokens / max(compute, 1e-9))
                outcome: Outcome = ("ok", codec.packb(messages.encode_forward_backward_output(item.output)), timing)
                discard = request.envelope.get("payload")
            else:
                outcome = ("error", (item.error or WorkerError("the LoRA pass gave no answer")).to_wire(), timing)
            self._settle(request, slot, raw, outcome, started, shared, discard)

    def _run_pass(self, items: list[LossItem], backward: bool) -> None:
        run_pass(items, backward)
        self.passes += 1
        self.pass_requests += len(items)

    def _deferred(self, request: Request, exc: BaseException, body: tuple[bytes, Any] | None = None) -> bool:
        """``request`` was refused for memory (``exc``): whether the scheduler defers it until memory frees (it goes
        back to its place, with its decoded ``body``, and nothing of it was applied) instead of refusing it."""
        if not isinstance(exc, CapacityError) or "needed_bytes" not in exc.details:  # a count limit: refused
            return False
        with self._cond:
            deferred = self.scheduler.defer(request)
            if deferred:
                request.body = body
                self._cond.notify_all()
        if deferred:
            log.info("%s of %s waits for memory: %s", request.op, request.model_id or "a sampler", exc.message)
        return deferred

    def _settle(self, request: Request, slot: Slot, raw: bytes | None, outcome: Outcome, started: float,
                shared: str = "", discard: Any = None) -> None:
        self._large |= memory.is_large(request.envelope.get("payload"), outcome)
        self.service.applied(slot, request, raw, outcome, runtime=time.time() - started, shared=shared,
                             discard=discard)

    # -- sampling ----------------------------------------------------------------------------------------------

    def _sample_turn(self, requests: list[Request]) -> None:
        for request in requests:
            self._admit_sample(request)
        engine = self.service.engine
        if engine.has_work():
            engine.step()

    def _admit_sample(self, request: Request) -> None:
        """Check a sample request and hand it to the engine; it is answered when its rows are done."""
        service = self.service
        started = time.time()
        timing = queue_wait(request.envelope, started)
        ref = request.envelope.get("payload")
        prompt_logprobs: list[Any] = []
        prompt_scores: list[Any] = []
        batch_rows: list[int] = []  # the most rows its decode batch held (TorchEngine), for Celery's event stream

        def done(sequences: Any, error: BaseException | None) -> None:
            outcome: Outcome
            if sequences is not None:
                tokens = sum(len(seq.tokens) for seq in sequences)
                compute = time.time() - started
                timing.update(compute_s=compute, tokens=float(tokens), tokens_per_s=tokens / max(compute, 1e-9))
                outcome = ("ok", sample_response(sequences, prompt_logprobs, prompt_scores), timing)
            elif isinstance(error, TinkerqError):
                outcome = ("error", error.to_wire(), timing)
            else:
                log.error("sampling failed: %s", error, exc_info=error)
                outcome = ("error", WorkerError(f"sampling failed in the worker: {type(error).__name__}: "
                                                f"{error}").to_wire(), timing)
            service.metrics.observe("sample", outcome[0], timing)
            service.finish(request, outcome, runtime=time.time() - started,
                           shared=f"decode batch of up to {max(batch_rows, default=0)} row(s)", discard=ref)

        try:
            body = service.take_body(request)
            try:
                job, _ = service.operations.sample_job(body[1], done, prompt_logprobs, prompt_scores)
                job.on_rows = batch_rows.append
            except CapacityError as exc:
                if self._deferred(request, exc, body):
                    return
                raise
            service.engine.submit(job)
        except TinkerqError as exc:
            if isinstance(exc, MalformedMessageError):
                service.dead_letter("sample", request.envelope, request.callers[0].task_id, exc)
            service.finish(request, ("error", exc.to_wire(), timing))
        except Exception as exc:
            log.exception("a sample request could not be admitted")
            service.finish(request, ("error", WorkerError(f"sample failed in the worker: {type(exc).__name__}: "
                                                          f"{exc}").to_wire(), timing))


def queue_wait(envelope: dict[str, Any], started: float) -> dict[str, float]:
    """A request's timing so far: how long it waited since the producer sent it (if the envelope says when)."""
    sent_at = envelope.get("sent_at")
    if not isinstance(sent_at, (int, float)):
        return {}
    return {"queue_wait_s": max(0.0, started - sent_at)}  # across hosts: as good as their clocks
