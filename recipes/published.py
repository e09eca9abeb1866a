"""Tiny checkpoints in the on-disk layouts model makers publish, built offline from the tiny family models.

``recipes/families.py`` saves its models with transformers' ``save_pretrained``; real repositories are written by
the makers' own tools, and that is what users point tinkerq at. Each layout here is written with safetensors
directly, as the maker's repository has it (docs/checkpoints.md; /work/shared/reference/published-checkpoints.md):

- ``qwen3_moe-bf16``: Qwen3-30B-A3B: per-expert bf16 tensors (``mlp.experts.E.gate_proj.weight`` ...), two
  ``model-0000K-of-00002.safetensors`` files split by bytes (a layer can straddle them) and
  ``model.safetensors.index.json``.
- ``llama-bf16-tied``: Llama-3.2-1B: dense bf16, tied embeddings (no ``lm_head.weight``), one ``model.safetensors``.
- ``gpt_oss-mxfp4``: gpt-oss: routed experts in MXFP4 (``mlp.experts.gate_up_proj_blocks`` uint8 (E, 2I, H/32, 16),
  ``_scales`` (E, 2I, H/32); ``down_proj_blocks`` (E, H, I/32, 16)), the rest bf16; ``quant_method: mxfp4``.
- ``deepseek_v3-fp8``: DeepSeek-V3: block FP8 (``float8_e4m3fn`` + float32 ``weight_scale_inv``, 128x128 tiles,
  ceil-divided) on every attention, dense-MLP, shared- and routed-expert Linear; the router bf16, its
  ``e_score_correction_bias`` float32 and nonzero; ``kv_a_proj_with_mqa`` (576, 200) as in the real model (kv_lora_rank
  512 + rope 64) and a hidden size (200) that is no multiple of 128; the multi-token-prediction layer at index
  ``num_hidden_layers`` (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.*`` and its block), which transformers
  ignores.
- ``kimi_k2-int4``: Kimi-K2-Thinking: the DeepSeek-V3 architecture with routed experts in compressed-tensors
  ``pack-quantized`` INT4 (``weight_packed`` int32, bf16 ``weight_scale``, ``weight_shape``; symmetric, groups of 32),
  the rest bf16. The real repository says ``model_type: kimi_k2`` (remote code); here it is ``deepseek_v3``, the same
  architecture transformers ships, so no remote code runs.

``tinkerq families build DIR --layout published`` writes them all; tests/test_published_checkpoints.py and
``python -m tinkerq.recipes.published --check`` (scripts/test, on an install without the dev extras) load them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FP8_BLOCK = [128, 128]
INT4_GROUP = 32

# DeepSeek-V3's attention at its real ranks (kv_lora_rank 512 + qk_rope_head_dim 64 = 576 rows of kv_a_proj_with_mqa),
# at toy width elsewhere; hidden 200 and intermediate 136 are no multiples of 128, so tiles are partial on both axes.
_DEEPSEEK_REAL_GEOMETRY: dict[str, Any] = dict(
    hidden_size=200, intermediate_size=136, moe_intermediate_size=48, kv_lora_rank=512, qk_rope_head_dim=64,
    head_dim=64, q_lora_rank=96, qk_nope_head_dim=16, v_head_dim=16, num_attention_heads=2, num_key_value_heads=2,
    num_hidden_layers=2, first_k_dense_replace=1)
# Kimi-K2: groups of 32 along the input dimension; hidden 64 and expert width 32 keep them whole.
_KIMI_GEOMETRY: dict[str, Any] = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=2, first_k_dense_replace=1)
# gpt-oss's MXFP4 rows are whole blocks of 32 values along H (gate_up) and I (down).
_GPT_OSS_GEOMETRY: dict[str, Any] = dict(hidden_size=64, intermediate_size=32)


@dataclass(frozen=True)
class Layout:
    family: str  # recipes/families.py
    overrides: dict[str, Any]
    shards: int  # 1: a single model.safetensors, no index
    tied: bool = False
    quantization: str = ""  # "", "fp8", "mxfp4", "int4"
    mtp: bool = False  # DeepSeek's multi-token-prediction layer at index num_hidden_layers
    description: str = ""


LAYOUTS: dict[str, Layout] = {
    "qwen3_moe-bf16": Layout("qwen3_moe", {}, shards=2, description="Qwen3-30B-A3B style: per-expert bf16, 2 shards"),
    "llama-bf16-tied": Layout("llama", {"tie_word_embeddings": True}, shards=1, tied=True,
                              description="Llama-3.2-1B style: dense bf16, tied embeddings, one file"),
    "gpt_oss-mxfp4": Layout("gpt_oss", _GPT_OSS_GEOMETRY, shards=2, quantization="mxfp4",
                            description="gpt-oss style: MXFP4 routed experts, the rest bf16"),
    "deepseek_v3-fp8": Layout("deepseek_v3", _DEEPSEEK_REAL_GEOMETRY, shards=3, quantization="fp8", mtp=True,
                              description="DeepSeek-V3 style: block FP8 at the real MLA ranks, MTP layer"),
    "kimi_k2-int4": Layout("deepseek_v3", _KIMI_GEOMETRY, shards=2, quantization="int4",
                           description="Kimi-K2-Thinking style: INT4 pack-quantized routed experts"),
}

# What each maker keeps unquantized (the names as their configs give them).
_MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
_KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def quantization_config(layout: Layout) -> dict[str, Any] | None:
    """The ``quantization_config`` the maker's config.json carries for ``layout``."""
    if layout.quantization == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": FP8_BLOCK}
    if layout.quantization == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": _MXFP4_NOT_CONVERTED}
    if layout.quantization == "int4":
        # As Kimi-K2-Thinking's config.json has it; compressed_tensors.QuantizationConfig accepts it (tested).
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": INT4_GROUP, "strategy": "group",
                   "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                   "observer_kwargs": {}}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None}},
                "ignore": _KIMI_IGNORE, "kv_cache_scheme": None}
    return None


def _fp8_target(name: str) -> bool:
    """DeepSeek-V3 quantizes every Linear but the router, the embeddings and the heads (norms are 1-D)."""
    return (name.endswith(".weight") and not name.endswith("mlp.gate.weight") and "embed_tokens" not in name
            and "lm_head" not in name and "shared_head.head" not in name and "norm" not in name)


def _checkpoint_tensors(layout: Layout, seed: int) -> tuple[Any, dict[str, Any]]:
    """The float32 model (as transformers holds it) and its tensors under the checkpoint's names (per-expert keys,
    the MTP layer added), before quantization."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    from tinkerq.recipes.families import build_model

    model = build_model(layout.family, seed, **layout.overrides)
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # buffers the family builder leaves at zero (DeepSeek's routing correction bias)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias") and float(buffer.abs().max()) == 0.0:
                buffer.copy_(torch.rand(buffer.shape, generator=generator) * 0.2)
    state = model.state_dict()
    if layout.tied:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    tensors = dict(revert_weight_conversion(model, state))
    if layout.mtp:
        tensors.update(_mtp_layer(layout, seed))
    return model, tensors


def _mtp_layer(layout: Layout, seed: int) -> dict[str, Any]:
    """DeepSeek-V3's multi-token-prediction layer, stored at index num_hidden_layers: a full decoder block (taken
    from a one-layer-deeper model) plus enorm, hnorm, eh_proj (H, 2H), shared_head.norm and shared_head.head."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    from tinkerq.recipes.families import build_model

    n = int(layout.overrides["num_hidden_layers"])
    deeper = build_model(layout.family, seed + 100, **{**layout.overrides, "num_hidden_layers": n + 1})
    prefix = f"model.layers.{n}."
    out = {k: v for k, v in revert_weight_conversion(deeper, deeper.state_dict()).items() if k.startswith(prefix)}
    hidden, vocab = deeper.config.hidden_size, deeper.config.vocab_size
    generator = torch.Generator().manual_seed(seed + 3)
    out[prefix + "enorm.weight"] = torch.ones(hidden)
    out[prefix + "hnorm.weight"] = torch.ones(hidden)
    out[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.02
    out[prefix + "shared_head.norm.weight"] = torch.ones(hidden)
    out[prefix + "shared_head.head.weight"] = torch.randn(vocab, hidden, generator=generator) * 0.02
    return out


def quantize_tensors(layout: Layout, tensors: dict[str, Any]) -> dict[str, Any]:
    """The tensors as the maker stores them: quantized parts beside (in place of) the quantized weights, bf16 for the
    rest, float32 for DeepSeek's correction bias."""
    import torch

    from tinkerq.worker.checkpoints import quant_formats as qf

    stored: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if layout.quantization == "fp8" and tensor.dim() == 2 and _fp8_target(name):
            stored[name], stored[name + "_scale_inv"] = qf.quantize_fp8_blocks(tensor, FP8_BLOCK)
        elif layout.quantization == "mxfp4" and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            # transformers holds gate_up_proj (E, H, 2I) and down_proj (E, I, H); gpt-oss stores them as rows of the
            # output: (E, 2I, H) and (E, H, I), quantized along the input in blocks of 32.
            stored[name + "_blocks"], stored[name + "_scales"] = qf.quantize_mxfp4(tensor.transpose(-1, -2))
        elif layout.quantization == "int4" and _ROUTED_EXPERT.search(name):
            base = name.removesuffix(".weight")
            packed, scale = qf.quantize_int4_packed(tensor, INT4_GROUP)
            stored[base + ".weight_packed"] = packed
            stored[base + ".weight_scale"] = scale.to(torch.bfloat16)
            stored[base + ".weight_shape"] = torch.tensor(tensor.shape)  # int64, as compressed-tensors writes it
        elif name.endswith("e_score_correction_bias"):
            stored[name] = tensor.to(torch.float32)
        else:
            stored[name] = tensor.to(torch.bfloat16)
    return stored


def write_safetensors(stored: dict[str, Any], out_dir: Path, shards: int) -> None:
    """``stored`` in ``shards`` files split by bytes, in name order within each layer as makers write them (one
    layer's tensors may straddle two files), with ``model.safetensors.index.json``; one ``model.safetensors`` if
    ``shards`` is 1."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in stored.items()}
    if shards == 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    per_file = math.ceil(total / shards)
    files: list[dict[str, Any]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if size >= per_file * len(files) and len(files) < shards:
            files.append({})
        files[-1][name] = tensor
        size += tensor.numel() * tensor.element_size()
    weight_map: dict[str, str] = {}
    for k, part in enumerate(files, start=1):
        filename = f"model-{k:05d}-of-{len(files):05d}.safetensors"
        save_file(part, str(out_dir / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, filename))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_config(model: Any, layout: Layout, out_dir: Path) -> None:
    """config.json as a transformers 4.x maker wrote it (``torch_dtype``) with the maker's quantization_config, and
    generation_config.json."""
    config = model.config.to_dict()
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    if layout.mtp:
        config["num_nextn_predict_layers"] = 1
    quant = quantization_config(layout)
    if quant is not None:
        config["quantization_config"] = quant
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
                  "do_sample": True, "temperature": 0.6}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def build_published(layout_name: str, out_dir: Path, seed: int = 0) -> Path:
    """``layout_name`` (:data:`LAYOUTS`) written to ``out_dir`` (created): weights, config, demo tokenizer."""
    from tinkerq.recipes.demo_model import build_tokenizer

    if layout_name not in LAYOUTS:
        raise KeyError(f"unknown layout {layout_name!r}; known: {', '.join(LAYOUTS)}")
    layout = LAYOUTS[layout_name]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tensors = _checkpoint_tensors(layout, seed)
    write_safetensors(quantize_tensors(layout, tensors), out_dir, layout.shards)
    write_config(model, layout, out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return out_dir


# -- the plain-install check (scripts/test runs it in a venv without the dev extras) ------------------------------

def reference_model(directory: Path) -> Any:
    """Plain transformers on the float model the checkpoint in ``directory`` means: every stored weight dequantized
    (tinkerq.worker.checkpoints.quant_formats, straight from the files), the MTP layer left out, loaded with
    transformers' own
    key conversion from a float directory written by ``save_pretrained``'s layout (no quantization_config)."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tinkerq.worker.checkpoints import quant_formats as qf

    config = json.loads((directory / "config.json").read_text())
    quant = config.pop("quantization_config", None) or {}
    stored: dict[str, Any] = {}
    for file in sorted(directory.glob("*.safetensors")):
        stored.update(load_file(str(file)))
    floats: dict[str, Any] = {}
    for name, tensor in stored.items():
        if name.endswith(("_scale_inv", "_scales", ".weight_scale", ".weight_shape")):
            continue
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            floats[base] = qf.dequantize_mxfp4(tensor, stored[base + "_scales"]).transpose(-1, -2).contiguous()
        elif name.endswith(".weight_packed"):
            base = name.removesuffix("_packed")
            floats[base] = qf.dequantize_int4_packed(tensor, stored[base + "_scale"],
                                                     stored[base + "_shape"].tolist(), INT4_GROUP)
        elif name + "_scale_inv" in stored:
            floats[name] = qf.dequantize_fp8_blocks(tensor, stored[name + "_scale_inv"], quant["weight_block_size"])
        else:
            floats[name] = tensor.to(torch.float32)
    layers = int(config["num_hidden_layers"])
    floats = {k: v for k, v in floats.items() if not _beyond_layers(k, layers)}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        save_file(floats, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, local_files_only=True).eval()


def _beyond_layers(name: str, layers: int) -> bool:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= layers


def max_logprob_diff(model: Any, reference: Any, seed: int = 0) -> float:
    """max |log softmax(model) - log softmax(reference)| over a fixed random batch (2 x 12 tokens), on the model's
    device."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    vocab = int(reference.config.vocab_size)
    ids = torch.randint(3, vocab, (2, 12), generator=generator).to(next(model.parameters()).device)
    with torch.no_grad():
        ours = torch.log_softmax(model(ids).logits.float(), -1)
        theirs = torch.log_softmax(reference(ids).logits.float(), -1)
    return float((ours - theirs).abs().max())


def check(out_root: Path, tolerance: float | None = None, report: Callable[[str], None] = print, *,
          device: str = "cpu", dtype: str = "float32") -> bool:
    """Build every layout under ``out_root``, load each with ``load_causal_lm`` on ``device`` in ``dtype`` and compare
    its logprobs with plain transformers on the dequantized model (the same device and dtype); a quantized layout
    also kept quantized (worker/loading/quantized_base.py), compared with the dequantized load. True if every one is
    within
    ``tolerance`` (default 1e-4 in float32, 5e-2 in a half dtype: the GPU check,
    ``--check --device cuda --dtype bfloat16``)."""
    import torch

    from tinkerq.worker.loading.models import load_causal_lm
    from tinkerq.worker.loading.quantized_base import keep_checkpoint_quantized

    limit = tolerance if tolerance is not None else 1e-4 if dtype == "float32" else 5e-2
    ok = True

    def verdict(what: str, diff: float) -> None:
        nonlocal ok
        ok &= diff <= limit
        report(f"{what} {diff:.2e} ({'ok' if diff <= limit else 'FAILED'}; {device}, {dtype})")

    for name in LAYOUTS:
        directory = build_published(name, out_root / name)
        model = load_causal_lm(str(directory), device=device, dtype=dtype)
        reference = reference_model(directory).to(device=device, dtype=getattr(torch, dtype))
        verdict(f"{name}: max |logprob diff| vs plain transformers on the dequantized model",
                max_logprob_diff(model, reference))
        if LAYOUTS[name].quantization:
            kept = load_causal_lm(str(directory), device=device, dtype=dtype)
            keep_checkpoint_quantized(kept, str(directory))
            verdict(f"{name}: kept quantized vs dequantized on load", max_logprob_diff(kept, model))
    return ok


def measure_one(directory: Path) -> str:
    """In this (fresh) process: load ``directory`` with load_causal_lm; its load time, the process's RSS after the
    load, and its logprobs' max difference from plain transformers on the dequantized model (loaded after)."""
    import resource
    import time

    from tinkerq.worker.loading.models import load_causal_lm

    started = time.perf_counter()
    model = load_causal_lm(str(directory))
    load_s = time.perf_counter() - started
    rss_mib = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    diff = max_logprob_diff(model, reference_model(directory))
    return (f"| {directory.name} | {diff:.1e} | {load_s:.2f} s | {rss_mib:.0f} MiB (peak {peak_mib:.0f}) "
            f"| {sum(p.stat().st_size for p in directory.glob('*.safetensors')) / 1e6:.2f} MB |")


def main(argv: list[str] | None = None) -> int:
    import subprocess
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m tinkerq.recipes.published", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="build every layout in a temporary directory and load "
                                                             "each with load_causal_lm (exit 1 on a mismatch)")
    parser.add_argument("--measure", action="store_true", help="build every layout in a temporary directory and load "
                                                               "each in a fresh process: a markdown table of the "
                                                               "logprob difference, load time and RSS")
    parser.add_argument("--device", default="cpu", help="with --check: where to load (cuda: the GPU check)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="with --check: the served dtype (bfloat16 with --device cuda: the GPU check)")
    parser.add_argument("--measure-one", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("dir", nargs="?", help="without --check: write every layout to DIR/<layout>")
    args = parser.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            return 0 if check(Path(tmp), device=args.device, dtype=args.dtype) else 1
    if args.measure_one:
        print(measure_one(Path(args.measure_one)))
        return 0
    if args.measure:
        print("| layout | max abs logprob diff | load time | RSS after load | safetensors |\n|---|---|---|---|---|")
        with tempfile.TemporaryDirectory() as tmp:
            for name in LAYOUTS:
                directory = build_published(name, Path(tmp) / name)
                line = subprocess.run([sys.executable, "-m", "tinkerq.recipes.published", "--measure-one",
                                       str(directory)], check=True, capture_output=True, text=True).stdout
                print(line.strip().splitlines()[-1], flush=True)
        return 0
    if not args.dir:
        parser.error("pass DIR, or --check")
    for name in LAYOUTS:
        print(build_published(name, Path(args.dir) / name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
