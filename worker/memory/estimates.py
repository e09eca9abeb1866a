"""What things need: a request's or a session's memory, estimated from the model's shape (worker/memory/
admits them against what is free). The estimates are deliberately a little high (activations especially,
see :func:`batch_bytes`): refusing a request that would just have fitted costs a retry with a smaller one;
admitting one that does not fit costs the worker.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch

from tinkerq.worker.memory.free import MiB
from tinkerq.worker.training.batching import microbatch_ranges


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
    # What FSDP gathers as one unit on a sharded worker (worker/sharding/fsdp.py), at full size: the largest
    # decoder layer's parameters, and the root's (everything outside the decoder layers: the embeddings, the
    # final norm, the output weight). 0 where a shape is written by hand.
    largest_layer_bytes: int = 0
    root_bytes: int = 0
    parameters: int = 0  # the number of distinct parameters (tied ones once), full size
    largest_weight_bytes: int = 0  # the largest single parameter at full size (a fused experts tensor is one)
    # A mixture of experts: how many routed experts a token goes through, and their summed width (top-k x the
    # expert's width; part of ``intermediate``). 0 on a dense model.
    top_k: int = 0
    routed_intermediate: int = 0
    # The largest decoder layer without its routed experts: what an expert-parallel group gathers (its experts
    # stay split by expert: worker/sharding/experts.py). 0 where a shape is written by hand (then the whole layer).
    largest_layer_dense_bytes: int = 0
    # What a layer's attention materialises beyond the generic estimate (counted on a CUDA device: activation_bytes):
    # each head's (L, L) probabilities where the attention is eager (gpt-oss's sinks) or its keys and values differ
    # in width (DeepSeek's MLA: SDPA's flash kernels need them equal; counted, though CUDA's memory-efficient kernel
    # may not need it); a chunked linear attention or state-space layer (Qwen3.5's gated delta rule, 64-token chunks;
    # Nemotron-H's Mamba-2, ``chunk_size``) makes (chunk, chunk) blocks per chunk and head on its torch path.
    attention_probs: bool = False
    linear_heads: int = 0
    linear_chunk: int = 0

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
        from tinkerq.worker.loading.layers import decoder_layers  # what fully_shard wraps one by one
        from tinkerq.worker.lora.experts import is_fused_experts  # routed experts (expert parallelism)

        top_k, expert = _routed(text, hidden)
        full_bytes = _bytes(params)
        layers = list(decoder_layers(cast(Any, model))) if hasattr(model, "base_model") else []
        layer_bytes = [_bytes(layer.parameters()) for layer in layers]
        dense_bytes = [size - sum(_bytes(m.parameters()) for m in layer.modules() if is_fused_experts(m))
                       for layer, size in zip(layers, layer_bytes, strict=True)]
        return cls(
            param_bytes=sum(_local(p).numel() * p.element_size() for p in params),
            buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
            dtype_bytes=params[0].element_size(),
            layers=int(getattr(text, "num_hidden_layers", 0) or 1),
            hidden=int(getattr(text, "hidden_size", 0) or hidden),
            intermediate=_active_intermediate(text, hidden),
            heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", 0) or heads),
            head_dim=int(getattr(text, "head_dim", 0) or hidden // heads),
            vocab=int(getattr(text, "vocab_size", 0) or vocab),
            largest_layer_bytes=max(layer_bytes, default=0),
            root_bytes=full_bytes - sum(layer_bytes),
            parameters=sum(p.numel() for p in params),
            largest_weight_bytes=max((p.numel() * p.element_size() for p in params), default=0),
            top_k=top_k,
            routed_intermediate=top_k * expert,
            largest_layer_dense_bytes=max(dense_bytes, default=0),
            attention_probs=getattr(config, "_attn_implementation", None) == "eager" or _unequal_head_dims(text),
            **_linear_layers(text),
        )


def _bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)  # a DTensor's numel is the whole tensor's


def _routed(text: Any, hidden: int) -> tuple[int, int]:
    """(top-k, one routed expert's width) of a mixture of experts; (0, 0) for a dense model."""
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    if not top_k:
        return 0, 0
    dense = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    return top_k, int(getattr(text, "moe_intermediate_size", 0) or dense)  # gpt-oss: intermediate_size is the expert's


def _linear_layers(text: Any) -> dict[str, int]:
    """``linear_heads`` and ``linear_chunk`` of a model with chunked linear-attention or state-space layers."""
    if "linear_attention" not in (getattr(text, "layer_types", None) or []):
        return {}
    if getattr(text, "linear_num_value_heads", None):  # Qwen3.5's gated delta rule
        return {"linear_heads": int(text.linear_num_value_heads), "linear_chunk": GATED_DELTA_CHUNK}
    if getattr(text, "mamba_num_heads", None):  # Mamba-2 (Nemotron-H)
        return {"linear_heads": int(text.mamba_num_heads), "linear_chunk": int(getattr(text, "chunk_size", 0) or 256)}
    return {}


def _unequal_head_dims(text: Any) -> bool:
    """Whether attention's keys and values have different widths (multi-head latent attention)."""
    nope, rope = (int(getattr(text, k, 0) or 0) for k in ("qk_nope_head_dim", "qk_rope_head_dim"))
    value = int(getattr(text, "v_head_dim", 0) or 0)
    return bool(value) and nope + rope != value


def _active_intermediate(text: Any, hidden: int) -> int:
    """The MLP width a token goes through: a dense layer's ``intermediate_size``, or on a mixture of experts the
    routed experts' widths times how many a token uses, plus the shared experts' (the larger of the two, for
    models with both kinds of layers). Unknown: the classic 4 x hidden (an over- rather than an under-estimate)."""
    dense = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    top_k, expert = _routed(text, hidden)
    if not top_k:
        return dense
    shared = int(getattr(text, "n_shared_experts", 0) or 0) * expert
    shared += int(getattr(text, "shared_expert_intermediate_size", 0) or 0)
    return max(dense, top_k * expert + shared)


_shapes: weakref.WeakKeyDictionary[torch.nn.Module, ModelShape] = weakref.WeakKeyDictionary()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a sharded (DTensor) tensor; a plain tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


# A LoRA adapter's training state: float32 weights, pending gradients, AdamW exp_avg and exp_avg_sq.
LORA_BYTES_PER_PARAMETER = 16


def session_state_parts(shape: ModelShape, shards: int = 1) -> dict[str, int]:
    """A training session's state per shard, part by part (:func:`session_state_bytes` is their sum)."""
    return {"weights": shape.param_bytes // shards + shape.buffer_bytes, "gradients": shape.param_bytes // shards,
            "adamw": 2 * shape.param_bytes // shards}


def session_state_bytes(shape: ModelShape, shards: int = 1) -> int:
    """What a training session keeps for its whole life (see worker/training/engine.py), per shard.

    A full session's engine holds a deep copy of the model (parameters + buffers), ``p.grad`` for every
    parameter (the pending gradients, allocated at once), and AdamW's ``exp_avg`` and ``exp_avg_sq``
    (same shape and dtype; allocated at the session's first optim_step) plus a 0-dim float32 ``step``
    per parameter (negligible, not counted):

        state = weights + buffers + 3 x weights   (grad, exp_avg, exp_avg_sq)

    A sharded session holds 1/shards of each (buffers whole).
    """
    return sum(session_state_parts(shape, shards).values())


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


# A streaming load holds the weight being read and the loader's converted copy of it (experts stacked, then
# concatenated); the weights before it were given back to the OS (tests/test_streaming_load.py measures it).
STREAMED_LOAD_COPIES = 2


def streamed_load_bytes(shape: ModelShape) -> int:
    """Host memory a shard group's rank needs to read its shards from the files (worker/sharding/streaming.py),
    beyond the shards themselves (which live on its device):

        load = 2 x largest weight

    The whole base is never in one rank's memory (rank 0 reads it whole only for a merged LoRA save:
    :func:`snapshot_bytes`)."""
    return STREAMED_LOAD_COPIES * shape.largest_weight_bytes


def snapshot_bytes(shape: ModelShape) -> int:
    """A sampler snapshot: one copy of the model, frozen (no gradients, no optimizer state).

        snapshot = weights + buffers

    A snapshot is made (or loaded) before an older one may be evicted (worker/sampling/snapshots.py), so this much
    must be free for a moment.
    """
    return shape.param_bytes + shape.buffer_bytes


def lora_snapshot_bytes(adapter_parameters: int) -> int:
    """A LoRA sampler snapshot: the adapter's weights frozen, float32 (worker/lora/adapter.py ``FrozenAdapter``),
    whole on a shard group's rank 0.

        snapshot = 4 x adapter parameters
    """
    return 4 * adapter_parameters


def merged_save_bytes(shape: ModelShape, adapter_parameters: int, *, whole_base: bool) -> int:
    """A merged LoRA save (worker/lora/session.py ``write_merged``): the base with each adapted weight replaced by
    a merged copy, written as a plain model directory.

        merged = weights                         the merged copies (their dtype; every weight at most)
               + weights                         save_pretrained's copy of each tensor as it writes (measured: the
                                                 whole state, transformers 5)
               + 2 x largest weight x 4 / dtype  one module's weights merged in float32 at a time
               + 2 x adapter x 4                 its float32 weights: the copy the archive is written from, and
                                                 the frozen one merged in
               + weights + buffers               a shard group's rank 0 only: the whole base, read from the files
                                                 (a worker's own base is in memory already)
    """
    fp32_module = 2 * shape.largest_weight_bytes * 4 // max(1, shape.dtype_bytes)
    return (2 * shape.param_bytes + fp32_module + 2 * lora_snapshot_bytes(adapter_parameters)
            + (shape.param_bytes + shape.buffer_bytes if whole_base else 0))


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
               = 2.5 x kv     on the CPU (glibc rarely reuses the freed, smaller buffer for the next,
                              larger one: a decode-only request measured up to 3.1 x kv over 19 runs)
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
    grow = 5 * kv // 2 if cpu else kv // shape.layers
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
    """(rows, longest row) of each micro-batch run_loss will make of a batch (worker/training/batching.py)."""
    return [(stop - start, max(lengths[start:stop])) for start, stop in microbatch_ranges(lengths, microbatch_tokens)]


def batch_bytes(shape: ModelShape, lengths: list[int], *, microbatch_tokens: int, backward: bool,
                chunk_tokens: int | None, shards: int = 1, lora: bool = False, checkpointing: bool = False,
                expert_parallel: bool = False, device_type: str = "cpu") -> int:
    """A forward (backward=False) or forward_backward request: the largest micro-batch's peak + the data.

        batch  = activations (:func:`activation_bytes`) + grads + data (:func:`request_bytes`)
        grads  = training_working_bytes    (backward only: the request's gradient buffers; none for a LoRA
                                            request: its adapter's gradient buffers are in its state)

    A sharded worker splits datums across ranks, so rank 0's micro-batches are no larger than these; an
    expert-parallel group's rank may compute the routed experts of every rank's micro-batch (``expert_parallel``:
    :func:`activation_bytes` with ``expert_ranks=shards``).
    """
    grads = training_working_bytes(shape, shards) if backward and not lora else 0
    return (activation_bytes(shape, lengths, microbatch_tokens=microbatch_tokens, backward=backward,
                             chunk_tokens=chunk_tokens, checkpointing=checkpointing,
                             expert_ranks=shards if expert_parallel else 1, device_type=device_type)
            + grads + request_bytes(lengths))


def request_bytes(lengths: list[int]) -> int:
    """The request and reply themselves, whole request: ``data = 96 x tokens + 4096 x datums``."""
    return REQUEST_BYTES_PER_TOKEN * sum(lengths) + REQUEST_BYTES_PER_DATUM * len(lengths)


def activation_bytes(shape: ModelShape, lengths: list[int], *, microbatch_tokens: int, backward: bool,
                     chunk_tokens: int | None, checkpointing: bool = False, expert_ranks: int = 1,
                     request_tokens: int | None = None, device_type: str = "cpu") -> int:
    """The largest micro-batch's activations and loss head, of a batch of rows of these lengths.

    Per micro-batch of B rows padded to L tokens (N = B x L), activations saved for the backward pass,
    per layer (measured on Llama: ~7 x hidden + ~4.6 x intermediate values per token, plus the attention
    mask; rounded up; ``intermediate`` is the width a token goes through, top-k experts on a MoE):

        layer  = N x (10 x hidden + 6 x intermediate) x dtype_bytes + 2 x B x L x L x 4   (mask, float32)
        acts   = (layers + 1) x layer      backward: every layer saved + one layer's gradients in flight
               = layers x N x hidden x dtype_bytes + 4 x layer
                                           backward with activation checkpointing (worker/training/
                                           checkpointing.py): each layer's input saved; in the backward one
                                           layer recomputed, its saved activations and gradients in flight,
                                           and on the CPU the last layer's freed ones not yet reused (measured
                                           2.4 to 2.9 x layer over the inputs, depending on the heap's state:
                                           tests/test_checkpointing.py; 3 x layer once fell short in CI)
               = 2 x layer                 forward only: nothing is saved; one layer's temporaries at a time
        head   = 2 x C x V x 4 + 4 x N x hidden x dtype_bytes
                 (the chunked loss head holds one (C, V) float32 chunk of logits and its softmax, C =
                 chunk_tokens, and keeps the final hidden states; without the chunked head
                 (chunk_tokens None) C = N: full (B, L, V) logits, 3 copies: logits, float, grad)

    On an expert-parallel group (``expert_ranks`` W > 1, worker/sharding/experts.py) a rank computes its experts for
    the rows every rank routes to them: at worst (every token to this rank's experts) the tokens of W ranks'
    concurrent micro-batches, R = min(W x N, the request's tokens: ``request_tokens``, else those of
    ``lengths``). A MoE model's layer then adds

        (R - N) x 6 x routed x dtype_bytes             routed = top-k x the expert width (part of ``intermediate``)
        + 2 x (R + N) x top-k x hidden x dtype_bytes   the all-to-all's rows: sent and returned (N), received and
                                                       computed (R)

    A LoRA backward saves the same activations as a full one.

    On a CUDA device (``device_type="cuda"``; what `tinkerq plan` plans) the figure is what the tensors themselves
    hold, as ``torch.cuda.max_memory_allocated`` counts it: there is no heap to fragment (the allocator's slack is the
    plan's headroom), so a checkpointed backward has one layer's activations and one layer's backward in flight, not
    four layers' worth; and what a layer saves is counted for what the family's attention and an expert-parallel
    rank's experts really keep. Measured as live tensor bytes on the CPU (tests.helpers.LiveTensorBytes: within 15%
    on a 4-rank expert-parallel group, tests/test_expert_parallel.py; covering each family's step,
    tests/test_checkpointing.py):

        layer' = layer (without the expert-parallel terms above) + saved
        acts   = layers x N x hidden x dtype_bytes + layer' + backward     backward, checkpointed
               = layers x layer' + layer' + backward                        backward, every layer saved
               = 2 x layer'                                                 forward only
        saved  = P + 8 x N x linear heads x chunk x 4 + (M x (4 x hidden + 4 x expert) + 2 x N x top-k x hidden) x
                 dtype_bytes
        backward = max(2 x P, 4 x M x hidden x dtype_bytes)       the attention's, then the experts' (one at a time)
        P      = B x heads x L x (L + 1) x 4   attention that materialises its float32 probabilities (eager:
                                               gpt-oss, + 1 its sink column; keys and values of different widths:
                                               MLA, whose SDPA takes the math path on the CPU); their backward: 2 x P
                                               (their gradient, the softmax backward's); 0 otherwise
        linear heads, chunk                    a chunked linear attention's or state-space layer's heads and chunk
                                               (Qwen3.5's gated delta rule: value heads, 64; Mamba-2: its heads,
                                               ``chunk_size``): 8 (chunk, chunk) float32 blocks per chunk and head
                                               on the torch path (6 measured on the first, 7 to 8 on the second; N
                                               here with each row padded to whole chunks)
        M      = R x top-k                     an expert-parallel rank's routed rows, R as above (0 on one
                                               process: the generic layer covers its own, measured): received and
                                               computed, the experts' outputs (4 of the hidden width), their gate,
                                               up, activation and product (4 of the expert's width); the rank's own
                                               rows, sent and returned (2 x N x top-k); their gradients, 4 x M x hidden
    """
    live = device_type == "cuda"
    tokens = sum(lengths) if request_tokens is None else request_tokens  # the request's, for expert parallelism
    largest = 0
    for rows, longest in microbatches(lengths, microbatch_tokens):
        n = rows * longest
        layer = n * (10 * shape.hidden + 6 * shape.intermediate) * shape.dtype_bytes + 2 * rows * longest * longest * 4
        inputs = shape.layers * n * shape.hidden * shape.dtype_bytes  # what checkpointing saves
        if live:
            saved, in_flight = _live_layer_extra_bytes(shape, rows, longest, expert_ranks, tokens)
            layer += saved
            acts = (2 * layer if not backward else inputs + layer + in_flight if checkpointing
                    else shape.layers * layer + layer + in_flight)
        else:
            if expert_ranks > 1 and shape.top_k:
                # The routed experts of up to every rank's concurrent micro-batch (never more than the request's
                # tokens), and the all-to-all's rows: sent and returned for this micro-batch, received and computed
                # for all of them.
                routed_tokens = min(expert_ranks * n, max(n, tokens))
                layer += (routed_tokens - n) * 6 * shape.routed_intermediate * shape.dtype_bytes
                layer += 2 * (routed_tokens + n) * shape.top_k * shape.hidden * shape.dtype_bytes
            acts = 2 * layer if not backward else inputs + 4 * layer if checkpointing else (shape.layers + 1) * layer
        logits = 3 * n * shape.vocab * 4 if chunk_tokens is None else 2 * min(chunk_tokens, n) * shape.vocab * 4
        head = logits + 4 * n * shape.hidden * shape.dtype_bytes
        largest = max(largest, acts + head)
    return largest


# The chunk of transformers' torch gated delta rule (Qwen3.5's linear attention without the fla kernels).
GATED_DELTA_CHUNK = 64


def _live_layer_extra_bytes(shape: ModelShape, rows: int, longest: int, expert_ranks: int,
                            request_tokens: int) -> tuple[int, int]:
    """What a layer adds on a CUDA device (:func:`activation_bytes`) to the generic estimate, for a micro-batch of
    ``rows`` rows padded to ``longest`` tokens: (what it saves, the larger of its attention's and its experts'
    backward temporaries: the backward runs one, then the other)."""
    n = rows * longest
    probs = rows * shape.heads * longest * (longest + 1) * 4 if shape.attention_probs else 0
    chunk = max(1, shape.linear_chunk)
    chunked = rows * -(-longest // chunk) * chunk  # each row padded to whole chunks
    linear = 8 * chunked * shape.linear_heads * chunk * 4
    routed_saved = routed_backward = 0
    if shape.top_k and expert_ranks > 1:
        # The rows this rank's experts compute: at worst every rank's concurrent micro-batch, never more than the
        # request's tokens. (On one process the generic layer covers its own routed rows: measured.)
        m = shape.top_k * min(expert_ranks * n, max(n, request_tokens))
        expert = shape.routed_intermediate // shape.top_k
        own = 2 * n * shape.top_k * shape.hidden  # this rank's own rows, sent and returned
        routed_saved = (m * (4 * shape.hidden + 4 * expert) + own) * shape.dtype_bytes
        routed_backward = m * 4 * shape.hidden * shape.dtype_bytes
    return probs + linear + routed_saved, max(2 * probs, routed_backward)


# -- sharded groups (worker/sharding/) and LoRA tenants (worker/lora/) --------------------------------------------


def gather_bytes(shape: ModelShape, shards: int, *, weight_grads: bool, expert_parallel: bool = False) -> int:
    """FSDP's transient room on each shard of a group (worker/sharding/fsdp.py); 0 on one worker.

    ``fully_shard`` wraps every decoder layer and a root (the embeddings, the final norm, the output weight).
    A layer is all-gathered whole for its forward and again for its backward, and the next one is prefetched
    while it runs; the root's parameters stay gathered from the forward through the backward:

        gather = root + 2 x largest layer                  (full-size parameters, the model's dtype)
               x 2 when the weights train                  (their unsharded gradients, before reduce-scatter)

    The 1/shards piece a shard holds anyway is not subtracted (a little high, as every estimate here). With
    ``expert_parallel`` a layer is gathered without its routed experts (``largest_layer_dense_bytes``).
    """
    if shards <= 1:
        return 0
    layer = shape.largest_layer_dense_bytes if expert_parallel and shape.largest_layer_dense_bytes else \
        shape.largest_layer_bytes
    room = shape.root_bytes + 2 * layer
    return 2 * room if weight_grads else room


def full_session_bytes(shape: ModelShape, shards: int = 1, *, expert_parallel: bool = False) -> int:
    """What a new full-parameter session needs per shard besides its requests' activations (admission's figure):

        full = session_state_bytes + training_working_bytes + gather_bytes(weights train)
    """
    return (session_state_bytes(shape, shards) + training_working_bytes(shape, shards)
            + gather_bytes(shape, shards, weight_grads=True, expert_parallel=expert_parallel))


def lora_state_bytes(parameters: int, *, expert_parameters: int = 0, expert_ranks: int = 1) -> int:
    """One LoRA tenant's adapter on one rank: float32 weights, pending gradients, AdamW's two moments (16 B per
    parameter).

    On a shard group each rank holds the whole adapter (replicated: a request's datums are split across ranks,
    every rank trains the same A and B), so this is per shard too and more shards do not make it smaller; except on
    an expert-parallel group (``expert_ranks`` ranks), where the ``expert_parameters`` of it (the per-expert factors:
    w1/w3's B, w2's A) are split with the experts (worker/sharding/experts.py).
    """
    per_rank = parameters - expert_parameters + -(-expert_parameters // max(1, expert_ranks))
    return LORA_BYTES_PER_PARAMETER * per_rank


def lora_base_bytes(shape: ModelShape, shards: int = 1) -> int:
    """The frozen base LoRA tenants share, per shard: sharded once over the group, no gradients, no optimizer
    state (``base = weights / shards + buffers``; on one worker, :func:`snapshot_bytes`)."""
    return shape.param_bytes // shards + shape.buffer_bytes


def rank_lengths(lengths: list[int], shards: int) -> list[int]:
    """The datums the fullest rank of a group gets: contiguous runs whose sizes differ by at most one
    (worker/training/batching.py's ``rank_plans``); the longest ones, to be safe."""
    per_rank = -(-len(lengths) // max(1, shards))
    return sorted(lengths, reverse=True)[:per_rank]


def shards_needed(need: Callable[[int], int], room: int, *, start: int = 1, limit: int = 4096) -> int | None:
    """The fewest shards ``n >= start`` with ``need(n) <= room``, or None when no count up to ``limit`` fits (a
    part every shard holds whole, such as a LoRA adapter or FSDP's gather room, is larger than ``room``)."""
    for n in range(max(1, start), limit + 1):
        if need(n) <= room:
            return n
    return None
