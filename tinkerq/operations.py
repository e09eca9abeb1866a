"""Every operation a client can ask of a worker, in one registry: what each is, and every table derived from it.

Each :class:`Operation` says once what the rest of the code used to restate in its own string tables: its Celery
task name (and whether it travels as a Celery task at all: ``sample`` does not, each worker reads its own sampling
queue), whether it is numbered in a training session's order, whether applying it changes what the session holds,
whether it is a loss request that may share a LoRA pass with other sessions', the kind of checkpoint it writes, and
the shapes of its request body and reply. The tables other modules read (``TASK_NAMES``, ``ORDERED``,
``STATELESS``, ``PASS_OPS``...) are computed from :data:`OPERATIONS` here, never written out again; a new operation
is one entry below.

The request bodies are msgpack maps (their bytes are :mod:`tinkerq.wire`'s business); the TypedDicts below name
their keys as the producer and the gateway build them and the worker reads them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, TypedDict

from tinkerq.wire import messages

CheckpointKind = Literal["state", "sampler"]
_NAME_RE = re.compile(r"^[a-z][a-z_]{0,62}$")  # also a task name's tail and a usage counter's (tinkerq.usage)


# -- request bodies ---------------------------------------------------------------------------------------------

class _CreateModelRequired(TypedDict):
    base_model: str
    deadline: float  # unix seconds: a worker that finds the request later skips it (nobody waits any more)


class CreateModelRequest(_CreateModelRequired, total=False):
    lora: dict[str, Any]  # messages.encode_lora; absent: a full-parameter session
    optimizer: dict[str, Any]  # messages.encode_optimizer; absent: AdamW


class LossRequest(TypedDict):
    """forward and forward_backward (messages.encode_loss_request)."""

    loss_fn: str
    loss_fn_config: dict[str, Any] | None
    data: list[dict[str, Any]]  # messages.encode_datum each


class OptimStepRequest(TypedDict, total=False):
    """messages.encode_optim: exactly one of the two, the session's optimizer family's."""

    adam: dict[str, float]  # types.AdamParams' fields
    dimuon: dict[str, float]  # types.DimuonParams' fields


class _SaveRequired(TypedDict):
    name: str
    ttl_seconds: int | None  # None: kept until deleted


class SaveStateRequest(_SaveRequired, total=False):
    overwrite: bool  # absent: True (replace), as before the field existed
    keep_newest: int  # the gateway's per-key retention (worker/checkpoints/retention.py)


class SaveWeightsRequest(_SaveRequired, total=False):
    merged: bool  # absent: False
    external: bool  # the gateway's save_weights_external: the archive in a folder of its own
    keep_newest: int


class LoadStateRequest(TypedDict):
    path: str
    optimizer: bool  # the optimizer's state (AdamW's moments, Dimuon's momentum) and pending gradients too


class EmptyRequest(TypedDict):
    """create_sampler, close_model: the request is its position in the session's order."""


class _SampleRequired(TypedDict):
    source: dict[str, Any]  # exactly one of {"snapshot": id}, {"path": dir}, {"base": True}
    prompt: Any  # (P,) int array
    num_samples: int
    params: dict[str, Any]  # types.SamplingParams' fields


class SampleRequest(_SampleRequired, total=False):
    # Each only when asked (the body an older worker understands): messages.encode_sample_request.
    prompt_logprobs: bool
    topk_prompt: int
    topk_sample: int
    alt_k: int
    targets: Any  # (P,) int64 array


# -- reply bodies (plain maps; the others are decoded into tinkerq.types by Operation.decode_reply) -------------

class _SaveReplyRequired(TypedDict):
    path: str
    bytes: int  # the saved directory's size (usage accounting)
    pruned: list[str]  # older checkpoints of this kind deleted for keep_newest


class SaveReply(_SaveReplyRequired, total=False):
    expires_at: float  # only when the save has a TTL


class LoadStateReply(TypedDict):
    path: str
    optimizer: bool
    optimizer_steps: int  # the session's count now (0 when the optimizer starts afresh)
    seq_id: int  # the position the loaded state was saved at


class CreateSamplerReply(TypedDict):
    sampler_id: str


# -- the operations ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Operation:
    """One operation of the worker's API.

    ``sequenced``: numbered in a training session's order (``seq_id`` >= 1), applied strictly in it, repeats
    answered from the kept replies. create_model opens the session at 0 and sample belongs to no session's order.
    ``mutates``: applying it changes what the session holds (weights, optimizer, samplers, files): its body is
    journaled and an adopter applies it again; one that does not (forward, echo) is only ever answered.
    ``loss_pass``: a loss request, whose requests of several LoRA sessions (the same op, each next in its order)
    may run as one pass. ``checkpoint_kind``: the checkpoint it writes, for ``keep_newest`` retention.
    ``celery_task``: it travels as a Celery task (``tinkerq.<name>``); False for sample, which each worker reads
    from its own sampling queue. ``reports_metrics``: its reply carries the metrics a run's curves plot.
    ``request``: the TypedDict of its body (None: any map, echoed back). ``decode_reply``: what turns its reply
    body into the caller's result (None: the map as it came, shaped as ``reply`` when that is given).
    """

    name: str
    sequenced: bool
    mutates: bool
    loss_pass: bool = False
    checkpoint_kind: CheckpointKind | None = None
    celery_task: bool = True
    reports_metrics: bool = False
    request: type | None = None
    reply: type | None = None
    decode_reply: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"operation name {self.name!r} must be lowercase letters and '_' (it names a Celery "
                             f"task and a usage counter)")
        if self.loss_pass and not self.sequenced:
            raise ValueError(f"{self.name}: a loss op shares a pass with requests next in their sessions' orders, "
                             f"so it must be sequenced")
        if self.checkpoint_kind is not None and not self.mutates:
            raise ValueError(f"{self.name}: an op that writes a checkpoint changes what the session holds")

    @property
    def task_name(self) -> str:
        """How it is named to Celery, Flower and remote control (``tinkerq.<name>``); sample is shown so too,
        though it never travels as a task."""
        return f"tinkerq.{self.name}"


class Registry(Mapping[str, Operation]):
    """Operations by name, in the order given, and the tables derived from them (each computed, never listed)."""

    def __init__(self, operations: Iterable[Operation]) -> None:
        ops: dict[str, Operation] = {}
        for op in operations:
            if op.name in ops:
                raise ValueError(f"operation {op.name!r} is registered twice")
            ops[op.name] = op
        self._ops = MappingProxyType(ops)

    def __getitem__(self, name: str) -> Operation:
        return self._ops[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ops)

    def __len__(self) -> int:
        return len(self._ops)

    def _names(self, keep: Callable[[Operation], bool]) -> tuple[str, ...]:
        return tuple(name for name, op in self._ops.items() if keep(op))

    @property
    def celery_ops(self) -> tuple[str, ...]:
        """The operations registered as Celery tasks (worker/transport/tasks.py)."""
        return self._names(lambda op: op.celery_task)

    @property
    def task_names(self) -> Mapping[str, str]:
        """Celery task name of each operation that travels as one; the worker accepts no other
        (worker/transport/intake.py)."""
        return MappingProxyType({name: self._ops[name].task_name for name in self.celery_ops})

    @property
    def ordered(self) -> tuple[str, ...]:
        """A training session's ordered requests: what TrainingClient.submit posts (producer/client.py)."""
        return self._names(lambda op: op.sequenced)

    @property
    def unordered(self) -> frozenset[str]:
        """In no session's order: create_model (which opens one at seq_id 0) and sample."""
        return frozenset(self._names(lambda op: not op.sequenced))

    @property
    def stateless(self) -> frozenset[str]:
        """Ordered requests that change no session state: journaled without their body, never applied again."""
        return frozenset(self._names(lambda op: op.sequenced and not op.mutates))

    @property
    def pass_ops(self) -> frozenset[str]:
        """Loss requests, which LoRA sessions may share a pass for (worker/core/scheduler.py)."""
        return frozenset(self._names(lambda op: op.loss_pass))

    @property
    def checkpoint_kinds(self) -> Mapping[str, CheckpointKind]:
        """The kind of checkpoint each saving operation writes (worker/checkpoints/retention.py)."""
        return MappingProxyType({name: op.checkpoint_kind for name, op in self._ops.items()
                                 if op.checkpoint_kind is not None})

    @property
    def plotted(self) -> tuple[str, ...]:
        """Operations whose reply's metrics a run's console curves plot (gateway/run_metrics.py)."""
        return self._names(lambda op: op.reports_metrics)


OPERATIONS = Registry([
    Operation("create_model", sequenced=False, mutates=True, request=CreateModelRequest,
              decode_reply=messages.decode_model_info),
    Operation("close_model", sequenced=True, mutates=True, request=EmptyRequest),
    Operation("forward_backward", sequenced=True, mutates=True, loss_pass=True, reports_metrics=True,
              request=LossRequest, decode_reply=messages.decode_forward_backward_output),
    Operation("forward", sequenced=True, mutates=False, loss_pass=True, reports_metrics=True,
              request=LossRequest, decode_reply=messages.decode_forward_backward_output),
    Operation("optim_step", sequenced=True, mutates=True, reports_metrics=True, request=OptimStepRequest,
              decode_reply=messages.decode_optim_step_response),
    Operation("save_weights_for_sampler", sequenced=True, mutates=True, checkpoint_kind="sampler",
              request=SaveWeightsRequest, reply=SaveReply),
    Operation("save_state", sequenced=True, mutates=True, checkpoint_kind="state", request=SaveStateRequest,
              reply=SaveReply),
    Operation("load_state", sequenced=True, mutates=True, request=LoadStateRequest, reply=LoadStateReply),
    # A sampling snapshot of the session's weights; an adopter makes it again under the same id.
    Operation("create_sampler", sequenced=True, mutates=True, request=EmptyRequest, reply=CreateSamplerReply),
    Operation("echo", sequenced=True, mutates=False),  # also what fills a skipped position (TrainingClient.skip)
    Operation("sample", sequenced=False, mutates=False, celery_task=False, request=SampleRequest,
              decode_reply=messages.decode_sample_response),
])

# The derived tables, as the modules that read them name them.
CELERY_OPS: tuple[str, ...] = OPERATIONS.celery_ops
TASK_NAMES: Mapping[str, str] = OPERATIONS.task_names
ORDERED: tuple[str, ...] = OPERATIONS.ordered
UNORDERED: frozenset[str] = OPERATIONS.unordered
STATELESS: frozenset[str] = OPERATIONS.stateless
PASS_OPS: frozenset[str] = OPERATIONS.pass_ops
CHECKPOINT_KINDS: Mapping[str, CheckpointKind] = OPERATIONS.checkpoint_kinds
PLOTTED: tuple[str, ...] = OPERATIONS.plotted


def task_name(op: str) -> str:
    """``tinkerq.<op>``; KeyError for an operation that does not exist."""
    return OPERATIONS[op].task_name


def sequenced(op: str) -> bool:
    """Whether ``op`` is numbered in a training session's order; KeyError for an operation that does not exist."""
    return OPERATIONS[op].sequenced
