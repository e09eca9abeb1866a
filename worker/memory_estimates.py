"""What things need: a request's or a session's memory, estimated from the model's shape (worker/memory.py
admits them against what is free). The estimates are deliberately a little high (activations especially,
see :func:`batch_bytes`): refusing a request that would just have fitted costs a retry with a smaller one;
admitting one that does not fit costs the worker.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tinkerq.worker.batching import microbatch_ranges
from tinkerq.worker.memory_free import MiB


@dataclass(frozen=True)
class ModelShape:
    """What the estimators need to know about a model: its bytes and its transformer dimensions."""

    param_bytes: int  # every distinct parameter (tied ones once), in their own dtypes
    buffer_bytes: int  # non-parameter tensors a copy of the model carries (rotary tables...)
    dtype_bytes: int  # bytes per element of activations and of the KV cache (the parameters' dtype)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        """The shape of ``model`` (computed once per model object)."""
        shape = _shapes.get(model)
        if shape is None:
            shape = _shapes[model] = cls._measure(model)
        return shape

    @classmethod
    def _measure(cls, model: torch.nn.Module) -> ModelShape:
        params = list(model.parameters())  # parameters() yields tied tensors once
        config: Any = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        lm: Any = model  # a transformers model, when it has input embeddings
        embeddings = lm.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else params[0]
        vocab, hidden = (int(x) for x in embeddings.shape[-2:])
        heads = int(getattr(text, "num_attention_heads", 0) or 1)
        return cls(
            param_bytes=sum(_local(p).numel() * p.element_size() for p in params),
            buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
            dtype_bytes=params[0].element_size(),
            layers=int(getattr(text, "num_hidden_layers", 0) or 1),
            hidden=int(getattr(text, "hidden_size", 0) or hidden),
            # Unknown MLP width: the classic 4 x hidden (an over- rather than an under-estimate for most).
            intermediate=int(getattr(text, "intermediate_size", 0) or 4 * hidden),
            heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", 0) or heads),
            head_dim=int(getattr(text, "head_dim", 0) or hidden // heads),
            vocab=int(getattr(text, "vocab_size", 0) or vocab),
        )


_shapes: weakref.WeakKeyDictionary[torch.nn.Module, ModelShape] = weakref.WeakKeyDictionary()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a sharded (DTensor) tensor; a plain tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


# A LoRA adapter's training state: float32 weights, pending gradients, AdamW exp_avg and exp_avg_sq.
LORA_BYTES_PER_PARAMETER = 16


def session_state_bytes(shape: ModelShape, shards: int = 1) -> int:
    """What a training session keeps for its whole life (see worker/training.py), per shard.

    A full session's engine holds a deep copy of the model (parameters + buffers), ``p.grad`` for every
    parameter (the pending gradients, allocated at once), and AdamW's ``exp_avg`` and ``exp_avg_sq``
    (same shape and dtype; allocated at the session's first optim_step) plus a 0-dim float32 ``step``
    per parameter (negligible, not counted):

        state = weights + buffers + 3 x weights   (grad, exp_avg, exp_avg_sq)

    A sharded session holds 1/shards of each.
    """
    return (4 * shape.param_bytes) // shards + shape.buffer_bytes


def training_working_bytes(shape: ModelShape, shards: int = 1) -> int:
    """What one forward_backward needs on top of the session's state for gradients, per shard.

    ``run_loss`` sets the pending gradients aside and lets ``backward`` fill fresh ones (one copy of the
    weights), which are checked and then added; autograd's own temporaries while accumulating a tied or
    later micro-batch gradient take up to one more; optim_step's temporaries (AdamW's foreach
    ``sqrt(exp_avg_sq)`` on CUDA, one copy) fit in the same room:

        working = 2 x weights

    Only one request runs at a time (one slot per worker), so every session shares this room.
    """
    return (2 * shape.param_bytes) // shards


def snapshot_bytes(shape: ModelShape) -> int:
    """A sampler snapshot: one copy of the model, frozen (no gradients, no optimizer state).

        snapshot = weights + buffers

    A snapshot is made (or loaded) before an older one may be evicted (worker/snapshots.py), so this much
    must be free for a moment.
    """
    return shape.param_bytes + shape.buffer_bytes


def unallocated_state_bytes(sessions: Iterable[Any]) -> int:
    """AdamW moments that open sessions will allocate at their first optim_step (2 x their weights).

    Counted against a new session or snapshot: admitting one into memory that an existing session has
    been promised would make that session's first optim_step run out of memory instead.
    """
    return sum(session.unallocated_state_bytes() for session in sessions)


def sample_bytes(shape: ModelShape, prompt_tokens: int, max_tokens: int, num_samples: int, *,
                 device_type: str = "cpu") -> int:
    """A sample request's share of the running batch (worker/sampling/): its KV cache, logits rows, prompt pass.

    Its ``S = num_samples`` rows end at ``T = prompt + max_tokens`` cache positions each (the engine prefills
    the prompt once and copies its cache, so ``prompt`` below is an upper bound):

        kv     = 2 (K and V) x layers x kv_heads x head_dim x T x S x dtype_bytes
        grow   = kv / layers  on CUDA (the cache grows by torch.cat: one layer's old and new K/V coexist)
               = 1.5 x kv     on the CPU (glibc rarely reuses the freed, smaller buffer for the next,
                              larger one: measured peaks reached 2.3 x kv on a decode-only request)
        logits = 8 x S x V x 4    (float32 rows: logits, .float(), log_softmax, softmax, top-k/top-p
                                   masks and sorts: a handful of (S, V) tensors, 8 to be safe)
        prompt = S x P x (4 x hidden + 4 x intermediate) x dtype_bytes x (2 on the CPU)
                 (the no-grad prompt pass over S x P tokens: one layer's temporaries at a time; on the
                 CPU the freed ones fragment the heap, measured up to 6.6 x (hidden + intermediate))
        fixed  = 8 MiB            (per-step temporaries, sampling bookkeeping)
    """
    T, S = prompt_tokens + max_tokens, num_samples
    cpu = device_type != "cuda"
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * T * S * shape.dtype_bytes
    grow = 3 * kv // 2 if cpu else kv // shape.layers
    logits = 8 * S * shape.vocab * 4
    prompt = S * prompt_tokens * (4 * shape.hidden + 4 * shape.intermediate) * shape.dtype_bytes * (2 if cpu else 1)
    return kv + grow + logits + prompt + 8 * MiB


# Per token, bytes a request's own data takes in the worker: the request bytes (~20 per token:
# int64 tokens, int64 targets, float32 weights), the decoded numpy arrays (~20), the padded micro-batch
# copies, the two float32 outputs (logprobs, elementwise_loss) and the packed reply (~16).
REQUEST_BYTES_PER_TOKEN = 96
# Per datum: Python objects (Datum, ModelInput, dicts, numpy headers) on the way in and out.
REQUEST_BYTES_PER_DATUM = 4096


def microbatches(lengths: list[int], microbatch_tokens: int) -> list[tuple[int, int]]:
    """(rows, longest row) of each micro-batch run_loss will make of a batch (worker/batching.py)."""
    return [(stop - start, max(lengths[start:stop])) for start, stop in microbatch_ranges(lengths, microbatch_tokens)]


def batch_bytes(shape: ModelShape, lengths: list[int], *, microbatch_tokens: int, backward: bool,
                chunk_tokens: int | None, shards: int = 1, lora: bool = False) -> int:
    """A forward (backward=False) or forward_backward request: the largest micro-batch's peak + the data.

    Per micro-batch of B rows padded to L tokens (N = B x L), activations saved for the backward pass,
    per layer (measured on Llama: ~7 x hidden + ~4.6 x intermediate values per token, plus the attention
    mask; rounded up):

        layer  = N x (10 x hidden + 6 x intermediate) x dtype_bytes + 2 x B x L x L x 4   (mask, float32)
        acts   = (layers + 1) x layer      backward: every layer saved + one layer's gradients in flight
               = 2 x layer                 forward only: nothing is saved; one layer's temporaries at a time
        head   = 2 x C x V x 4 + 4 x N x hidden x dtype_bytes
                 (the chunked loss head holds one (C, V) float32 chunk of logits and its softmax, C =
                 chunk_tokens, and keeps the final hidden states; without the chunked head
                 (chunk_tokens None) C = N: full (B, L, V) logits, 3 copies: logits, float, grad)
        grads  = training_working_bytes    (backward only: the request's gradient buffers; none for a LoRA
                                            request: its adapter's gradient buffers are in its state)
        data   = 96 x tokens + 4096 x datums   (the request and reply themselves, whole request)

    A sharded worker splits datums across ranks, so rank 0's micro-batches are no larger than these.
    """
    largest = 0
    for rows, longest in microbatches(lengths, microbatch_tokens):
        n = rows * longest
        layer = n * (10 * shape.hidden + 6 * shape.intermediate) * shape.dtype_bytes + 2 * rows * longest * longest * 4
        acts = (shape.layers + 1) * layer if backward else 2 * layer
        logits = 3 * n * shape.vocab * 4 if chunk_tokens is None else 2 * min(chunk_tokens, n) * shape.vocab * 4
        head = logits + 4 * n * shape.hidden * shape.dtype_bytes
        largest = max(largest, acts + head)
    grads = training_working_bytes(shape, shards) if backward and not lora else 0
    data = REQUEST_BYTES_PER_TOKEN * sum(lengths) + REQUEST_BYTES_PER_DATUM * len(lengths)
    return largest + grads + data
