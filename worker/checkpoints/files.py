"""What a checkpoint holds: a training state's files and metadata (written, checked, read) and the marker of
plain HF weights saved for samplers. The layout is in worker/checkpoints/'s docstring.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tinkerq import optimizers, types
from tinkerq.errors import ValidationError
from tinkerq.worker.checkpoints.paths import refuse_links_inside

STATE_FORMAT = 1
STATE_FILE = "tinkerq_state.json"
ADAPTER_FILE = "adapter_model.safetensors"  # a LoRA session's weights (PEFT's layout)
PEFT_PREFIX = "base_model.model."  # PEFT's key prefix in adapter_model.safetensors
WEIGHTS_FILE = "tinkerq_weights.json"  # in save_weights_for_sampler directories: the base model's name
# Files that make a saved directory a complete model for from_pretrained (weights come from the session).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")


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
    # The optimizer's state by "<name>::<key>": AdamW's exp_avg / exp_avg_sq / step, Dimuon's momentum
    # (worker/training/optimizers.py).
    moments: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]  # empty when no gradient is pending
    meta: dict[str, Any]


def write_state(directory: Path, *, write_weights: Callable[[Path], None], shapes: dict[str, list[int]],
                moments: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], base_model: str,
                model_id: str, steps: int, seq_id: int, shards: int = 1, lora: dict[str, Any] | None = None,
                expires_at: float | None = None, optimizer: dict[str, Any] | None = None) -> None:
    """Write a training state; ``write_weights(directory)`` writes model.safetensors + config.json. ``optimizer``:
    the session's optimizer config (tinkerq.optimizers.encode_config; a state without one was saved by AdamW)."""
    write_weights(directory)
    save_file({k: v.detach().cpu().contiguous() for k, v in moments.items()},
              str(directory / "optimizer.safetensors"))
    if grads:
        save_file({k: v.detach().cpu().contiguous() for k, v in grads.items()},
                  str(directory / "gradients.safetensors"))
    meta = {"format": STATE_FORMAT, "base_model": base_model, "model_id": model_id, "optimizer_steps": steps,
            "seq_id": seq_id, "created": time.time(), "saved_by_shards": shards, "parameters": shapes}
    if lora is not None:
        meta["lora"] = lora
    if optimizer is not None:
        meta["optimizer"] = optimizer
    if expires_at is not None:
        meta["expires_at"] = expires_at
    (directory / STATE_FILE).write_text(json.dumps(meta, indent=1))  # last: marks the directory complete


def write_weights_marker(directory: Path, base_model: str, lora: dict[str, Any] | None = None,
                         expires_at: float | None = None) -> None:
    """Name the base model in a saved weights directory, so a sampling client can be made from the path alone
    (and, for a LoRA adapter, its configuration; with a ttl, when it expires; when it was written, for
    retention: worker/checkpoints/retention.py)."""
    marker: dict[str, Any] = {"format": STATE_FORMAT, "base_model": base_model, "created": time.time()}
    if lora is not None:
        marker["lora"] = lora
    if expires_at is not None:
        marker["expires_at"] = expires_at
    (directory / WEIGHTS_FILE).write_text(json.dumps(marker))


def check_state(directory: Path, shapes: dict[str, list[int]], lora: dict[str, Any] | None = None,
                base_model: str | None = None, optimizer: types.OptimizerConfig | None = None) -> dict[str, Any]:
    """The state's metadata, after checking it fits a session with these parameter shapes (``lora``: the LoRA
    session's configuration; None for a full-parameter session; ``base_model``: checked when given; ``optimizer``:
    the session's, when its optimizer state is to be loaded too)."""
    try:
        meta = json.loads((directory / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValidationError(f"cannot read {directory / STATE_FILE}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValidationError(f"checkpoint format {found!r} is not supported (expected {STATE_FORMAT})")
    saved_lora = meta.get("lora")
    if (saved_lora is None) != (lora is None):
        what = "a LoRA adapter's state" if saved_lora is not None else "a full-parameter state"
        here = "a LoRA session" if lora is not None else "a full-parameter session"
        raise ValidationError(f"{directory} is {what} and cannot load into {here}: resume it with "
                              f"ServiceClient.create_training_client_from_state({str(directory)!r}), which opens "
                              f"the right kind of session")
    if base_model is not None and meta.get("base_model") != base_model:
        raise ValidationError(f"{directory} was saved from base model {meta.get('base_model')!r}, not {base_model!r}: "
                              f"load it into a session on that base model")
    if lora is not None and isinstance(saved_lora, dict):
        for key in ("rank", "train_attn", "train_mlp", "train_unembed"):
            if saved_lora.get(key) != lora.get(key):
                raise ValidationError(f"{directory} holds a LoRA adapter with {key}={saved_lora.get(key)!r}; this "
                                      f"session has {key}={lora.get(key)!r}: resume it with "
                                      f"create_training_client_from_state(path)")
    if optimizer is not None:
        saved_optimizer = optimizers.config_of(meta.get("optimizer"))  # absent: saved by AdamW
        if saved_optimizer != optimizer:
            raise ValidationError(
                f"{directory} holds the state of the {optimizers.describe(saved_optimizer)} optimizer; this session "
                f"trains with {optimizers.describe(optimizer)}: an optimizer's state cannot be loaded into another "
                f"(load_state takes the weights only, with a fresh optimizer; or resume with "
                f"create_training_client_from_state_with_optimizer(path), which opens a session with the saved "
                f"optimizer)")
    if meta.get("parameters") != shapes:
        saved = meta.get("parameters") or {}
        diff = next((n for n in sorted(set(saved) | set(shapes)) if saved.get(n) != shapes.get(n)), "")
        raise ValidationError(
            f"checkpoint was saved from a model with other parameters than this worker serves "
            f"(first difference: {diff}: saved {saved.get(diff)}, here {shapes.get(diff)})"
        )
    return meta


def read_state(directory: Path, shapes: dict[str, list[int]], tied: dict[str, str],
               lora: dict[str, Any] | None = None, *, optimizer: bool = True) -> SavedState:
    """Every tensor of a training state (full tensors, on the CPU). ``tied`` maps a parameter that shares
    its storage with another to the other's name (tied embeddings are stored once). Without ``optimizer``
    only the weights are read (no AdamW state, no pending gradients)."""
    refuse_links_inside(directory)  # again: every rank of a sharded worker reads the files itself
    meta = check_state(directory, shapes, lora)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob(ADAPTER_FILE if lora is not None else "model*.safetensors")):
        weights.update({k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(file)).items()})
    for name in shapes:
        if name not in weights and tied.get(name) not in weights:
            raise ValidationError(f"checkpoint {directory} has no weights for {name}")
    if not optimizer:
        return SavedState(weights, {}, {}, meta)
    moments = load_file(str(directory / "optimizer.safetensors"))
    grads_file = directory / "gradients.safetensors"
    grads = load_file(str(grads_file)) if grads_file.is_file() else {}
    return SavedState(weights, moments, grads, meta)
