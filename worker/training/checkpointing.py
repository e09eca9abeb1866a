"""Activation checkpointing per decoder layer: a training forward keeps each layer's input only, and each layer's
activations are computed again when the backward reaches it (``torch.utils.checkpoint``, non-reentrant).

It trades one more forward for memory: a micro-batch's saved activations go from every layer's (~10 x hidden +
6 x intermediate values per token and layer) to one hidden state per token and layer plus one layer's worth
while it runs again (worker/memory/estimates.py :func:`activation_bytes`). The worker turns it on per request
(worker/memory/ :func:`admit_batch`): ``TINKERQ_ACTIVATION_CHECKPOINTING=auto`` only for a batch whose activations
would not fit without it, ``on`` for every training forward, ``off`` never.

How: :func:`install` gives each decoder layer of a model a ``forward`` that checkpoints its class's own forward
while this thread is inside :func:`enabled` and gradients are on (a sampling or no-grad forward runs as before). It
is set on the instance, so the module's hooks (FSDP's gathers on a shard group, worker/sharding/fsdp.py) run around
it in the forward, and the recomputation in the backward runs inside the gathered layer; a deep copy of the model
(a full session's) keeps it, bound to the copy. What a forward depends on besides its arguments and does not
keep in the graph (a LoRA pass's routing, worker/lora/routing.py, thread-local and gone when the backward runs) is
put back around the recomputation by what :func:`carry` registered. The recomputed forward is the same
computation on the same inputs: in float32 on the CPU the gradients are bitwise those of a forward without
checkpointing (tests/test_checkpointing.py).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from tinkerq.worker.loading.layers import decoder_layers

_local = threading.local()
# Each returns, at a checkpointed layer's forward, the context to recompute it in (see :func:`carry`).
_carried: list[Callable[[], contextlib.AbstractContextManager[Any]]] = []


def carry(capture: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
    """Register ``capture``: called at each checkpointed forward, its context is entered around that layer's
    recomputation in the backward (to restore thread-local state the forward read)."""
    if capture not in _carried:
        _carried.append(capture)


def install(model: torch.nn.Module) -> int:
    """Make every decoder layer of ``model`` checkpointable (once); returns how many layers there are."""
    layers = decoder_layers(model)
    for layer in layers:
        if "forward" not in layer.__dict__:
            layer.forward = types.MethodType(_forward, layer)  # type: ignore[method-assign]
    return len(layers)


def active() -> bool:
    return bool(getattr(_local, "on", False))


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Checkpoint the decoder layers of forwards on this thread (with gradients on) inside the block."""
    previous = active()
    _local.on = on
    try:
        yield
    finally:
        _local.on = previous


def _forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    own = type(self).forward
    if not (active() and torch.is_grad_enabled()):
        return own(self, *args, **kwargs)
    contexts = [capture() for capture in _carried]
    return checkpoint(own, self, *args, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), _entered(contexts)), **kwargs)


@contextlib.contextmanager
def _entered(contexts: list[contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield
