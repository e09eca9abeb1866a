"""Fields of the SDK's JSON request bodies read into tinkerq's types; a malformed or unsupported one is an
HTTPError 400 (or a KeyError / TypeError / ValueError the caller answers 400)."""

from __future__ import annotations

from typing import Any

from tinkerq import types
from tinkerq.gateway.http_errors import HTTPError
from tinkerq.validation import UNDEFINED_BY_SDK


def sample_promise(request_id: str, num_samples: Any) -> dict[str, Any]:
    n = num_samples if isinstance(num_samples, int) else 0
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)]}


def check_optimizer(config: Any) -> None:
    if isinstance(config, dict) and config.get("type") == "dimuon":
        raise HTTPError(400, UNDEFINED_BY_SDK["dimuon"])
    if config is not None and (not isinstance(config, dict) or config.get("type", "adamw") != "adamw"):
        raise HTTPError(400, f"optimizer {config!r} is not supported; this server trains with AdamW")


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
