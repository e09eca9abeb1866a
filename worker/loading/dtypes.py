"""The dtype a worker holds its model in: ``TINKERQ_DTYPE`` / ``--dtype`` resolved against the checkpoint and device.

``auto`` (the default) serves the checkpoint in its own dtype where the device computes in it natively:

* on a CUDA device that supports bfloat16 (compute capability 8.0 and up: A100, H100, H200 ...), the dtype the
  checkpoint's config.json names (``dtype``, or ``torch_dtype`` as transformers 4 wrote it). A quantized checkpoint
  (FP8 blocks, MXFP4, INT4 ...) is served in bfloat16: its weights are dequantized on load, and every published
  quantized checkpoint computes in bfloat16. A float32 (or unnamed) checkpoint stays float32.
* on a CUDA device without native bfloat16 (V100, T4), a bfloat16 checkpoint is served in float32: float16 has too
  narrow a range for weights trained in bfloat16, and emulated bfloat16 is slow. A float16 checkpoint stays float16.
* on the CPU (and MPS), float32: CPU bfloat16 matmuls are much slower than float32 ones on most CPUs, and float32 is
  what the exactness tests compare against plain transformers. ``--dtype bfloat16`` serves it in bfloat16 on the CPU
  too, at half the memory.

An explicit ``float32``, ``bfloat16`` or ``float16`` is taken as it is, on every device. The planner
(worker/planning/planner.py) resolves ``auto`` with this same function for the GPU it plans for.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tinkerq.worker")

SERVED_DTYPES = ("float32", "bfloat16", "float16")  # what the loader (worker/loading/models.py) takes
SETTINGS = ("auto", *SERVED_DTYPES)  # what TINKERQ_DTYPE / --dtype take


def checkpoint_dtype(config: dict[str, Any]) -> str | None:
    """The dtype a checkpoint's config.json names, or None when it names none we serve in.

    ``bfloat16`` for a quantized checkpoint: it names the dtype of its unquantized tensors and of its compute."""
    if config.get("quantization_config"):
        return "bfloat16"
    for where in (config, config.get("text_config") or {}):  # multimodal configs may name it only for the text model
        for key in ("dtype", "torch_dtype"):
            name = str(where.get(key) or "").removeprefix("torch.")
            if name in SERVED_DTYPES:
                return name
    return None


def device_has_bf16(device: str) -> bool:
    """Whether ``device`` computes in bfloat16 natively (a CUDA device of compute capability 8.0 or more)."""
    parsed = torch.device(device)
    if parsed.type != "cuda" or not torch.cuda.is_available():
        return False
    with torch.cuda.device(parsed.index if parsed.index is not None else torch.cuda.current_device()):
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def resolve_dtype(setting: str, config: dict[str, Any], device: str, *, bf16_supported: bool | None = None) -> str:
    """The dtype to load with (float32 | bfloat16 | float16) for ``setting`` (auto or one of those).

    ``config`` is the checkpoint's config.json; ``bf16_supported`` overrides what :func:`device_has_bf16` says of
    ``device`` (the planner plans for a GPU this machine may not have)."""
    if setting in SERVED_DTYPES:
        return setting
    if setting != "auto":
        raise ValueError(f"dtype {setting!r}: one of {', '.join(SETTINGS)}")
    if torch.device(device).type != "cuda":
        return "float32"
    stored = checkpoint_dtype(config) or "float32"
    native = device_has_bf16(device) if bf16_supported is None else bf16_supported
    if stored == "bfloat16" and not native:
        return "float32"
    return stored


def read_model_config(model_path: str) -> dict[str, Any]:
    """``model_path``'s config.json as a dict; {} when unreadable (the loader then says what is wrong)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def served_dtype(model_path: str, setting: str, device: str) -> str:
    """The dtype a worker serves ``model_path`` in on ``device``, logged with why when ``setting`` is auto."""
    config = read_model_config(model_path)
    dtype = resolve_dtype(setting, config, device)
    if setting == "auto":
        log.info("dtype auto: %s (checkpoint: %s, device: %s%s)", dtype, checkpoint_dtype(config) or "unnamed",
                 device, "; --dtype bfloat16 serves it in bfloat16 on the CPU" if dtype == "float32" and
                 torch.device(device).type != "cuda" else "")
    return dtype
