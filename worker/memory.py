"""How much memory the worker may still use, what a request will need, and giving freed memory back.

A worker that runs out of memory dies (host: the kernel's OOM killer; device: a CUDA OOM that can leave
a session half-changed) and takes every session with it. So requests that allocate in proportion to
what the caller asked for are admitted first: a new training session, a sampler snapshot, a sample
request (its KV cache) and a forward / forward_backward batch (its activations). Each is estimated from
the model's shape and refused with :class:`CapacityError` *before* anything is allocated when it would
not fit in what is free.

What is free:

* host: ``MemAvailable`` from ``/proc/meminfo``, lowered by the cgroup's limit when one is set
  (v2 ``memory.max - memory.current``, v1 ``memory.limit_in_bytes - memory.usage_in_bytes``, each plus
  the reclaimable ``inactive_file`` page cache, on every level up to the root), and by the operator's
  cap ``TINKERQ_MEMORY_LIMIT_MB`` (a bound on this process's own RSS: cap - current RSS is left);
* device (CUDA): ``torch.cuda.mem_get_info`` plus what torch's caching allocator holds but does not use.

The estimates are deliberately a little high (activations especially, see :func:`batch_bytes`): refusing
a request that would just have fitted costs a retry with a smaller one; admitting one that does not fit
costs the worker.

Giving memory back (:func:`release_memory`): Python's and glibc's allocators keep freed memory for reuse,
so after one large request the worker's RSS stays at its peak. ``gc.collect()`` + glibc's
``malloc_trim(0)`` return it; :mod:`tinkerq.worker.service` calls it after requests whose payload or reply was
larger than :data:`LARGE_BYTES`.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import platform
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tinkerq.errors import CapacityError
from tinkerq.worker.batching import microbatch_ranges

log = logging.getLogger("tinkerq.worker")

MiB = 1024 * 1024
# A request whose payload or reply is larger than this is followed by release_memory(): below it the
# allocators' kept memory is small, and gc + trim (tens of ms) would cost more than it returns.
LARGE_BYTES = 8 * MiB
# Kept free beyond every estimate on the host: Python objects, the allocators' slack, the reply being
# packed. Small against any real model; it keeps a tight cap from being filled to the last byte.
HOST_HEADROOM_BYTES = 32 * MiB
# cgroup v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages); anything above this is no limit.
_NO_LIMIT = 1 << 60


# -- what is free ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Free:
    """Bytes this worker may still allocate on one device, and which limit decided it (for messages)."""

    nbytes: int
    limited_by: str


def meminfo_available(proc: Path = Path("/proc")) -> int | None:
    """``MemAvailable`` (bytes): free memory plus what the kernel can reclaim without swapping."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes(pid: int | str = "self", proc: Path = Path("/proc")) -> int:
    """Resident set size of a process (``VmRSS`` in /proc/<pid>/status), bytes; 0 if unreadable."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":  # cgroup v2: no limit
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < _NO_LIMIT else None


def _stat_value(path: Path, *keys: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name in keys:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_available(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes left under this process's cgroup memory limits (the tightest level), None when none is set.

    Each level with a limit leaves ``limit - usage + inactive_file``: page cache the kernel reclaims
    before it OOM-kills counts as free, as it does in MemAvailable. Levels are walked from this
    process's cgroup up to the mount's root; inside a container the cgroup namespace makes the path "/".
    """
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy: "0::/path"
            base, limit_file, usage_file, cache_keys = cgroup_root, "memory.max", "memory.current", ("inactive_file",)
        elif "memory" in controllers.split(","):  # v1 memory controller: "4:memory:/path"
            base, limit_file, usage_file = cgroup_root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache_keys = ("total_inactive_file", "inactive_file")
        else:
            continue
        level = base / path.lstrip("/")
        while True:
            limit = _read_int(level / limit_file)
            usage = _read_int(level / usage_file)
            if limit is not None and usage is not None:
                left = max(0, limit - usage + _stat_value(level / "memory.stat", *cache_keys))
                best = left if best is None else min(best, left)
            if level == base or base not in level.parents:
                break
            level = level.parent
    return best


def host_free(limit_mb: int = 0) -> Free:
    """Bytes this worker may still allocate on the host: the smallest of MemAvailable, the cgroup's
    room, and the operator's cap (``limit_mb`` MiB for this process's RSS; 0 = no cap)."""
    candidates = []
    available = meminfo_available()
    if available is not None:
        candidates.append(Free(available, "the host's available memory (MemAvailable)"))
    room = cgroup_available()
    if room is not None:
        candidates.append(Free(room, "the container's memory limit (cgroup)"))
    if limit_mb > 0:
        candidates.append(Free(max(0, limit_mb * MiB - rss_bytes()),
                               f"TINKERQ_MEMORY_LIMIT_MB={limit_mb} for this worker process"))
    if not candidates:  # not Linux: nothing to go by, admit (the estimates still guard nothing)
        return Free(1 << 62, "no memory information on this platform")
    return min(candidates, key=lambda f: f.nbytes)


def device_free(device: str | torch.device, limit_mb: int = 0) -> Free:
    """Bytes free where a worker on ``device`` allocates its tensors (the host for cpu)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host_free(limit_mb)
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, _total = torch.cuda.mem_get_info(index)
    # Blocks torch's caching allocator holds but no tensor uses are free to this process too.
    cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    return Free(free + cached, f"free memory on cuda:{index}")


def describe(nbytes: int) -> str:
    if nbytes >= 10 * 1024 * MiB:
        return f"{nbytes / (1024 * MiB):.0f} GiB"
    if nbytes >= 1024 * MiB:
        return f"{nbytes / (1024 * MiB):.1f} GiB"
    return f"{nbytes / MiB:.1f} MiB"


RECENT_S = 0.5
_recent_free: dict[tuple[str, int], tuple[float, int]] = {}


def require(nbytes: int, what: str, device: str | torch.device, *, limit_mb: int = 0,
            advice: str = "close unused training clients (tc.close()) or use another worker") -> None:
    """Raise :class:`CapacityError` unless ``nbytes`` more fit on ``device``; call it before allocating.

    When it would not fit, freed memory that the allocators kept is returned first (release_memory),
    and the check is made again: after a closed session or a large request that memory is free in fact.
    """
    device = torch.device(device)
    headroom = HOST_HEADROOM_BYTES if device.type != "cuda" else 0
    # Reading /proc and the cgroup files costs ~0.4 ms: a request that needs a sliver of what was free a
    # moment ago is admitted on that reading (most requests; big ones are always measured afresh).
    key = (str(device), limit_mb)
    seen = _recent_free.get(key)
    if seen is not None and time.monotonic() - seen[0] < RECENT_S and nbytes + headroom <= seen[1] // 16:
        return
    free = device_free(device, limit_mb)
    _recent_free[key] = (time.monotonic(), free.nbytes)
    if nbytes + headroom <= free.nbytes:
        return
    release_memory()
    free = device_free(device, limit_mb)
    if nbytes + headroom <= free.nbytes:
        return
    where = "host" if device.type != "cuda" else str(device)
    raise CapacityError(
        f"{what} needs about {describe(nbytes)} of {where} memory, but only "
        f"{describe(max(0, free.nbytes - headroom))} is free (limited by {free.limited_by}); nothing was "
        f"allocated. {advice[0].upper()}{advice[1:]}",
        needed_bytes=nbytes, free_bytes=free.nbytes,
    )


# -- what things need ---------------------------------------------------------------------------------------


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
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        embeddings = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else params[0]
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


# -- admission, as the worker service calls it -----------------------------------------------------------


def admit_session(model: torch.nn.Module, settings: Any, sessions: Iterable[Any]) -> None:
    """Refuse a new training session that would not fit (with the room training needs, and the AdamW
    state open sessions have not allocated yet)."""
    shape, shards = ModelShape.of(model), settings.shards
    promised = unallocated_state_bytes(sessions)
    needed = session_state_bytes(shape, shards) + training_working_bytes(shape, shards) + promised
    require(needed, "a new training session (weights, gradients and AdamW state"
            + (f", 1/{shards} per shard" if shards > 1 else "")
            + (f"; {describe(promised)} of it is the AdamW state open sessions allocate at their first "
               f"optim_step" if promised else "") + ")",
            settings.device, limit_mb=settings.memory_limit_mb,
            advice="close unused training clients (tc.close()), or create this one on another worker")


def admit_lora_session(parameters: int, settings: Any, sessions: Iterable[Any]) -> None:
    """Refuse a new LoRA session whose adapter would not fit: its float32 weights, pending gradients and AdamW
    moments (16 bytes per parameter), beside the AdamW state open sessions have not allocated yet."""
    promised = unallocated_state_bytes(sessions)
    require(LORA_BYTES_PER_PARAMETER * parameters + promised,
            f"a new LoRA adapter ({parameters:,} parameters: weights, gradients and AdamW state"
            + (f"; {describe(promised)} of it is the AdamW state open sessions allocate at their first optim_step"
               if promised else "") + ")",
            settings.device, limit_mb=settings.memory_limit_mb,
            advice="close unused training clients (tc.close()), use a lower rank, or open it on another worker")


def admit_snapshot(model: torch.nn.Module, settings: Any, sessions: Iterable[Any]) -> None:
    """Refuse a sampler snapshot (a copy of the weights) that would not fit."""
    shape = ModelShape.of(model)
    needed = snapshot_bytes(shape) + training_working_bytes(shape, settings.shards) + unallocated_state_bytes(sessions)
    require(needed, "a sampling snapshot (a copy of the weights)", settings.device,
            limit_mb=settings.memory_limit_mb,
            advice="close unused training clients (tc.close()) or lower TINKERQ_MAX_SAMPLERS, then retry")


def admit_sample(model: torch.nn.Module, settings: Any, prompt_tokens: int, max_tokens: int,
                 num_samples: int) -> None:
    """Refuse a sample request whose KV cache and logits would not fit."""
    needed = sample_bytes(ModelShape.of(model), prompt_tokens, max_tokens, num_samples,
                          device_type=torch.device(settings.device).type)
    require(needed, f"sampling {num_samples} sequence(s) of {prompt_tokens} prompt + {max_tokens} new tokens "
            f"(KV cache and logits)", settings.device, limit_mb=settings.memory_limit_mb,
            advice="ask for fewer samples per request (num_samples) or fewer new tokens (max_tokens), "
                   "or send the request in several smaller ones")


def admit_batch(model: torch.nn.Module, settings: Any, lengths: list[int], *, backward: bool,
                logprobs: Any, lora: bool = False) -> None:
    """Refuse a forward / forward_backward batch whose largest micro-batch would not fit."""
    chunk = getattr(logprobs, "chunk_tokens", None) if getattr(logprobs, "backend", "") != "model-logits" else None
    needed = batch_bytes(ModelShape.of(model), lengths, microbatch_tokens=settings.microbatch_tokens,
                         backward=backward, chunk_tokens=chunk, shards=settings.shards, lora=lora)
    op = "forward_backward" if backward else "forward"
    require(needed, f"{op} on {len(lengths)} datum(s), {sum(lengths)} tokens, longest {max(lengths, default=0)} "
            f"(activations of micro-batches of up to {settings.microbatch_tokens} padded tokens)",
            settings.device, limit_mb=settings.memory_limit_mb,
            advice="send a smaller batch (split it into several forward_backward calls; gradients add up), "
                   "shorter sequences, or ask the operator to lower TINKERQ_MICROBATCH_TOKENS")


# -- giving memory back --------------------------------------------------------------------------------------


def _glibc() -> Any | None:
    """The C library when it is glibc (malloc_trim and mallopt are glibc extensions), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


_LIBC = _glibc()


def release_memory() -> int:
    """Return freed memory to the OS: collect garbage, then glibc's ``malloc_trim(0)``.

    Python frees most objects at once (reference counts); ``gc.collect`` gets the cycles (autograd
    graphs, exceptions with tracebacks). glibc keeps freed heap memory in its arenas, and raises its
    mmap threshold after each large free so later buffers below 32 MiB come from the heap too; trim
    gives the free pages of every arena back (madvise), which is what brings RSS back down.
    Returns the bytes of RSS released (for the log).

    Measured on a worker after 4 forwards of 2M tokens and a forward_backward (tiny model): RSS grew
    by 329 MB without this, by 87 MB with it (of which 64 MB are the kept replies). Fixing glibc's
    mmap threshold (mallopt M_MMAP_THRESHOLD = 4 MiB, M_ARENA_MAX = 2) at start did not help on its own
    (+378 MB) nor on top of this (+84 MB): what stays behind is many small blocks, not large buffers.
    """
    before = rss_bytes()
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    released = max(0, before - rss_bytes())
    if released:
        log.debug("released %.1f MiB to the OS", released / MiB)
    return released


def is_large(ref: Any, outcome: Any) -> bool:
    """Whether a request (its payload reference) or its answer was larger than :data:`LARGE_BYTES`.

    Never raises, whatever the sender put in the reference (it runs after the request was applied).
    """
    size = 0
    if isinstance(ref, dict):
        inline, claimed = ref.get("inline"), ref.get("size")
        if isinstance(inline, (bytes, bytearray)):
            size = len(inline)
        elif isinstance(claimed, int) and not isinstance(claimed, bool):
            size = claimed
    body = outcome[1] if isinstance(outcome, tuple) and len(outcome) > 1 else None
    if isinstance(body, (bytes, bytearray)):
        size = max(size, len(body))
    return size > LARGE_BYTES
