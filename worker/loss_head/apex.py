"""NVIDIA apex's fused softmax cross-entropy as the per-chunk kernel (CUDA only; optional).

``apex.contrib.xentropy.SoftmaxCrossEntropyLoss.apply(logits, labels, smoothing, padding_idx,
half_to_float)`` returns unreduced float32 per-row losses, so ``-loss`` is the target logprob. Traps
(field-notes): ``padding_idx`` defaults to 0, a real token in most vocabularies, whose rows would get zero
loss — we pass -1, which no label can equal; labels are read without bounds checks — ours are validated
against the vocabulary before any compute. Importing raises when the CUDA extension was not built.
"""

from __future__ import annotations

from typing import Any

import torch

NO_PADDING = -1  # labels are >= 0, so no row is ever treated as padding


def load_apex_xentropy() -> Any | None:
    """The apex ``SoftmaxCrossEntropyLoss`` Function, or None when apex (with xentropy) is not installed."""
    try:
        from apex.contrib.xentropy import SoftmaxCrossEntropyLoss
    except (ImportError, OSError):  # no apex, or apex built without its xentropy extension
        return None
    return SoftmaxCrossEntropyLoss


class ApexChunkKernel:
    """Per chunk: apex's fused kernel forward; its own backward gives d loss / d logits."""

    def __init__(self, xentropy: Any) -> None:
        self.xentropy = xentropy

    def _losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        half_to_float = logits.dtype in (torch.float16, torch.bfloat16)
        return self.xentropy.apply(logits, targets, 0.0, NO_PADDING, half_to_float)  # (C,) float32

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, None]:
        with torch.no_grad():
            return -self._losses(logits, targets).float(), None

    def grad_logits(self, logits: torch.Tensor, targets: torch.Tensor, state: None,
                    grad: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_(True)
            losses = self._losses(leaf, targets)
            (g,) = torch.autograd.grad(losses, leaf, grad_outputs=-grad.to(losses.dtype))
        return g
