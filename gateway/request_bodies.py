"""Fields of the SDK's JSON request bodies read into tinkerq's types; a malformed or unsupported one is an
HTTPError 400 (or a KeyError / TypeError / ValueError the caller answers 400)."""

from __future__ import annotations

from typing import Any

from tinkerq import optimizers, types
from tinkerq.errors import ValidationError
from tinkerq.gateway.http_errors import HTTPError
from tinkerq.validation import validate_adam


def sample_promise(request_id: str, num_samples: Any) -> dict[str, Any]:
    n = num_samples if isinstance(num_samples, int) else 0
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)]}


def optimizer_config(raw: Any) -> types.OptimizerConfig:
    """create_model's (or a weights-only load's) ``optimizer_config``: absent is AdamW."""
    if raw is not None and not isinstance(raw, dict):
        raise HTTPError(400, f"optimizer_config must be a map, got {raw!r}")
    try:
        return optimizers.config_of(raw)
    except ValidationError as exc:
        raise HTTPError(400, exc.message) from None


def optim_params(body: dict[str, Any]) -> types.OptimParams:
    """An optim_step body's hyperparameters: ``adam_params`` (AdamW) or ``optimizer_params`` (another family, by
    its ``type``: Dimuon's), checked (a ValidationError, answered 400)."""
    raw, other = body.get("adam_params"), body.get("optimizer_params")
    if raw is not None and other is not None:
        raise HTTPError(400, "send adam_params or optimizer_params, not both")
    if other is not None:
        if not isinstance(other, dict) or "type" not in other:
            raise HTTPError(400, f"optimizer_params must be a map with the optimizer's type (e.g. 'dimuon'), got "
                                 f"{other!r}")
        return optimizers.params_of(other)
    raw = raw or {}
    params = types.AdamParams(**{k: raw[k] for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay",
                                                     "grad_clip_norm") if k in raw})
    validate_adam(params)
    return params


def lora_config(raw: Any) -> types.LoraConfig | None:
    """Tinker's lora_config; None means a full fine-tune (a tinkerq extension the protocol allows)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise HTTPError(400, f"lora_config must be a map, got {raw!r}")
    known = {"rank", "seed", "train_mlp", "train_attn", "train_unembed"}
    try:
        return types.LoraConfig(**{k: v for k, v in raw.items() if k in known})
    except TypeError as exc:
        raise HTTPError(400, f"lora_config: {exc}") from None


def ttl_seconds(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HTTPError(400, f"ttl_seconds must be a positive integer (seconds), got {value!r}")
    return value


def model_input(raw: Any) -> types.ModelInput:
    chunks = raw["chunks"]
    tokens: list[int] = []
    for chunk in chunks:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise ValueError(f"only encoded_text prompt chunks are served, got {chunk.get('type')!r}")
        tokens.extend(chunk["tokens"])
    return types.ModelInput.from_ints(tokens)


def sampling_params(raw: Any) -> types.SamplingParams:
    known = {"max_tokens", "seed", "stop", "temperature", "top_k", "top_p"}
    return types.SamplingParams(**{k: v for k, v in dict(raw).items() if k in known})
