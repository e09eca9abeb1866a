"""Validation of whole requests, before anything touches a model.

The same functions run in the producer (so most mistakes fail fast, without using a sequence number)
and in the worker (which trusts nothing on the wire). Every error names the datum and the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from tinkerq import types
from tinkerq.errors import ModelLoadError, ValidationError


@dataclass(frozen=True)
class LossSpec:
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    # loss_fn_config keys -> default (None = required)
    config: tuple[tuple[str, float | None], ...] = ()


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_CLIP = (("clip_low_threshold", 0.8), ("clip_high_threshold", 1.2))

# loss_fn -> which loss_fn_inputs it needs (../shared/reference/tinker-api.md §2). RL inputs are optional for
# cross_entropy so an RL batch can be scored with it; they are never required for SFT.
LOSS_SPECS: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(required=("target_tokens", "weights"), optional=("logprobs", "advantages")),
    "importance_sampling": LossSpec(required=_RL_INPUTS),
    "ppo": LossSpec(required=_RL_INPUTS, config=_CLIP),
    "cispo": LossSpec(required=_RL_INPUTS, config=_CLIP),
    "dro": LossSpec(required=_RL_INPUTS, config=(("beta", None),)),
    "gspo": LossSpec(required=(*_RL_INPUTS, "sequence_ratio_mask"), config=_CLIP),
}


# Names SDK 0.38 carries without defining what they compute: types/loss_fn_type.py lists "stable_reinforce" (and a
# docstring mentions its kl_coeff), types/sample_request.py and the clients' docstrings say record_stability_info
# "records stability information" for it, but no formula or recorded quantity is in its source or docs (nor in
# tinker-cookbook's, which only selects them). Each is refused with a message saying so, never approximated. (The
# Dimuon optimizer, also undefined there, is served with a definition of tinkerq's own: docs/optimizers.md.)
UNDEFINED_BY_SDK: dict[str, str] = {
    "stable_reinforce": "loss_fn 'stable_reinforce' is not served: the tinker SDK (0.38) names it but does not define "
                        "its loss (no formula in its source or docs), so this server cannot compute it; use "
                        "importance_sampling, ppo or cispo",
    "record_stability_info": "record_stability_info is not served: the tinker SDK (0.38) does not define what "
                             "stability information is recorded, nor the stable_reinforce loss that reads it, so "
                             "this server cannot compute either; sample without it (e.g. the cookbook's "
                             "loss_fn=importance_sampling)",
}


def resolve_loss_config(loss_fn: str, loss_fn_config: Any) -> dict[str, float]:
    """The loss's full config (defaults filled in); ValidationError for unknown, missing or bad values."""
    spec = LOSS_SPECS[loss_fn]
    config = loss_fn_config or {}
    if not isinstance(config, dict):
        raise ValidationError(f"loss_fn_config must be a dict or None, got {type(loss_fn_config).__name__}")
    known = dict(spec.config)
    unknown = set(config) - set(known)
    if unknown:
        raise ValidationError(
            f"loss_fn_config keys {sorted(unknown)} are not understood by {loss_fn!r} "
            f"(it takes {sorted(known) or 'none'})"
        )
    resolved: dict[str, float] = {}
    for key, default in spec.config:
        value = config.get(key, default)
        if value is None:
            raise ValidationError(f"loss_fn_config[{key!r}] is required by {loss_fn!r}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValidationError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        resolved[key] = float(value)
    if "clip_low_threshold" in resolved:
        low, high = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
        if not 0.0 <= low <= 1.0 <= high:
            raise ValidationError(
                f"{loss_fn!r} needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {low} and {high}"
            )
    if resolved.get("beta", 0.0) < 0:
        raise ValidationError(f"loss_fn_config['beta'] must be >= 0, got {resolved['beta']}")
    return resolved


@dataclass(frozen=True)
class Limits:
    max_datums: int
    max_batch_tokens: int


def validate_loss_request(
    data: Any,
    loss_fn: Any,
    loss_fn_config: Any,
    *,
    limits: Limits,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
) -> None:
    """Raise ValidationError for the first problem found in a forward/forward_backward request."""
    spec = LOSS_SPECS.get(loss_fn) if isinstance(loss_fn, str) else None
    if spec is None and loss_fn in UNDEFINED_BY_SDK:
        raise ValidationError(UNDEFINED_BY_SDK[loss_fn])
    if spec is None and loss_fn == "custom":  # the SDK sends it only to a server that runs uploaded losses
        raise ValidationError("loss_fn 'custom' is a loss uploaded to the server (ServiceClient.create_custom_loss "
                              "with custom_loss_server_side), which this fleet does not run: use "
                              "TrainingClient.forward_backward_custom, which runs the loss on the client")
    if spec is None:
        raise ValidationError(f"unknown loss_fn {loss_fn!r}; this fleet serves {sorted(LOSS_SPECS)}")
    resolve_loss_config(loss_fn, loss_fn_config)
    if not isinstance(data, (list, tuple)):
        raise ValidationError(f"data must be a list of Datum, got {type(data).__name__}")
    if not data:
        raise ValidationError("data is empty: forward_backward needs at least one Datum")
    if len(data) > limits.max_datums:
        raise ValidationError(
            f"batch has {len(data)} datums, more than the limit of {limits.max_datums} "
            f"(TINKERQ_MAX_DATUMS); split it into several forward_backward calls (gradients add up)"
        )
    total = 0
    allowed = set(spec.required) | set(spec.optional)
    for i, datum in enumerate(data):
        if not isinstance(datum, types.Datum):
            raise ValidationError(f"datum {i}: expected a types.Datum, got {type(datum).__name__}")
        n = _validate_tokens(i, datum.model_input.to_numpy(), vocab_size, max_seq_len)
        total += n
        inputs = datum.loss_fn_inputs
        for key in spec.required:
            if key not in inputs:
                raise ValidationError(
                    f"datum {i}: loss_fn_inputs is missing {key!r}, required by {loss_fn!r} "
                    f"(it needs {list(spec.required)})"
                )
        for key, tensor in inputs.items():
            if key not in allowed:
                raise ValidationError(
                    f"datum {i}: loss_fn_inputs[{key!r}] is not an input of {loss_fn!r} "
                    f"(it takes {sorted(allowed)})"
                )
            _validate_input(i, key, tensor.to_numpy(), n, vocab_size)
    if total > limits.max_batch_tokens:
        raise ValidationError(
            f"batch has {total} tokens, more than the limit of {limits.max_batch_tokens} "
            f"(TINKERQ_MAX_BATCH_TOKENS); split it into several forward_backward calls"
        )


def _validate_tokens(i: int, tokens: np.ndarray, vocab_size: int | None, max_seq_len: int | None) -> int:
    if tokens.ndim != 1:
        raise ValidationError(f"datum {i}: model_input must be a flat token list, got shape {tokens.shape}")
    n = int(tokens.shape[0])
    if n == 0:
        raise ValidationError(f"datum {i}: model_input is empty")
    if tokens.dtype.kind not in "iu":
        raise ValidationError(f"datum {i}: model_input tokens must be integers, got dtype {tokens.dtype}")
    if max_seq_len is not None and n > max_seq_len:
        raise ValidationError(
            f"datum {i}: model_input has {n} tokens, longer than the model's maximum of {max_seq_len}"
        )
    _check_ids(f"datum {i}: model_input", tokens, vocab_size)
    return n


def _check_ids(where: str, ids: np.ndarray, vocab_size: int | None) -> None:
    """Token ids must be in [0, vocab_size); ``where`` names the field, e.g. "datum 3: model_input"."""
    low = int(ids.min())
    if low < 0:
        raise ValidationError(f"{where} has a negative token id {low} at position {int(ids.argmin())}")
    if vocab_size is not None:
        high = int(ids.max())
        if high >= vocab_size:
            raise ValidationError(
                f"{where} has token id {high} at position {int(ids.argmax())}, "
                f"outside the model's vocabulary of {vocab_size}"
            )


def _validate_input(i: int, key: str, values: np.ndarray, n: int, vocab_size: int | None) -> None:
    field = f"loss_fn_inputs[{key!r}]"
    expected = types.LOSS_INPUT_DTYPES[key]
    if values.dtype.name != expected:
        raise ValidationError(
            f"datum {i}: {field} has dtype {values.dtype.name}, expected {expected} "
            f"(pass a plain list or cast the array)"
        )
    if values.shape != (n,):
        raise ValidationError(
            f"datum {i}: {field} has shape {tuple(values.shape)} but model_input has {n} tokens; "
            f"it must have shape ({n},), one value per input position"
        )
    if expected == "int64":
        _check_ids(f"datum {i}: {field}", values, vocab_size)
    elif not np.isfinite(values).all():
        bad = int(np.flatnonzero(~np.isfinite(values))[0])
        raise ValidationError(f"datum {i}: {field} has a non-finite value {values[bad]} at position {bad}")


def validate_lora(config: Any, *, max_rank: int) -> None:
    """A LoRA session's configuration: user errors name the field and what it accepts."""
    if not isinstance(config, types.LoraConfig):
        raise ValidationError(f"a LoRA configuration is a types.LoraConfig, got {type(config).__name__}")
    rank = config.rank
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:
        raise ValidationError(f"LoRA rank must be an integer from 1 to {max_rank} (TINKERQ_MAX_LORA_RANK), "
                              f"got {rank!r}")
    seed = config.seed
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
        raise ValidationError(f"LoRA seed must be None or an integer in [0, 2**63), got {seed!r}")
    flags = {"train_mlp": config.train_mlp, "train_attn": config.train_attn, "train_unembed": config.train_unembed}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValidationError(f"LoRA {name} must be True or False, got {value!r}")
    if not any(flags.values()):
        raise ValidationError("a LoRA session trains something: set at least one of train_mlp, train_attn, "
                              "train_unembed to True")


def validate_adam(params: Any) -> None:
    if not isinstance(params, types.AdamParams):
        raise ValidationError(f"optim_step takes types.AdamParams, got {type(params).__name__}")
    for f in fields(params):
        value = getattr(params, f.name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValidationError(f"AdamParams.{f.name} must be a finite number, got {value!r}")
    if params.learning_rate < 0:
        raise ValidationError(f"AdamParams.learning_rate must be >= 0, got {params.learning_rate}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(params, name) < 1.0:
            raise ValidationError(f"AdamParams.{name} must be in [0, 1), got {getattr(params, name)}")
    if params.eps <= 0:
        raise ValidationError(f"AdamParams.eps must be > 0, got {params.eps}")
    if params.weight_decay < 0:
        raise ValidationError(f"AdamParams.weight_decay must be >= 0, got {params.weight_decay}")
    if params.grad_clip_norm < 0:
        raise ValidationError(f"AdamParams.grad_clip_norm must be >= 0 (0 = off), got {params.grad_clip_norm}")


def validate_sampling(prompt: Any, num_samples: Any, params: Any, *, vocab_size: int | None = None,
                      max_seq_len: int | None = None, max_num_samples: int = 256,
                      max_tokens: int = 8192) -> None:
    """Raise ValidationError for the first problem in a sample request."""
    if not isinstance(prompt, types.ModelInput):
        raise ValidationError(f"prompt must be a types.ModelInput, got {type(prompt).__name__}")
    tokens = prompt.to_numpy()
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise ValidationError("prompt is empty: sampling needs at least one prompt token")
    if tokens.dtype.kind not in "iu":
        raise ValidationError(f"prompt tokens must be integers, got dtype {tokens.dtype}")
    _check_ids("prompt", tokens, vocab_size)
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise ValidationError(f"num_samples must be a positive integer, got {num_samples!r}")
    if num_samples > max_num_samples:
        raise ValidationError(f"num_samples={num_samples} is over this fleet's limit of {max_num_samples} per "
                              f"request (TINKERQ_MAX_NUM_SAMPLES); send several requests instead")
    if not isinstance(params, types.SamplingParams):
        raise ValidationError(f"sampling_params must be types.SamplingParams, got {type(params).__name__}")
    room = None if max_seq_len is None else max_seq_len - tokens.shape[0]
    if params.max_tokens is not None:
        if not isinstance(params.max_tokens, int) or isinstance(params.max_tokens, bool) or params.max_tokens < 1:
            raise ValidationError(f"SamplingParams.max_tokens must be a positive integer, got {params.max_tokens!r}")
        if params.max_tokens > max_tokens:
            raise ValidationError(f"SamplingParams.max_tokens={params.max_tokens} is over this fleet's limit of "
                                  f"{max_tokens} (TINKERQ_MAX_SAMPLE_TOKENS)")
        if room is not None and params.max_tokens > room:
            raise ValidationError(
                f"prompt ({tokens.shape[0]} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"maximum of {max_seq_len} tokens"
            )
    elif room is not None and room < 1:
        raise ValidationError(f"prompt ({tokens.shape[0]} tokens) leaves no room under the model's {max_seq_len}")
    if params.seed is not None and (not isinstance(params.seed, int) or isinstance(params.seed, bool)
                                    or not 0 <= params.seed < 2**63):
        raise ValidationError(f"SamplingParams.seed must be a non-negative integer or None, got {params.seed!r}")
    t = params.temperature
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise ValidationError(f"SamplingParams.temperature must be a finite number >= 0, got {t!r}")
    if not isinstance(params.top_k, int) or isinstance(params.top_k, bool) or (params.top_k < 1 and params.top_k != -1):
        raise ValidationError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {params.top_k!r}")
    p = params.top_p
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
        raise ValidationError(f"SamplingParams.top_p must be in (0, 1], got {p!r}")
    stop = params.stop
    # None: the model's EOS stops; [] (Tinker's "no stop tokens, not even EOS"): only max_tokens ends a row.
    if stop is None or isinstance(stop, str) or (isinstance(stop, (list, tuple)) and not stop):
        return
    if not isinstance(stop, (list, tuple)):
        raise ValidationError("SamplingParams.stop must be None, a string, a list of strings or of token ids, "
                              "or [] (no stop at all, not even EOS)")
    if all(isinstance(x, str) and x for x in stop):
        return
    if all(isinstance(x, int) and not isinstance(x, bool) for x in stop):
        _check_ids("SamplingParams.stop", np.asarray(stop), vocab_size)
        return
    raise ValidationError("SamplingParams.stop must be all (non-empty) strings or all token ids, not a mix")


# Tinker's per-position sampling options (topk_prompt_logprobs, topk_sample_logprobs, target_prompt_logprobs,
# prompt_alt_tokens_k): the width of one position's answer, and positions x width per request. Both bound what a
# request makes the worker copy to the CPU and send back, as Tinker bounds a top-k width.
MAX_TOPK = 1024
MAX_SCORED_CELLS = 1 << 22


@dataclass
class PromptOptions:
    """Tinker's top-k, target-token and alternative-token options of one sample request (0 / None: not asked)."""

    topk_prompt: int = 0  # topk_prompt_logprobs
    topk_sample: int = 0  # topk_sample_logprobs
    targets: np.ndarray | None = None  # target_prompt_logprobs, dense (len(prompt) - 1, K) int64, -1 = no cell
    alt_k: int = 0  # prompt_alt_tokens_k

    def asks_prompt(self) -> bool:
        """Whether the prefill has to score the prompt for these options."""
        return bool(self.topk_prompt or self.alt_k or self.targets is not None)


def validate_prompt_options(options: PromptOptions, prompt_length: int, max_tokens: int | None, *,
                            vocab_size: int | None = None) -> None:
    """Raise ValidationError for the first problem in a sample request's top-k / target / alternative options."""
    width = MAX_TOPK if vocab_size is None else min(MAX_TOPK, vocab_size)
    for name, k in (("topk_prompt_logprobs", options.topk_prompt), ("topk_sample_logprobs", options.topk_sample)):
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= width:
            raise ValidationError(f"{name} must be an integer from 0 (off) to {width}, got {k!r}")
    k = options.alt_k
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValidationError(f"prompt_alt_tokens_k must be an integer >= 0 (0: off), got {k!r}")
    for name, cells in (("topk_prompt_logprobs", prompt_length * options.topk_prompt),
                        ("topk_sample_logprobs", (max_tokens or 0) * options.topk_sample),
                        ("prompt_alt_tokens_k", prompt_length * k)):
        if cells > MAX_SCORED_CELLS:
            raise ValidationError(f"{name}: {cells} (positions x k) is over this server's limit of "
                                  f"{MAX_SCORED_CELLS}; ask for a smaller k or a shorter request")
    if (options.topk_prompt or k or options.targets is not None) and prompt_length < 2:
        raise ValidationError("top-k, target and alternative prompt tokens need a prompt of at least 2 tokens "
                              "(position 0 has no preceding context)")
    ids = options.targets
    if ids is None:
        return
    if not isinstance(ids, np.ndarray) or ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise ValidationError("target_prompt_logprobs must be a 2-D int64 tensor of token ids, [len(prompt) - 1, K]")
    if ids.shape[0] != prompt_length - 1:
        raise ValidationError(f"target_prompt_logprobs has {ids.shape[0]} rows; it needs exactly len(prompt) - 1 = "
                              f"{prompt_length - 1} (row i is scored at prompt position i + 1)")
    named = ids[ids != -1]
    if named.size == 0:
        raise ValidationError("target_prompt_logprobs names no token id (every cell is -1); name at least one")
    _check_ids("target_prompt_logprobs (-1 marks an empty cell)", named, vocab_size)
    distinct = int(np.unique(named).size)
    if prompt_length * distinct > MAX_SCORED_CELLS:
        raise ValidationError(f"target_prompt_logprobs: len(prompt) x distinct ids = {prompt_length * distinct} is "
                              f"over this server's limit of {MAX_SCORED_CELLS}")


# A checkpoint's ttl_seconds: at most about ten years (anything larger is more likely a unit mistake than a wish).
MAX_CHECKPOINT_TTL_S = 10 * 365 * 24 * 3600


def validate_ttl_seconds(ttl_seconds: Any) -> None:
    """A save's ``ttl_seconds``: None (kept until deleted) or a positive whole number of seconds."""
    if ttl_seconds is None:
        return
    if not isinstance(ttl_seconds, int) or isinstance(ttl_seconds, bool) or ttl_seconds < 1:
        raise ValidationError(f"ttl_seconds must be a positive whole number of seconds or None, got {ttl_seconds!r}")
    if ttl_seconds > MAX_CHECKPOINT_TTL_S:
        raise ValidationError(f"ttl_seconds={ttl_seconds} is over the limit of {MAX_CHECKPOINT_TTL_S} (10 years); "
                              f"pass None to keep the checkpoint until it is deleted")


def check_model_directory(path: str) -> Path:
    """``path`` as a Hugging Face model directory (it has a ``config.json``); ModelLoadError saying what to pass
    otherwise. Cheap and torch-free: ``tinkerq worker`` checks its ``--model`` with it before anything loads."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"model path {path!r} is not a directory; pass a local Hugging Face model directory")
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"model path {path!r} has no config.json; is it a Hugging Face model directory?")
    return directory
