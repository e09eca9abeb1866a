"""Choosing the loss-head backend by name, and the one function the worker calls."""

from __future__ import annotations

import torch

from tinkerq.errors import UserError
from tinkerq.worker.loss_head.apex import ApexChunkKernel, load_apex_xentropy
from tinkerq.worker.loss_head.chunked import chunked_target_logprobs
from tinkerq.worker.loss_head.reference import reference_target_logprobs

BACKENDS = ("auto", "apex", "torch", "reference")


class BackendUnavailable(UserError):
    """The requested loss backend cannot run on this worker (the message says what to install or pick)."""


def resolve_backend(requested: str, device: torch.device | str) -> str:
    """The backend that will run: ``auto`` = apex when importable on CUDA, else the chunked torch one."""
    device = torch.device(device)
    if requested not in BACKENDS:
        raise BackendUnavailable(f"loss backend {requested!r} is not one of {BACKENDS}")
    if requested == "auto":
        return "apex" if device.type == "cuda" and load_apex_xentropy() is not None else "torch"
    if requested == "apex":
        if device.type != "cuda":
            raise BackendUnavailable("the apex loss backend needs a CUDA device (use torch or auto)")
        if load_apex_xentropy() is None:
            raise BackendUnavailable(
                "the apex loss backend needs NVIDIA apex built with its xentropy extension "
                "(APEX_XENTROPY=1 pip install --no-build-isolation <apex checkout>; never `pip install apex`)"
            )
    return requested


def target_logprobs_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                backend: str, chunk_tokens: int = 1024,
                                low_rank: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Target logprobs (N,) from hidden (N, H) and the output embedding weight (V, H); ``low_rank`` =
    (low (N, r), low_weight (V, r)) adds a LoRA term ``low @ low_weight.T`` to the logits."""
    if backend == "reference":
        if low_rank is not None:
            hidden, weight = torch.cat([hidden, low_rank[0]], -1), torch.cat([weight, low_rank[1]], 1)
        return reference_target_logprobs(hidden, weight, targets)
    if backend == "apex":
        xentropy = load_apex_xentropy()
        if xentropy is None:
            raise BackendUnavailable("apex was requested but cannot be imported")
        return chunked_target_logprobs(hidden, weight, targets, chunk_tokens=chunk_tokens,
                                       kernel=ApexChunkKernel(xentropy), low_rank=low_rank)
    if backend == "torch":
        return chunked_target_logprobs(hidden, weight, targets, chunk_tokens=chunk_tokens, low_rank=low_rank)
    raise BackendUnavailable(f"unknown loss backend {backend!r}")
