"""Checkpoints on disk: training state (save_state / load_state) and plain HF weights (for samplers).

A training state is a directory::

    model.safetensors, config.json      the weights (save_pretrained: tied weights stored once)
    optimizer.safetensors               AdamW moments and step per parameter, by parameter name
    gradients.safetensors               pending gradients, only when some are non-zero
    tinkerq_state.json                  format, base model, optimizer steps, request position

The layout does not depend on how the model was held: a sharded worker gathers full tensors to rank 0
and writes the same files, so a state loads with any number of shards. Everything is safetensors and
JSON: loading a checkpoint never unpickles. Every directory is written
beside its final place and renamed into it, so a crash never leaves one that looks complete but isn't.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tinkerq.errors import ValidationError

STATE_FORMAT = 1
STATE_FILE = "tinkerq_state.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
# Files that make a saved directory a complete model for from_pretrained (weights come from the session).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise ValidationError(f"checkpoint name {name!r} must be 1-128 characters of [A-Za-z0-9_.-]")
    return name


def weights_path(checkpoint_dir: str, model_id: str, name: Any) -> Path:
    """Where save_weights_for_sampler(name) writes: ``<checkpoint_dir>/<model_id>/<name>``."""
    return Path(checkpoint_dir) / model_id / check_name(name)


def state_path(checkpoint_dir: str, model_id: str, name: Any) -> Path:
    """Where save_state(name) writes: ``<checkpoint_dir>/<model_id>/state/<name>``."""
    return Path(checkpoint_dir) / model_id / "state" / check_name(name)


def write_atomically(final: Path, fill: Callable[[Path], None]) -> Path:
    """Build the directory in a temporary sibling with ``fill``, then rename it to ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        fill(tmp)
        if final.exists():  # replacing: the old one goes first; a crash here leaves no directory at all
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def copy_tokenizer_files(model_dir: str, directory: Path) -> None:
    """Copy the base model's tokenizer files, so the saved directory is a complete model."""
    for fname in _TOKENIZER_FILES:
        src = Path(model_dir) / fname
        if src.is_file():
            shutil.copy2(src, directory / fname)


@dataclass
class SavedState:
    """A training state as full (unsharded) CPU tensors, keyed by parameter name."""

    weights: dict[str, torch.Tensor]
    moments: dict[str, torch.Tensor]  # "<name>::exp_avg" / "::exp_avg_sq" / "::step"
    grads: dict[str, torch.Tensor]  # empty when no gradient is pending
    meta: dict[str, Any]


def optimizer_entries(name: str, state: dict[str, Any], full: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """One parameter's AdamW state as ``{"<name>::<key>": tensor}`` (``full`` gathers a shard, if any)."""
    return {f"{name}::{key}": full(state[key]) for key in ("exp_avg", "exp_avg_sq", "step") if key in state}


def write_state(directory: Path, *, write_weights: Callable[[Path], None], shapes: dict[str, list[int]],
                moments: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], base_model: str,
                model_id: str, steps: int, seq_id: int, shards: int = 1) -> None:
    """Write a training state; ``write_weights(directory)`` writes model.safetensors + config.json."""
    write_weights(directory)
    save_file({k: v.detach().cpu().contiguous() for k, v in moments.items()},
              str(directory / "optimizer.safetensors"))
    if grads:
        save_file({k: v.detach().cpu().contiguous() for k, v in grads.items()},
                  str(directory / "gradients.safetensors"))
    meta = {"format": STATE_FORMAT, "base_model": base_model, "model_id": model_id, "optimizer_steps": steps,
            "seq_id": seq_id, "created": time.time(), "saved_by_shards": shards, "parameters": shapes}
    (directory / STATE_FILE).write_text(json.dumps(meta, indent=1))  # last: marks the directory complete


def resolve_state_path(path: Any, checkpoint_dir: str) -> Path:
    """A training-state directory inside the checkpoint directory, or a ValidationError saying what is wrong."""
    if not isinstance(path, str) or not path:
        raise ValidationError(f"checkpoint path must be a non-empty string, got {path!r}")
    root = Path(checkpoint_dir).resolve()
    resolved = Path(path).resolve()
    if resolved != root and root not in resolved.parents:
        raise ValidationError(f"checkpoint path {path!r} is outside this fleet's checkpoint directory {root}")
    if not resolved.is_dir():
        raise ValidationError(f"checkpoint {path!r} does not exist")
    if not (resolved / STATE_FILE).is_file():
        raise ValidationError(
            f"{path!r} is not a training state (no {STATE_FILE}): pass a path returned by save_state(); "
            f"save_weights_for_sampler() writes weights only"
        )
    return resolved


def check_state(directory: Path, shapes: dict[str, list[int]]) -> dict[str, Any]:
    """The state's metadata, after checking it fits a model with these parameter shapes."""
    try:
        meta = json.loads((directory / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValidationError(f"cannot read {directory / STATE_FILE}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValidationError(f"checkpoint format {found!r} is not supported (expected {STATE_FORMAT})")
    if meta.get("parameters") != shapes:
        saved = meta.get("parameters") or {}
        diff = next((n for n in sorted(set(saved) | set(shapes)) if saved.get(n) != shapes.get(n)), None)
        raise ValidationError(
            f"checkpoint was saved from a model with other parameters than this worker serves "
            f"(first difference: {diff}: saved {saved.get(diff)}, here {shapes.get(diff)})"
        )
    return meta


def read_state(directory: Path, shapes: dict[str, list[int]], tied: dict[str, str]) -> SavedState:
    """Every tensor of a training state (full tensors, on the CPU). ``tied`` maps a parameter that shares
    its storage with another to the other's name (tied embeddings are stored once)."""
    meta = check_state(directory, shapes)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("model*.safetensors")):
        weights.update(load_file(str(file)))
    for name in shapes:
        if name not in weights and tied.get(name) not in weights:
            raise ValidationError(f"checkpoint {directory} has no weights for {name}")
    moments = load_file(str(directory / "optimizer.safetensors"))
    grads_file = directory / "gradients.safetensors"
    grads = load_file(str(grads_file)) if grads_file.is_file() else {}
    return SavedState(weights, moments, grads, meta)
