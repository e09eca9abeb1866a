"""What a saved directory says about itself, read by the producer before it asks a worker to load it: the marker
file ``save_state`` / ``save_weights_for_sampler`` write beside the weights (its base model, LoRA configuration);
and how a local model directory is named."""

from __future__ import annotations

import json
import os
from typing import Any

from tinkerq.errors import UserError


def saved_base_model(path: str, marker: str, returned_by: str) -> str:
    """The base model a saved directory belongs to (see :func:`saved_marker`)."""
    return str(saved_marker(path, marker, returned_by)["base_model"])


def saved_marker(path: str, marker: str, returned_by: str, *, base_model: str | None = None) -> dict[str, Any]:
    """A saved directory's ``marker`` file (tinkerq_state.json after save_state, tinkerq_weights.json after
    save_weights_for_sampler), when the directory is readable here; else ``{"base_model": base_model}`` when
    that is given."""
    meta = os.path.join(path, marker)
    try:
        with open(meta) as f:
            saved = json.load(f)
        if not isinstance(saved, dict) or not isinstance(saved.get("base_model"), str):
            raise ValueError("no base_model in it")
        return saved
    except (OSError, ValueError) as exc:
        if base_model is not None:
            return {"base_model": base_model}
        raise UserError(
            f"cannot read {meta} ({exc}); pass base_model= explicitly, or a path returned by {returned_by}"
        ) from None


def normalize_model_name(base_model: str) -> str:
    """Local model directories are named by their absolute path, so relative paths match the worker's."""
    if not isinstance(base_model, str) or not base_model:
        raise UserError(f"base_model must be a non-empty string, got {base_model!r}")
    if os.path.isdir(base_model):
        return os.path.abspath(base_model)
    return base_model
