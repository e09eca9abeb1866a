"""The operations registry (tinkerq/operations.py) is the one list of operations: the worker's Celery tasks, the
producer's ordered requests, the worker's handlers, retention kinds and the other tables all come from it, and the
bodies the producer builds have the keys its TypedDicts name. No Redis, no worker process."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import types as pytypes
from typing import Any

import numpy as np
import pytest

from tinkerq import errors, operations, types
from tinkerq.operations import OPERATIONS, Operation, Registry
from tinkerq.settings import Settings
from tinkerq.validation import PromptOptions
from tinkerq.wire import codec, messages

pytestmark = pytest.mark.timeout(120)

# What the tables said before the registry replaced them: the refactor changes no behaviour.
OLD_TASK_OPS = ("create_model", "close_model", "forward_backward", "forward", "optim_step", "save_weights_for_sampler",
                "save_state", "load_state", "create_sampler", "echo")
OLD_ORDERED = {"forward_backward", "forward", "optim_step", "save_state", "load_state", "save_weights_for_sampler",
               "create_sampler", "echo", "close_model"}


def test_the_registry_says_what_the_old_tables_said():
    assert dict(operations.TASK_NAMES) == {op: f"tinkerq.{op}" for op in OLD_TASK_OPS}
    assert operations.CELERY_OPS == OLD_TASK_OPS  # the order the worker registers its tasks in
    assert set(operations.ORDERED) == OLD_ORDERED
    assert {"sample", "create_model"} == operations.UNORDERED
    assert {"forward", "echo"} == operations.STATELESS
    assert {"forward_backward", "forward"} == operations.PASS_OPS
    assert dict(operations.CHECKPOINT_KINDS) == {"save_state": "state", "save_weights_for_sampler": "sampler"}
    assert set(operations.PLOTTED) == {"forward", "forward_backward", "optim_step"}
    assert set(OPERATIONS) == set(OLD_TASK_OPS) | {"sample"}
    assert not OPERATIONS["sample"].celery_task and OPERATIONS["sample"].task_name == "tinkerq.sample"
    assert operations.task_name("optim_step") == "tinkerq.optim_step"
    assert operations.sequenced("echo") and not operations.sequenced("create_model")
    with pytest.raises(KeyError):
        operations.sequenced("no_such_op")
    # The gateway's reply decoders, as it chose them before (optim_step's, the loss ops', else the map as is).
    decoders = {op: OPERATIONS[op].decode_reply for op in operations.ORDERED}
    assert decoders == {op: (messages.decode_forward_backward_output if op in ("forward", "forward_backward")
                             else messages.decode_optim_step_response if op == "optim_step" else None)
                        for op in OLD_ORDERED}


def test_every_worker_task_is_an_operation_and_every_operation_a_task():
    from tinkerq.celery_app import make_celery
    from tinkerq.worker.transport.tasks import register_tasks

    app = make_celery(Settings())
    register_tasks(app, service=None)  # type: ignore[arg-type]  # bodies only run on a message
    registered = {name for name in app.tasks if not name.startswith("celery.")}
    assert registered == {op.task_name for op in OPERATIONS.values() if op.celery_task}
    assert registered == set(operations.TASK_NAMES.values())
    assert "tinkerq.sample" not in registered  # read from each worker's own sampling queue


def test_two_workers_in_one_process_each_get_their_own_tasks():
    """A second worker app in one process (a second embedded fleet) gets its own tasks, bound to its own service,
    with no duplicate task names; and once a worker's app is gone, nothing of Celery's keeps its service alive (each
    service holds a model). Celery's shared tasks did both wrong: the first app's tasks were registered on every later
    app before its own."""
    import gc
    import warnings
    import weakref

    from tinkerq.celery_app import make_celery
    from tinkerq.worker.transport.tasks import register_tasks

    class Service:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def submit(self, op: str, envelope: Any, **_: Any) -> None:
            self.calls.append(op)  # queued: the compute loop would answer

    services, apps = [Service(), Service()], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Celery's DuplicateTaskNameWarning fails the test
        for service in services:
            app = make_celery(Settings())
            register_tasks(app, service)  # type: ignore[arg-type]
            app.finalize()
            apps.append(app)
    apps[1].tasks["tinkerq.close_model"].apply(args=(b"x",))
    apps[0].tasks["tinkerq.echo"].apply(args=(b"x",))
    assert services[0].calls == ["echo"] and services[1].calls == ["close_model"]
    first = weakref.ref(services[0])
    del services[0], apps[0], app, service
    gc.collect()
    assert first() is None


def test_the_workers_handlers_are_the_ordered_operations():
    from tinkerq.worker.core.operations import Operations

    handlers = Operations(Settings(), None, "", "", None, None, vocab_size=8, max_seq_len=8,  # type: ignore[arg-type]
                          position=lambda _: 0, admit_sampler=lambda _: None)
    assert set(handlers.ops) == set(operations.ORDERED)


def test_the_importers_read_the_registrys_tables_not_copies():
    from tinkerq import celery_app
    from tinkerq.worker import recovery
    from tinkerq.worker.checkpoints import retention as checkpoint_retention
    from tinkerq.worker.core import scheduler

    assert celery_app.TASK_NAMES is operations.TASK_NAMES
    assert checkpoint_retention.CHECKPOINT_KINDS is operations.CHECKPOINT_KINDS
    assert recovery.STATELESS_OPS is operations.STATELESS
    assert scheduler.PASS_OPS == operations.PASS_OPS


def test_retention_names_each_registered_kind():
    from tinkerq.worker.checkpoints import retention as checkpoint_retention

    assert set(operations.CHECKPOINT_KINDS.values()) == {"state", "sampler"}  # the two _checkpoints lists
    for op, kind in operations.CHECKPOINT_KINDS.items():
        with pytest.raises(errors.ValidationError, match=f"session's {kind} checkpoints"):
            checkpoint_retention.keep_newest_of({"keep_newest": 0}, op)
    with pytest.raises(KeyError):  # an op that writes no checkpoint has no kind to keep
        checkpoint_retention.keep_newest_of({"keep_newest": 0}, "optim_step")


def test_a_new_operation_shows_up_in_every_derived_table():
    """Adding one entry is all it takes: each table is computed from the entries, none is a copy."""
    loss = Operation("fake_loss", sequenced=True, mutates=False, loss_pass=True, reports_metrics=True)
    save = Operation("fake_save", sequenced=True, mutates=True, checkpoint_kind="state")
    side = Operation("fake_side", sequenced=False, mutates=False, celery_task=False)
    bigger = Registry([*OPERATIONS.values(), loss, save, side])
    assert bigger.celery_ops == (*operations.CELERY_OPS, "fake_loss", "fake_save")
    assert dict(bigger.task_names) == {**operations.TASK_NAMES, "fake_loss": "tinkerq.fake_loss",
                                       "fake_save": "tinkerq.fake_save"}
    assert bigger.ordered == (*operations.ORDERED, "fake_loss", "fake_save")
    assert bigger.unordered == operations.UNORDERED | {"fake_side"}
    assert bigger.stateless == operations.STATELESS | {"fake_loss"}
    assert bigger.pass_ops == operations.PASS_OPS | {"fake_loss"}
    assert dict(bigger.checkpoint_kinds) == {**operations.CHECKPOINT_KINDS, "fake_save": "state"}
    assert bigger.plotted == (*operations.PLOTTED, "fake_loss")
    # ...and the module's tables are these same derivations of OPERATIONS.
    assert (operations.CELERY_OPS, dict(operations.TASK_NAMES), operations.ORDERED, operations.UNORDERED,
            operations.STATELESS, operations.PASS_OPS, dict(operations.CHECKPOINT_KINDS), operations.PLOTTED) == (
        OPERATIONS.celery_ops, dict(OPERATIONS.task_names), OPERATIONS.ordered, OPERATIONS.unordered,
        OPERATIONS.stateless, OPERATIONS.pass_ops, dict(OPERATIONS.checkpoint_kinds), OPERATIONS.plotted)


def test_an_inconsistent_operation_is_refused():
    with pytest.raises(ValueError, match="task"):
        Operation("Bad-Name", sequenced=True, mutates=True)
    with pytest.raises(ValueError, match="sequenced"):
        Operation("loss", sequenced=False, mutates=False, loss_pass=True)
    with pytest.raises(ValueError, match="checkpoint"):
        Operation("save", sequenced=True, mutates=False, checkpoint_kind="state")
    with pytest.raises(ValueError, match="twice"):
        Registry([OPERATIONS["echo"], OPERATIONS["echo"]])
    with pytest.raises(dataclasses.FrozenInstanceError):
        OPERATIONS["echo"].sequenced = False  # type: ignore[misc]


# -- the bodies the producer builds, against the registry's TypedDicts --------------------------------------------

def _keys_fit(op: str, body: dict[str, Any]) -> None:
    shape = OPERATIONS[op].request
    assert shape is not None, op
    required, optional = set(shape.__required_keys__), set(shape.__optional_keys__)
    assert required <= set(body) <= required | optional, (op, sorted(body), sorted(required), sorted(optional))


class _Dispatch:
    """The producer's dispatcher, reduced to recording what would be posted (the decoded msgpack body)."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, Any]] = []

    def set_home(self, model_id: str, worker: str) -> None:
        pass

    def home(self, model_id: str) -> tuple[str, str]:
        return "worker", "queue"

    def submit(self, op: str, encoded: bytes, **_: Any) -> concurrent.futures.Future[Any]:
        self.posted.append((op, codec.unpackb(encoded)))
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        done.set_result({})
        return done


def _training_client() -> tuple[Any, _Dispatch]:
    from tinkerq.producer.client import TrainingClient

    dispatch = _Dispatch()
    claim_check = pytypes.SimpleNamespace(check_size=lambda n: None)
    service = pytypes.SimpleNamespace(settings=Settings(), _dispatch=dispatch,
                                      connection=pytypes.SimpleNamespace(claim_check=lambda: claim_check))
    info = types.ModelInfo(model_id="0" * 32, base_model="m", vocab_size=100, max_seq_len=64, num_parameters=1,
                           worker="worker")
    return TrainingClient(service, info), dispatch  # type: ignore[arg-type]


def test_the_producer_posts_exactly_the_ordered_operations():
    tc, dispatch = _training_client()
    for op in OPERATIONS:
        future = tc.submit(op, {})
        if operations.sequenced(op):
            assert dispatch.posted[-1][0] == op
        else:
            with pytest.raises(errors.UserError, match="ordered stream"):
                future.result()
    assert [op for op, _ in dispatch.posted] == list(operations.ORDERED)


def test_the_producers_bodies_have_the_registrys_keys():
    tc, dispatch = _training_client()
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, np.float32)})
    tc.forward_backward([datum])
    tc.forward([datum])
    tc.optim_step(types.AdamParams())
    tc.save_state("s", ttl_seconds=60, overwrite=True)
    tc.save_weights_for_sampler("w", merged=True)
    tc.load_state("/some/path")
    tc.load_state_with_optimizer("/some/path")
    tc.close()
    posted = [op for op, _ in dispatch.posted]
    assert posted == ["forward_backward", "forward", "optim_step", "save_state", "save_weights_for_sampler",
                      "load_state", "load_state", "close_model"], posted
    for op, body in dispatch.posted:
        _keys_fit(op, body)
    # The core's encoders, for the other bodies with a shape of their own.
    full = messages.encode_sample_request({"base": True}, types.ModelInput.from_ints([1, 2]), 2, types.SamplingParams(),
                                          prompt_logprobs=True, options=PromptOptions(
                                              topk_prompt=1, topk_sample=1, targets=np.zeros((1, 1)), alt_k=1))
    _keys_fit("sample", full)
    _keys_fit("sample", messages.encode_sample_request({"base": True}, types.ModelInput.from_ints([1]), 1,
                                                       types.SamplingParams()))
    _keys_fit("create_model", {"base_model": "m", "deadline": 0.0, "lora": messages.encode_lora(types.LoraConfig())})
    _keys_fit("create_model", {"base_model": "m", "deadline": 0.0,
                               "optimizer": messages.encode_optimizer(types.DimuonOptimizerConfig())})
    _keys_fit("optim_step", messages.encode_optim(types.DimuonParams(learning_rate=1e-3)))
    assert messages.decode_optim(messages.encode_optim(types.DimuonParams(learning_rate=1e-3, damping=1e-3))) == \
        types.DimuonParams(learning_rate=1e-3, damping=1e-3)
