"""Loading the model a worker serves, through the normal Hugging Face path."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tinkerq.errors import UserError
from tinkerq.settings import Settings

log = logging.getLogger("tinkerq.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(UserError):
    """The model directory cannot be served (missing, not a causal LM, unreadable)."""


def load_causal_lm(path: str, *, device: str = "cpu", dtype: str = "float32") -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained`` on a local directory, with errors that say what to do."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"model path {path!r} is not a directory; pass a local Hugging Face model directory")
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"model path {path!r} has no config.json; is it a Hugging Face model directory?")
    try:
        AutoConfig.from_pretrained(directory, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype], local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load a causal LM from {path!r}: {exc}") from exc
    cast(Any, model).to(device)  # transformers types .to as a decorated method mypy cannot call with a device
    # Tenants share passes: nothing computed over the batch may couple their rows. Router logits feed MoE
    # auxiliary (load-balancing) losses, which are batch-level: never asked for. (No family here drops tokens at
    # an expert capacity: routing is per token.)
    if getattr(model.config, "output_router_logits", False):
        log.info("model: output_router_logits off (no batch-level auxiliary loss in tinkerq's passes)")
        model.config.output_router_logits = False
    # Dropout off: the same request must give the same gradients on every worker and on every retry.
    model.eval()
    return model


def vocab_size(model: PreTrainedModel) -> int:
    """Ids valid both as inputs and as targets."""
    n_in = cast(torch.Tensor, model.get_input_embeddings().weight).shape[0]
    out = model.get_output_embeddings()
    n_out = cast(torch.Tensor, out.weight).shape[0] if out is not None else n_in
    return int(min(n_in, n_out))


def max_seq_len(model: PreTrainedModel) -> int:
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 20


def configure_torch(settings: Settings, threads: int | None) -> None:
    """Process-wide torch settings of a worker or shard: CPU threads, and deterministic kernels if asked."""
    if threads:
        torch.set_num_threads(threads)
    if settings.deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; it must be set before the first cuBLAS call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
