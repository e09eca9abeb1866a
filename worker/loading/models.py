"""Loading the model a worker serves: a Hugging Face directory, as its maker published it.

Unquantized checkpoints go through ``from_pretrained``. Quantized ones (block FP8, MXFP4, compressed-tensors INT4)
are read and dequantized by our own code (worker/checkpoints/reader.py, worker/checkpoints/quant_formats.py:
transformers 5.24's
FP8 dequantizer is wrong on partial tiles and its MXFP4 path needs ``accelerate``), then handed to ``from_pretrained``
as a state dict under the checkpoint's own names, so transformers' key conversion (per-expert tensors into its fused
3-D experts, renames) still applies. Every failure is one ModelLoadError (a UserError) saying what to do.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tinkerq.settings import Settings
from tinkerq.validation import check_model_directory
from tinkerq.worker.checkpoints.reader import (
    Checkpoint,
    ModelLoadError,
    dequantized_state_dict,
    drop_extra_layers,
    has_safetensors,
    open_checkpoint,
)
from tinkerq.worker.training import checkpointing

log = logging.getLogger("tinkerq.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["DTYPES", "ModelLoadError", "configure_torch", "load_causal_lm", "load_skeleton", "max_seq_len",
           "vocab_size"]


def load_causal_lm(path: str, *, device: str = "cpu", dtype: str = "float32") -> PreTrainedModel:
    """The causal LM in the local directory ``path``, its quantized weights dequantized to ``dtype``; a
    ModelLoadError (never a raw traceback) if it cannot be served."""
    directory = _checked_directory(path, dtype)
    checkpoint = None
    try:
        if has_safetensors(directory):
            checkpoint = open_checkpoint(directory)  # headers and config checked; no weights read yet
        if checkpoint is not None and checkpoint.quant_method is not None:
            model = _load_dequantized(checkpoint, DTYPES[dtype])
        else:
            if checkpoint is not None:
                drop_extra_layers(checkpoint, dict.fromkeys(checkpoint.headers))  # says so; transformers ignores them
            config = AutoConfig.from_pretrained(directory, local_files_only=True)
            if text_model_class(config) is not None:
                model = _load_text_model(directory, config, DTYPES[dtype])
            else:
                model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype], local_files_only=True)
    except ModelLoadError:
        raise
    except (MemoryError, torch.OutOfMemoryError):  # the machine's limit, not the checkpoint's fault
        raise
    except Exception as exc:  # anything else transformers raises: one clear line, the cause chained
        raise ModelLoadError(_describe_failure(path, checkpoint, exc)) from exc
    cast(Any, model).to(device)  # transformers types .to as a decorated method mypy cannot call with a device
    _prepare(model)
    return model


def text_model_class(config: Any) -> Any:
    """The causal-LM class of a vision-language checkpoint's text model, where transformers has no causal-LM class
    for the checkpoint itself (Kimi-K2.5/2.6: ``kimi_k25``, a DeepSeek-V3 text model beside a vision tower; Qwen3.5's
    checkpoints need none of this, transformers maps them to their text model itself); None for any other config."""
    text = getattr(config, "text_config", None)
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or text is None:
        return None
    return cast(Any, MODEL_FOR_CAUSAL_LM_MAPPING).get(type(text), None)


def _load_text_model(directory: Path, config: Any, dtype: torch.dtype) -> PreTrainedModel:
    """The text model of a vision-language checkpoint (:func:`text_model_class`), as its causal-LM class: the
    checkpoint loaded whole by its own class (so its key conversion applies), its language model and output
    projection kept, the vision tower dropped. Sessions serve text; what they save is the text model's directory."""
    from transformers import AutoModelForImageTextToText

    whole: Any = AutoModelForImageTextToText.from_pretrained(directory, dtype=dtype, local_files_only=True)
    language, head = whole.model.language_model, whole.get_output_embeddings()
    with torch.device("meta"):  # no second copy of the weights: the loaded modules replace the meta ones
        model = text_model_class(config)(config.text_config)
    setattr(model, model.base_model_prefix, language)
    model.set_output_embeddings(head)
    model.generation_config = whole.generation_config
    del whole
    log.info("model: %s's text model (%s), its vision tower left out", type(config).__name__, type(model).__name__)
    return cast(PreTrainedModel, model)


def load_skeleton(path: str, *, dtype: str = "float32") -> PreTrainedModel:
    """The model in ``path`` as :func:`load_causal_lm` makes it, with every parameter on the meta device (no weights
    read, none allocated) and its buffers real (the rotary tables a constructor computes): what a shard group's
    ranks build before each reads its own shards (worker/sharding/streaming.py). Checked as load_causal_lm checks."""
    directory = _checked_directory(path, dtype)
    if not has_safetensors(directory):  # said at start-up, not at the first session
        raise ModelLoadError(f"model path {path!r} has no safetensors files (model.safetensors, or an index and its "
                             f"shards); a shard group's ranks read their shards from them: convert it once, with "
                             f"AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_path)")
    try:
        open_checkpoint(directory)  # headers and config checked; no weights read
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the reader dequantizes (LazyTensors); transformers' quantizers stay out
        if text_model_class(config) is not None:
            raise ModelLoadError(f"{type(config).__name__} is a vision-language checkpoint whose text model a shard "
                                 f"group cannot stream from its files yet; serve it on a single worker (without "
                                 f"--shards)")
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ModelLoadError(f"{type(config).__name__} is not a causal LM transformers knows; pass a causal "
                                 f"language model")

        def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> torch.nn.Parameter:
            # Each parameter goes to the meta device as its module registers it: one at a time is ever allocated.
            return torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

        # (torch types the hook as returning None; a returned parameter replaces the registered one)
        hook = torch.nn.modules.module.register_module_parameter_registration_hook(cast(Any, on_meta))
        try:
            # The Auto class, as from_pretrained does: it picks a composite config's text part where the model
            # class wants it (Qwen3.5).
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
        finally:
            hook.remove()
        model.tie_weights()  # as from_pretrained does once loaded: a tied output weight is the embedding's
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(_describe_failure(path, None, exc)) from exc
    generation = directory / "generation_config.json"
    if generation.is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    _prepare(model)
    return cast(PreTrainedModel, model)


def _checked_directory(path: str, dtype: str) -> Path:
    directory = check_model_directory(path)
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    return directory


def _prepare(model: PreTrainedModel) -> None:
    """What every loaded model gets, whole or a skeleton."""
    # Tenants share passes: nothing computed over the batch may couple their rows. Router logits feed MoE
    # auxiliary (load-balancing) losses, which are batch-level: never asked for. (No family here drops tokens at
    # an expert capacity: routing is per token.)
    if getattr(model.config, "output_router_logits", False):
        log.info("model: output_router_logits off (no batch-level auxiliary loss in tinkerq's passes)")
        model.config.output_router_logits = False
    # Dropout off: the same request must give the same gradients on every worker and on every retry.
    model.eval()
    # Its decoder layers can be checkpointed (when a request needs it: worker/training/checkpointing.py); copies
    # made of it (full sessions, a shard group's LoRA base) can too.
    checkpointing.install(model)


def _load_dequantized(checkpoint: Checkpoint, dtype: torch.dtype) -> PreTrainedModel:
    """``from_pretrained`` on the checkpoint's tensors, dequantized by our code, under its own names; the config
    without its quantization_config (so transformers' quantizers stay out)."""
    config = AutoConfig.from_pretrained(checkpoint.directory, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)  # its stubs type a pair
    if model_class is None:
        raise checkpoint.fail(f"{type(config).__name__} is not a causal LM transformers knows",
                              "pass a causal language model")
    state_dict = dequantized_state_dict(checkpoint, dtype)
    log.info("model: %d quantized weights (%s) dequantized to %s by tinkerq", len(checkpoint.quantized),
             checkpoint.quant_method, str(dtype).removeprefix("torch."))
    # from_pretrained refuses a path together with a state_dict: the config stands for the directory.
    model = model_class.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype)
    generation = checkpoint.directory / "generation_config.json"
    if generation.is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(checkpoint.directory, local_files_only=True)
    return cast(PreTrainedModel, model)


def _describe_failure(path: str, checkpoint: Checkpoint | None, exc: Exception) -> str:
    """What went wrong, in one message: a tensor whose shape does not fit config.json is named (transformers' own
    error only points at a report it logged), anything else carries its cause."""
    mismatched = _mismatched_shapes(checkpoint) if checkpoint is not None else []
    if mismatched:
        name, got, want = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        return (f"cannot load a causal LM from {path!r}: {name} has shape {got} where config.json makes it {want}"
                f"{more}; the weights and config.json are not of the same model (download them again)")
    cause = " ".join(f"{type(exc).__name__}: {exc}".split())
    return f"cannot load a causal LM from {path!r}: {cause[:2000]}"


def _mismatched_shapes(checkpoint: Checkpoint) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(name, stored shape, shape the config gives) of each tensor whose name the model has under the checkpoint's
    naming (transformers' conversion reverted, on the meta device) with another shape; quantized weights by their
    dequantized shape. Best effort: [] if the model cannot be built on the meta device."""
    from transformers.core_model_loading import revert_weight_conversion

    try:
        config = AutoConfig.from_pretrained(checkpoint.directory, local_files_only=True)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            model = cast(Any, MODEL_FOR_CAUSAL_LM_MAPPING)[type(config)](config)
        expected = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    except Exception:
        log.debug("cannot build the model on the meta device to compare shapes", exc_info=True)
        return []
    stored = {name: header.shape for name, header in checkpoint.headers.items()}
    for weight, parts in checkpoint.quantized.items():
        if checkpoint.quant_method == "fp8":
            stored[weight] = stored[parts["weight"]]
        elif checkpoint.quant_method == "mxfp4":  # stored (E, out, G, 16) -> transformers' (E, in, out)
            blocks = stored[parts["blocks"]]
            stored[weight] = (*blocks[:-3], blocks[-2] * 32, blocks[-3])
        else:  # int4: the shape it stores beside the packed words
            header = checkpoint.headers[parts["shape"]]
            with safe_open(str(header.file), framework="pt") as handle:
                stored[weight] = tuple(int(n) for n in handle.get_tensor(parts["shape"]).tolist())
    return [(k, shape, expected[k]) for k, shape in stored.items() if k in expected and expected[k] != shape]


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
