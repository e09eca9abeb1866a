"""How much memory the worker may still use, what a request will need, and giving freed memory back.

A worker that runs out of memory dies (host: the kernel's OOM killer; device: a CUDA OOM that can leave
a session half-changed) and takes every session with it. So requests that allocate in proportion to
what the caller asked for are admitted first: a new training session, a sampler snapshot, a sample
request (its KV cache) and a forward / forward_backward batch (its activations). Each is estimated from
the model's shape and refused with :class:`CapacityError` *before* anything is allocated when it would
not fit in what is free.

Here: admission (:func:`require` and the ``admit_*`` calls the worker service makes). The parts, each in its
own module and all re-exported here, so callers import ``tinkerq.worker.memory`` alone:

* what is free on the host and on a device (worker/memory/free.py: ``MemAvailable``, the cgroup's limits,
  the operator's cap ``TINKERQ_MEMORY_LIMIT_MB``; CUDA's free memory and the caching allocator's slack);
* what things need (worker/memory/estimates.py), estimated a little high: refusing a request that would
  just have fitted costs a retry with a smaller one; admitting one that does not fit costs the worker;
* giving freed memory back to the OS after large requests (worker/memory/release.py:
  :func:`release_memory`, :func:`is_large`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from tinkerq.errors import CapacityError
from tinkerq.worker.memory.estimates import (
    LORA_BYTES_PER_PARAMETER,
    REQUEST_BYTES_PER_DATUM,
    REQUEST_BYTES_PER_TOKEN,
    ModelShape,
    activation_bytes,
    batch_bytes,
    full_session_bytes,
    gather_bytes,
    lora_base_bytes,
    lora_snapshot_bytes,
    lora_state_bytes,
    merged_save_bytes,
    microbatches,
    request_bytes,
    sample_bytes,
    session_state_bytes,
    session_state_parts,
    shards_needed,
    snapshot_bytes,
    streamed_load_bytes,
    training_working_bytes,
    unallocated_state_bytes,
)
from tinkerq.worker.memory.free import (
    Free,
    MiB,
    cgroup_available,
    describe,
    device_free,
    host_free,
    meminfo_available,
    rss_bytes,
)
from tinkerq.worker.memory.release import _LIBC, LARGE_BYTES, is_large, release_memory

__all__ = [  # what is free, what things need, giving back (their modules), and admission (here)
    "HOST_HEADROOM_BYTES", "LARGE_BYTES", "LORA_BYTES_PER_PARAMETER", "REQUEST_BYTES_PER_DATUM",
    "REQUEST_BYTES_PER_TOKEN", "_LIBC", "CapacityError", "Free", "MiB", "ModelShape", "activation_bytes",
    "admit_batch", "admit_lora_session", "admit_lora_snapshot", "admit_merged_save", "admit_sample", "admit_session",
    "admit_snapshot", "batch_bytes", "cgroup_available", "describe", "device_free", "full_session_bytes",
    "gather_bytes", "host_free", "is_large", "lora_base_bytes", "lora_snapshot_bytes", "lora_state_bytes",
    "meminfo_available", "merged_save_bytes", "microbatches", "release_memory", "request_bytes",
    "require", "rss_bytes", "sample_bytes", "session_state_bytes", "session_state_parts", "shards_for_lora",
    "shards_for_session", "shards_needed", "snapshot_bytes", "streamed_load_bytes", "training_working_bytes",
    "unallocated_state_bytes",
]

# Kept free beyond every estimate on the host: Python objects, the allocators' slack, the reply being
# packed. Small against any real model; it keeps a tight cap from being filled to the last byte.
HOST_HEADROOM_BYTES = 32 * MiB


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



# -- admission, as the worker service calls it -----------------------------------------------------------


def admit_session(model: torch.nn.Module, settings: Any, sessions: Iterable[Any]) -> None:
    """Refuse a new training session that would not fit (with the room training needs, FSDP's gather room on a
    shard group, and the AdamW state open sessions have not allocated yet). The refusal says how many shards it
    would need (:func:`shards_for_session`, the planner's figure: docs/planning.md)."""
    shape, shards = ModelShape.of(model), settings.shards
    promised = unallocated_state_bytes(sessions)
    ep = bool(getattr(settings, "expert_parallel", False))
    needed = full_session_bytes(shape, shards, expert_parallel=ep) + promised
    try:
        require(needed, "a new training session (weights, gradients and AdamW state"
                + (f", 1/{shards} per shard" if shards > 1 else "")
                + (f"; {describe(promised)} of it is the AdamW state open sessions allocate at their first "
                   f"optim_step" if promised else "") + ")",
                settings.device, limit_mb=settings.memory_limit_mb,
                advice="close unused training clients (tc.close()), or create this one on another worker")
    except CapacityError as exc:
        room = _room(exc, settings.device)
        n = shards_for_session(shape, room, shards=shards, promised=promised)
        if n is not None:
            hint = (f"; or shard the model: with {describe(room)} free on each device, as here now, it needs {n} "
                    f"shards (about {describe(full_session_bytes(shape, n))} each): start the worker with --shards "
                    f"{n}, one shard per device (tinkerq plan plans a whole group, activations included: "
                    f"docs/planning.md).")
        else:
            hint = (f"; no number of shards makes room for it here: FSDP's gather room alone, held whole on every "
                    f"shard, is {describe(gather_bytes(shape, 2, weight_grads=True))} (docs/planning.md).")
        raise CapacityError(exc.message + hint, **{**exc.details, "shards_needed": n or 0}) from None


def shards_for_session(shape: ModelShape, room: int, *, shards: int = 1, promised: int = 0) -> int | None:
    """The fewest shards (more than ``shards``, the group's size now) whose share of a new full session fits in
    ``room`` bytes per device; ``promised``, the AdamW state open sessions still allocate, is split the same way.
    None if no count fits (the gather room every shard holds whole is larger than ``room``)."""
    return shards_needed(lambda n: full_session_bytes(shape, n) + promised * shards // n, room, start=shards + 1)


def shards_for_lora(shape: ModelShape, parameters: int, room: int, *, shards: int = 1, promised: int = 0) -> int | None:
    """The fewest shards (more than ``shards``) that make room for a new LoRA adapter of ``parameters`` in ``room``
    bytes per device: sharding the frozen base finer frees part of its share; the adapter itself is held whole
    on every shard, so past some count more shards do not help (None)."""
    def need(n: int) -> int:
        freed = lora_base_bytes(shape, shards) - lora_base_bytes(shape, n)
        return lora_state_bytes(parameters) + promised + gather_bytes(shape, n, weight_grads=False) - freed
    return shards_needed(need, room, start=shards + 1)


def _room(exc: CapacityError, device: str | torch.device) -> int:
    """What :func:`require` found free, less the headroom it keeps."""
    headroom = HOST_HEADROOM_BYTES if torch.device(device).type != "cuda" else 0
    return max(0, int(exc.details.get("free_bytes", 0)) - headroom)


def admit_lora_session(parameters: int, settings: Any, sessions: Iterable[Any],
                       model: torch.nn.Module | None = None, *, sharded_base: bool = False,
                       expert_parallel: bool = False, expert_parameters: int = 0,
                       base_bytes: int | None = None) -> None:
    """Refuse a new LoRA session whose adapter would not fit: its float32 weights, pending gradients and AdamW
    moments (16 bytes per parameter), beside the AdamW state open sessions have not allocated yet. Given the base
    ``model``, the refusal also says whether more shards would make room (:func:`shards_for_lora`).
    ``sharded_base``: the first LoRA session of a shard group, which also makes the group's sharded copy of the
    base (:func:`lora_base_bytes` + FSDP's gather room, per shard). ``expert_parallel``: an expert-parallel group (its
    base's MoE layers gathered without their experts), over whose ranks the adapter's ``expert_parameters`` (its
    per-expert factors) are split. ``base_bytes``: that base's share per rank when it is not the weights / N (a group
    keeping its quantized experts as stored counts them from the files)."""
    promised = unallocated_state_bytes(sessions)
    ep = expert_parallel and settings.shards > 1
    base = 0
    if sharded_base and model is not None:
        shape = ModelShape.of(model)
        share = base_bytes if base_bytes is not None else lora_base_bytes(shape, settings.shards)
        base = share + gather_bytes(shape, settings.shards, weight_grads=False, expert_parallel=ep)
    state = lora_state_bytes(parameters, expert_parameters=expert_parameters if ep else 0,
                             expert_ranks=settings.shards)
    try:
        require(state + promised + base,
                f"a new LoRA adapter ({parameters:,} parameters: weights, gradients and AdamW state"
                + (f"; {describe(promised)} of it is the AdamW state open sessions allocate at their first "
                   f"optim_step" if promised else "")
                + (f"; {describe(base)} of it is the frozen base sharded over the group, made by its first LoRA "
                   f"session" if base else "") + ")",
                settings.device, limit_mb=settings.memory_limit_mb,
                advice="close unused training clients (tc.close()), use a lower rank, or open it on another worker")
    except CapacityError as exc:
        if model is None:
            raise
        shape, room = ModelShape.of(model), _room(exc, settings.device)
        n = shards_for_lora(shape, parameters, room, shards=settings.shards, promised=promised)
        if n is not None:
            hint = (f"; or shard the frozen base finer: with {n} shards (--shards {n}) its share frees enough room "
                    f"on each device (docs/planning.md).")
        else:
            hint = ("; more shards would not make room: the adapter is held whole on every shard (docs/planning.md).")
        raise CapacityError(exc.message + hint, **{**exc.details, "shards_needed": n or 0}) from None


def admit_snapshot(model: torch.nn.Module, settings: Any, sessions: Iterable[Any]) -> None:
    """Refuse a sampler snapshot (a copy of the weights) that would not fit."""
    shape = ModelShape.of(model)
    needed = snapshot_bytes(shape) + training_working_bytes(shape, settings.shards) + unallocated_state_bytes(sessions)
    require(needed, "a sampling snapshot (a copy of the weights)", settings.device,
            limit_mb=settings.memory_limit_mb,
            advice="close unused training clients (tc.close()) or lower TINKERQ_MAX_SAMPLERS, then retry")


def admit_merged_save(model: torch.nn.Module, settings: Any, adapter_parameters: int, *, whole_base: bool) -> None:
    """Refuse a merged LoRA save (``save_weights_for_sampler(merged=True)``) that would not fit, before the base is
    read or copied: on a shard group's rank 0 the whole base is read onto the host for it."""
    shape = ModelShape.of(model)
    device = "cpu" if whole_base else settings.device
    require(merged_save_bytes(shape, adapter_parameters, whole_base=whole_base),
            "a merged save (the base with the adapter merged in"
            + (", read whole onto rank 0's host from the files)" if whole_base else ")"),
            device, limit_mb=settings.memory_limit_mb,
            advice="save without merged=True: the archive's PEFT adapter loads over the base model in vLLM, PEFT "
                   "or transformers, and merges there (docs/lora.md)")


def admit_lora_snapshot(nbytes: int, settings: Any) -> None:
    """Refuse a LoRA sampler snapshot of ``nbytes`` (:func:`lora_snapshot_bytes` for one made here; a loaded one's
    file size) that would not fit; small on most models, 11.5 GiB at rank 32 on DeepSeek-V3.1."""
    require(nbytes, "a LoRA sampling snapshot (a frozen copy of the adapter)", settings.device,
            limit_mb=settings.memory_limit_mb,
            advice="close unused training or sampling clients, or lower TINKERQ_MAX_SAMPLERS, then retry")


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
                logprobs: Any, lora: bool = False) -> bool:
    """Refuse a forward / forward_backward batch whose largest micro-batch would not fit; returns whether its
    decoder layers are to be checkpointed (worker/training/checkpointing.py): ``TINKERQ_ACTIVATION_CHECKPOINTING``
    on, or auto and the batch fits only with it."""
    chunk = getattr(logprobs, "chunk_tokens", None) if getattr(logprobs, "backend", "") != "model-logits" else None
    mode = settings.activation_checkpointing if backward else "off"  # a forward saves nothing for a backward

    def needed(checkpointing: bool) -> int:
        return batch_bytes(ModelShape.of(model), lengths, microbatch_tokens=settings.microbatch_tokens,
                           backward=backward, chunk_tokens=chunk, shards=settings.shards, lora=lora,
                           checkpointing=checkpointing,
                           expert_parallel=bool(getattr(settings, "expert_parallel", False)),
                           device_type=torch.device(settings.device).type)

    op = "forward_backward" if backward else "forward"
    what = (f"{op} on {len(lengths)} datum(s), {sum(lengths)} tokens, longest {max(lengths, default=0)} "
            f"(activations of micro-batches of up to {settings.microbatch_tokens} padded tokens")
    advice = ("send a smaller batch (split it into several forward_backward calls; gradients add up), "
              "shorter sequences, or ask the operator to lower TINKERQ_MICROBATCH_TOKENS")

    def admit(checkpointing: bool) -> None:
        require(needed(checkpointing), what + (", decoder layers checkpointed)" if checkpointing else ")"),
                settings.device, limit_mb=settings.memory_limit_mb,
                advice=advice + ", or turn activation checkpointing on (TINKERQ_ACTIVATION_CHECKPOINTING=auto)"
                if backward and mode == "off" else advice)

    if mode != "auto":
        admit(mode == "on")
        return mode == "on"
    try:
        admit(False)
        return False
    except CapacityError:
        admit(True)  # raises when it does not fit even so
        return True
