"""Checkpoints on disk: training state (save_state / load_state) and plain HF weights (for samplers).

A training state is a directory::

    model.safetensors, config.json      the weights (save_pretrained: tied weights stored once)
    optimizer.safetensors               AdamW moments and step per parameter, by parameter name
    gradients.safetensors               pending gradients, only when some are non-zero
    tinkerq_state.json                  format, base model, optimizer steps, request position

Everything is safetensors and JSON: loading a checkpoint never unpickles. Every directory is written
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from tinkerq.errors import ValidationError

if TYPE_CHECKING:
    from worker.session import TrainingSession

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


def save_hf_weights(session: TrainingSession, directory: Path) -> None:
    session.model.save_pretrained(directory)
    for fname in _TOKENIZER_FILES:
        src = Path(session.base_dir) / fname
        if src.is_file():
            shutil.copy2(src, directory / fname)


def save_state(session: TrainingSession, directory: Path, *, base_model: str, seq_id: int) -> None:
    names = session.param_names
    session.model.save_pretrained(directory)
    moments: dict[str, torch.Tensor] = {}
    for name, p in zip(names, session.params, strict=True):
        state = session.optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in state:
                moments[f"{name}::{key}"] = state[key].detach().cpu().contiguous()
    save_file(moments, str(directory / "optimizer.safetensors"))
    if any(bool(p.grad.any()) for p in session.params):
        save_file({n: p.grad.detach().cpu().contiguous() for n, p in zip(names, session.params, strict=True)},
                  str(directory / "gradients.safetensors"))
    meta = {"format": STATE_FORMAT, "base_model": base_model, "model_id": session.model_id,
            "optimizer_steps": session.steps, "seq_id": seq_id, "created": time.time(),
            "parameters": {n: list(p.shape) for n, p in zip(names, session.params, strict=True)}}
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


def load_state(session: TrainingSession, directory: Path) -> dict[str, Any]:
    """Replace the session's weights, AdamW state and pending gradients with the checkpoint's."""
    meta = json.loads((directory / STATE_FILE).read_text())
    if meta.get("format") != STATE_FORMAT:
        raise ValidationError(f"checkpoint format {meta.get('format')!r} is not supported (expected {STATE_FORMAT})")
    names = session.param_names
    expected = {n: list(p.shape) for n, p in zip(names, session.params, strict=True)}
    if meta.get("parameters") != expected:
        saved = meta.get("parameters") or {}
        diff = next((n for n in sorted(set(saved) | set(expected)) if saved.get(n) != expected.get(n)), None)
        raise ValidationError(
            f"checkpoint was saved from a model with other parameters than this worker serves "
            f"(first difference: {diff}: saved {saved.get(diff)}, here {expected.get(diff)})"
        )
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("model*.safetensors")):
        weights.update(load_file(str(file)))
    moments = load_file(str(directory / "optimizer.safetensors"))
    grads_file = directory / "gradients.safetensors"
    grads = load_file(str(grads_file)) if grads_file.is_file() else {}
    with torch.no_grad():
        by_name = dict(session.model.named_parameters())
        for name, p in by_name.items():
            if name in weights:
                p.copy_(weights[name])
            elif not any(q is p for n, q in by_name.items() if n in weights):
                raise ValidationError(f"checkpoint has no weights for {name}")
        for name, p in zip(names, session.params, strict=True):
            p.grad.copy_(grads[name]) if name in grads else p.grad.zero_()
            # torch keeps AdamW's step counter on the CPU (unless capturable); the moments live with p.
            state = {k: moments[f"{name}::{k}"].to(p.device, p.dtype) for k in ("exp_avg", "exp_avg_sq")
                     if f"{name}::{k}" in moments}
            if f"{name}::step" in moments:
                state["step"] = moments[f"{name}::step"]
            if state:
                session.optimizer.state[p] = state
            else:
                session.optimizer.state.pop(p, None)
    session.steps = int(meta["optimizer_steps"])
    session.last_used = time.monotonic()
    return meta
