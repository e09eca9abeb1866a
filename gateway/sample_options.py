"""Tinker's per-position sampling options in an ``asample`` body (SDK 0.38's ``SampleRequest``), as the producer's
``SamplingClient.sample`` takes them: ``topk_prompt_logprobs``, ``topk_sample_logprobs``, ``target_prompt_logprobs``
(a JSON TensorData of token ids, dense or sparse CSR) and ``prompt_alt_tokens_k``. The values are checked by the
producer (tinkerq.validation.validate_prompt_options); here only their shape on the wire is read.

``target_prompt_logprobs``' answer keeps the request's layout: a CSR request gets a CSR answer with the same
indices (:func:`target_layout`; gateway/proto.py encodes it).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tinkerq import types
from tinkerq.validation import UNDEFINED_BY_SDK

# Refused, saying the SDK does not define it (tinkerq.validation.UNDEFINED_BY_SDK).
STABILITY_REFUSAL = UNDEFINED_BY_SDK["record_stability_info"]


def sample_options(body: dict[str, Any]) -> dict[str, Any]:
    """The options of an asample body as keyword arguments of ``SamplingClient.sample``; ValueError or TypeError
    when one is malformed."""
    options: dict[str, Any] = {}
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        value = body.get(name)
        if value is not None:
            options[name] = value
    raw = body.get("target_prompt_logprobs")
    if raw is not None:
        options["target_prompt_logprobs"] = _target_ids(raw)
    return options


def _target_ids(raw: Any) -> Any:
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), list) or not isinstance(raw.get("shape"), list):
        raise ValueError("target_prompt_logprobs must be a TensorData: data, dtype int64, shape [len(prompt) - 1, K]")
    if raw.get("dtype", "int64") != "int64":
        raise ValueError(f"target_prompt_logprobs must be int64 token ids, got dtype {raw.get('dtype')!r}")
    dense = types.target_ids(SimpleNamespace(data=raw["data"], shape=raw["shape"],
                                             sparse_crow_indices=raw.get("sparse_crow_indices"),
                                             sparse_col_indices=raw.get("sparse_col_indices")))
    if isinstance(dense, SimpleNamespace):
        raise ValueError("target_prompt_logprobs: data, shape and the sparse indices do not fit together")
    return dense


def target_layout(body: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    """The CSR indices (crow, col) of the request's target_prompt_logprobs, or None when it is dense (or absent)."""
    raw = body.get("target_prompt_logprobs")
    if not isinstance(raw, dict) or raw.get("sparse_crow_indices") is None:
        return None
    return [int(x) for x in raw["sparse_crow_indices"]], [int(x) for x in raw["sparse_col_indices"]]
