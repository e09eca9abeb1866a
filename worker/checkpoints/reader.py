"""Reading a published checkpoint directory ourselves: config.json, the safetensors files (one, or several named by
``model.safetensors.index.json``), and the quantized weights in them.

Why not leave it to ``from_pretrained``: transformers 5.24's block-FP8 dequantizer is wrong on partial tiles
(DeepSeek-V3's real shapes), its MXFP4 path needs ``accelerate``, and a bad checkpoint reaches the user as a raw
traceback from deep inside it. Here every file is checked from its headers before a byte of weights is read (a shard
the index names but that is missing, a tensor of the wrong dtype, a scale grid that does not fit its weight, an unknown
``quant_method``, a config that needs remote code), each failure a :class:`ModelLoadError` saying what to do, and the
quantized weights are dequantized by tinkerq.worker.checkpoints.quant_formats (docs/checkpoints.md).

Quantized weights are keyed by the checkpoint's weight name (:func:`read_quantized_tensors`):

- block FP8 (``quant_method: fp8``): ``X.weight`` float8_e4m3fn + ``X.weight_scale_inv`` -> key ``X.weight``;
- MXFP4 (``quant_method: mxfp4``): ``X_blocks`` + ``X_scales`` -> key ``X`` (e.g.
  ``model.layers.0.mlp.experts.gate_up_proj``), its shape the stored rows (E, 2I, H); transformers' parameter is the
  transpose (E, H, 2I);
- INT4 (``quant_method: compressed-tensors``, ``pack-quantized``): ``X.weight_packed`` + ``X.weight_scale`` +
  ``X.weight_shape`` -> key ``X.weight``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open

from tinkerq.errors import ModelLoadError
from tinkerq.worker.checkpoints import quant_formats as qf

log = logging.getLogger("tinkerq.worker")
T = TypeVar("T")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = {"F32", "BF16", "F16", "F64"}  # safetensors' names
QUANT_METHODS = ("fp8", "mxfp4", "compressed-tensors")


@dataclass
class Header:
    """One stored tensor as its file's header describes it."""

    file: Path
    dtype: str  # safetensors' name: F32, BF16, F8_E4M3, U8, I32, I64 ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEM_BYTES.get(self.dtype, 8)  # an unknown kind counted large


_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2,
               "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass
class Checkpoint:
    """A checkpoint directory, checked: its config.json, every stored tensor's header, and how it is quantized."""

    directory: Path
    config: dict[str, Any]
    headers: dict[str, Header]
    quant_method: str | None = None  # None, or one of QUANT_METHODS
    fp8_block: tuple[int, int] = (128, 128)
    int4_group: int = 32
    # checkpoint weight name -> stored part names (fp8: weight, scale_inv; mxfp4: blocks, scales; int4: packed,
    # scale, shape)
    quantized: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def num_hidden_layers(self) -> int | None:
        value = self.config.get("num_hidden_layers")
        return value if isinstance(value, int) else None

    def fail(self, problem: str, advice: str) -> ModelLoadError:
        return ModelLoadError(f"checkpoint {str(self.directory)!r}: {problem}; {advice}")


def open_checkpoint(directory: Path) -> Checkpoint:
    """Read and check ``directory``'s config.json and safetensors headers (no weights are read)."""
    directory = Path(directory)
    config = _read_config(directory)
    checkpoint = Checkpoint(directory, config, _read_headers(directory))
    _check_quantization(checkpoint)
    _classify(checkpoint)
    return checkpoint


def has_safetensors(directory: Path) -> bool:
    return (Path(directory) / INDEX_FILE).is_file() or (Path(directory) / SINGLE_FILE).is_file()


def _read_config(directory: Path) -> dict[str, Any]:
    from transformers import CONFIG_MAPPING

    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is unreadable ({exc}): is it a Hugging Face model directory?") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a JSON object: is it a Hugging Face model directory?")
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        remote = " and its auto_map names remote code" if config.get("auto_map") else ""
        raise ModelLoadError(
            f"cannot load a causal LM from {str(directory)!r}: config.json's model_type {model_type!r} is not one the "
            f"installed transformers knows{remote}; tinkerq does not "
            f"run a checkpoint's own Python code (trust_remote_code): use a checkpoint of an architecture transformers "
            f"ships (e.g. set model_type to the one it is built on, as Kimi-K2 is DeepSeek-V3) or upgrade "
            f"transformers")
    if config.get("auto_map"):
        log.info("model: %s has an auto_map (remote code); it is not run: transformers' own %s is used", path,
                 model_type)
    return config


def _read_headers(directory: Path) -> dict[str, Header]:
    """Every tensor's file, dtype and shape; a shard the index names but that is missing, a tensor the index puts
    in a file that lacks it, or an unreadable file is a ModelLoadError."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index_path} is unreadable ({exc}): rewrite it, or re-download the checkpoint") \
                from None
    elif (directory / SINGLE_FILE).is_file():
        weight_map = None
    else:
        raise ModelLoadError(f"{str(directory)!r} has no {SINGLE_FILE} and no {INDEX_FILE}: is the download complete?")
    files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
    missing = [name for name in files if not (directory / name).is_file()]
    if missing:
        raise ModelLoadError(
            f"checkpoint {str(directory)!r}: {INDEX_FILE} names {len(missing)} file(s) that are not there "
            f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); download the missing shard(s) again")
    headers: dict[str, Header] = {}
    for name in files:
        path = directory / name
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                    part = handle.get_slice(key)
                    headers[key] = Header(path, str(part.get_dtype()), tuple(int(n) for n in part.get_shape()))
        except Exception as exc:  # safetensors raises its own SafetensorError on a truncated or corrupt file
            raise ModelLoadError(f"{path} is not a readable safetensors file ({exc}); download it again") from None
    if weight_map is not None:
        absent = [k for k, file in weight_map.items() if k not in headers or headers[k].file.name != file]
        if absent:
            raise ModelLoadError(
                f"checkpoint {str(directory)!r}: {INDEX_FILE} puts {len(absent)} tensor(s) in files that do not hold "
                f"them (e.g. {absent[0]} in {weight_map[absent[0]]}); download the shards again")
    return headers


def _check_quantization(checkpoint: Checkpoint) -> None:
    quant = checkpoint.config.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in QUANT_METHODS:
        raise checkpoint.fail(
            f"quantization_config.quant_method {method!r} is not one tinkerq reads ({', '.join(QUANT_METHODS)}: "
            f"block FP8, MXFP4, compressed-tensors pack-quantized INT4)",
            "dequantize the checkpoint to bf16 and save that")
    checkpoint.quant_method = method
    if method == "fp8":
        block = quant.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block)):
            raise checkpoint.fail(f"an fp8 quantization_config needs weight_block_size [rows, cols], got {block!r}",
                                  "tinkerq reads block FP8 (DeepSeek-V3's [128, 128])")
        checkpoint.fp8_block = (block[0], block[1])
    elif method == "compressed-tensors":
        checkpoint.int4_group = _int4_group(checkpoint, quant)


def _int4_group(checkpoint: Checkpoint, quant: dict[str, Any]) -> int:
    """The group size of a compressed-tensors config tinkerq reads: pack-quantized, weight-only, symmetric INT4 in
    groups, one group size for every config group."""
    advice = "tinkerq reads compressed-tensors pack-quantized symmetric INT4 weights in groups (Kimi-K2-Thinking's)"
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise checkpoint.fail("a compressed-tensors quantization_config without config_groups", advice)
    sizes = set()
    for name, group in groups.items():
        group = group if isinstance(group, dict) else {}
        fmt = group.get("format") or quant.get("format")
        weights = group.get("weights") or {}
        if fmt != "pack-quantized":
            raise checkpoint.fail(f"compressed-tensors format {fmt!r} (config group {name})", advice)
        if group.get("input_activations") or group.get("output_activations"):
            raise checkpoint.fail(f"config group {name} quantizes activations", advice)
        wanted = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        wrong = {k: weights.get(k) for k, v in wanted.items() if weights.get(k) != v}
        if wrong or not isinstance(weights.get("group_size"), int) or weights["group_size"] <= 0:
            raise checkpoint.fail(f"config group {name} has weights {wrong or weights}", advice)
        sizes.add(weights["group_size"])
    if len(sizes) != 1:
        raise checkpoint.fail(f"config groups with different group sizes {sorted(sizes)}", advice)
    return sizes.pop()


def _classify(checkpoint: Checkpoint) -> None:
    """Group each quantized weight's stored parts under its weight name, and check every part's dtype and shape and
    every parameter's dtype (a float; integer buffers such as position_ids pass)."""
    headers, method = checkpoint.headers, checkpoint.quant_method
    parts_of: set[str] = set()
    for name in headers:
        if method == "fp8" and name.endswith(".weight_scale_inv"):
            weight = name.removesuffix("_scale_inv")
            checkpoint.quantized[weight] = {"weight": weight, "scale_inv": name}
        elif method == "mxfp4" and name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            checkpoint.quantized[base] = {"blocks": name, "scales": base + "_scales"}
        elif method == "compressed-tensors" and name.endswith(".weight_packed"):
            weight = name.removesuffix("_packed")
            checkpoint.quantized[weight] = {"packed": name, "scale": weight + "_scale", "shape": weight + "_shape"}
    for weight, parts in checkpoint.quantized.items():
        absent = [p for p in parts.values() if p not in headers]
        if absent:
            raise checkpoint.fail(f"{weight} is quantized but {absent[0]} is not in the checkpoint",
                                  "the files are incomplete: download them again")
        parts_of.update(parts.values())
        _check_parts(checkpoint, weight, {role: headers[p] for role, p in parts.items()})
    for name, header in headers.items():
        if name in parts_of:
            continue
        if header.dtype.startswith("F8"):
            raise checkpoint.fail(f"{name} is {header.dtype} without a scale (weight_scale_inv) beside it"
                                  + ("" if method else " and config.json has no quantization_config"),
                                  "the checkpoint is incomplete or its config.json is not the maker's")
        if header.dtype not in FLOAT_DTYPES and _PARAMETER.search(name):
            raise checkpoint.fail(f"{name} is stored as {header.dtype}, {header.shape}; a weight is a float "
                                  f"(F32/BF16/F16){' or a part of a quantized weight' if method else ''}",
                                  "the file is not the maker's: download it again")


def _check_parts(checkpoint: Checkpoint, weight: str, parts: dict[str, Header]) -> None:
    """The dtypes and shapes a weight's stored parts must have in its format, from the headers."""
    def wrong(problem: str) -> ModelLoadError:
        return checkpoint.fail(f"{weight}: {problem}", "the file is not the maker's: download it again")

    if checkpoint.quant_method == "fp8":
        w, s = parts["weight"], parts["scale_inv"]
        if w.dtype != "F8_E4M3" or len(w.shape) != 2:
            raise wrong(f"a block-FP8 weight is 2-D F8_E4M3, got {w.dtype} {w.shape}")
        if s.dtype not in FLOAT_DTYPES:
            raise wrong(f"its weight_scale_inv is {s.dtype}, not a float")
        grid = qf.fp8_scale_grid(w.shape, checkpoint.fp8_block)
        if s.shape != grid:
            raise wrong(f"weight {w.shape} in weight_block_size {list(checkpoint.fp8_block)} tiles (ceil-divided) "
                        f"needs a weight_scale_inv grid {grid}, got {s.shape}")
    elif checkpoint.quant_method == "mxfp4":
        b, s = parts["blocks"], parts["scales"]
        if b.dtype != "U8" or s.dtype != "U8":
            raise wrong(f"MXFP4 blocks and scales are U8, got {b.dtype} and {s.dtype}")
        if len(b.shape) < 2 or b.shape[-1] != qf.MXFP4_BLOCK // 2 or b.shape[:-1] != s.shape:
            raise wrong(f"MXFP4 blocks (..., G, 16) need scales (..., G), got blocks {b.shape} and scales {s.shape}")
    else:
        p, s, n = parts["packed"], parts["scale"], parts["shape"]
        if p.dtype != "I32" or len(p.shape) != 2:
            raise wrong(f"weight_packed is 2-D I32, got {p.dtype} {p.shape}")
        if s.dtype not in FLOAT_DTYPES or len(s.shape) != 2:
            raise wrong(f"weight_scale is a 2-D float, got {s.dtype} {s.shape}")
        if n.dtype not in ("I64", "I32") or n.shape != (2,):
            raise wrong(f"weight_shape is 2 integers, got {n.dtype} {n.shape}")


def _read(header: Header, name: str) -> torch.Tensor:
    with safe_open(str(header.file), framework="pt") as handle:
        return handle.get_tensor(name)


def _quantized(checkpoint: Checkpoint, weight: str, stored: dict[str, torch.Tensor]) -> qf.QuantizedTensor:
    """One weight's parts as a QuantizedTensor; its shape checked against its parts."""
    parts = checkpoint.quantized[weight]
    if checkpoint.quant_method == "fp8":
        w = stored[parts["weight"]]
        return qf.QuantizedTensor(qf.FP8_BLOCK, {"weight": w, "scale_inv": stored[parts["scale_inv"]]},
                                  tuple(w.shape), checkpoint.fp8_block)
    if checkpoint.quant_method == "mxfp4":
        blocks = stored[parts["blocks"]]
        shape = (*blocks.shape[:-2], blocks.shape[-2] * qf.MXFP4_BLOCK)  # (..., rows, K)
        return qf.QuantizedTensor(qf.MXFP4, {"blocks": blocks, "scales": stored[parts["scales"]]}, tuple(shape))
    packed, scale = stored[parts["packed"]], stored[parts["scale"]]
    rows, cols = (int(n) for n in stored[parts["shape"]].tolist())
    group = checkpoint.int4_group
    if tuple(packed.shape) != (rows, math.ceil(cols / 8)) or tuple(scale.shape) != (rows, math.ceil(cols / group)):
        raise checkpoint.fail(
            f"{weight}: weight_shape ({rows}, {cols}) in groups of {group} needs weight_packed "
            f"({rows}, {math.ceil(cols / 8)}) and weight_scale ({rows}, {math.ceil(cols / group)}), got "
            f"{tuple(packed.shape)} and {tuple(scale.shape)}", "the file is not the maker's: download it again")
    return qf.QuantizedTensor(qf.INT4_PACKED, {"packed": packed, "scale": scale}, (rows, cols), (group,))


def read_quantized_tensors(directory: str | Path, select: Callable[[str], bool] | None = None, *,
                           checkpoint: Checkpoint | None = None) -> dict[str, qf.QuantizedTensor]:
    """Every quantized weight of the checkpoint in ``directory`` (or those whose name ``select`` takes), as stored,
    keyed by its weight name (fp8 and int4: ``...weight``; mxfp4: e.g. ``model.layers.0.mlp.experts.gate_up_proj``,
    shape the stored rows (E, 2I, H)); {} for an unquantized checkpoint. Checked as :func:`open_checkpoint` checks;
    ModelLoadError on a bad checkpoint. ``checkpoint``: that directory already opened (read many times)."""
    checkpoint = checkpoint or open_checkpoint(Path(directory))
    weights = [w for w in checkpoint.quantized if select is None or select(w)]
    names = {p for w in weights for p in checkpoint.quantized[w].values()}
    stored = {n: _read(checkpoint.headers[n], n) for n in names}
    return {weight: _quantized(checkpoint, weight, stored) for weight in weights}


class LazyTensors:
    """The checkpoint's tensors under its own names, each read (and, if quantized, dequantized to ``dtype``) only
    when indexed with ``[...]``, as transformers' loader indexes safetensors slices: a reader holds one weight at a
    time. Layers beyond num_hidden_layers are left out. Each file is opened once; :meth:`close` closes them."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype) -> None:
        self.checkpoint = checkpoint
        self.dtype = dtype
        self._handles: dict[Path, Any] = {}
        parts = {p for ps in checkpoint.quantized.values() for p in ps.values()}
        names = [*checkpoint.quantized, *(n for n in checkpoint.headers if n not in parts)]
        self.entries = drop_extra_layers(checkpoint, {n: _Lazy(self, n) for n in names})

    def stored(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def _handle(self, name: str) -> Any:
        header = self.checkpoint.headers[name]
        handle = self._handles.get(header.file)
        if handle is None:  # read, not mapped: a mapped file's pages stay in this process's RSS once touched
            handle = self._handles[header.file] = safe_open(str(header.file), framework="pt", backend="pread")
        return handle

    def value(self, name: str) -> torch.Tensor:
        checkpoint = self.checkpoint
        if name not in checkpoint.quantized:
            return self.stored(name)
        stored = {p: self.stored(p) for p in checkpoint.quantized[name].values()}
        try:
            value = _quantized(checkpoint, name, stored).dequantize(self.dtype)
        except qf.QuantFormatError as exc:
            raise checkpoint.fail(f"{name}: {exc}", "the file is not the maker's: download it again") from None
        if checkpoint.quant_method == "mxfp4":
            value = value.transpose(-1, -2).contiguous()  # stored (E, out, in) -> transformers' (E, in, out)
        return value

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``value(name)[start:stop]``, reading (and dequantizing) only those rows of dim 0 (MXFP4: experts) and, for
        block FP8, the tiles they fall in: bitwise the rows of the whole."""
        checkpoint = self.checkpoint
        parts = checkpoint.quantized.get(name)
        if parts is None:
            return self._slice(name, start, stop)
        try:
            if checkpoint.quant_method == "fp8":
                br, _ = checkpoint.fp8_block
                rows = checkpoint.headers[parts["weight"]].shape[0]
                lo, hi = start // br * br, min(rows, -(-stop // br) * br)  # whole tiles: their scales' rows
                weight = self._slice(parts["weight"], lo, hi)
                scale = self._slice(parts["scale_inv"], lo // br, -(-hi // br))
                value = qf.dequantize_fp8_blocks(weight, scale, checkpoint.fp8_block, self.dtype)
                return value[start - lo:stop - lo]
            if checkpoint.quant_method == "mxfp4":  # dim 0 is the experts, stored and transposed alike
                blocks = self._slice(parts["blocks"], start, stop)
                scales = self._slice(parts["scales"], start, stop)
                return qf.dequantize_mxfp4(blocks, scales, self.dtype).transpose(-1, -2).contiguous()
            cols = self.shape(name)[1]
            return qf.dequantize_int4_packed(self._slice(parts["packed"], start, stop),
                                             self._slice(parts["scale"], start, stop), (stop - start, cols),
                                             checkpoint.int4_group, self.dtype)
        except qf.QuantFormatError as exc:
            raise checkpoint.fail(f"{name}: {exc}", "the file is not the maker's: download it again") from None

    def _slice(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._handle(name).get_slice(name)[start:stop]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of ``value(name)``, from the headers (an INT4 weight's from the shape it stores)."""
        checkpoint = self.checkpoint
        parts = checkpoint.quantized.get(name)
        if parts is None:
            return checkpoint.headers[name].shape
        if checkpoint.quant_method == "fp8":
            return checkpoint.headers[parts["weight"]].shape
        if checkpoint.quant_method == "mxfp4":  # stored (E, out, G, 16) -> transformers' (E, in, out)
            blocks = checkpoint.headers[parts["blocks"]].shape
            return (*blocks[:-3], blocks[-2] * qf.MXFP4_BLOCK, blocks[-3])
        return tuple(int(n) for n in self.stored(parts["shape"]).tolist())

    def close(self) -> None:
        self._handles.clear()  # safe_open's handles unmap their file when collected


class _Lazy:
    """One entry of :class:`LazyTensors`: ``[...]`` reads it."""

    def __init__(self, tensors: LazyTensors, name: str) -> None:
        self.tensors, self.name = tensors, name

    def __getitem__(self, index: Any) -> torch.Tensor:
        # transformers' shard-on-read asks for one range of dim 0 and the whole of the others: read only those rows.
        if isinstance(index, tuple) and index and all(isinstance(i, slice) and i.step in (None, 1) for i in index):
            shape = self.tensors.shape(self.name)
            rest = [(i.start or 0, shape[d] if i.stop is None else i.stop) for d, i in enumerate(index[1:], 1)]
            if len(index) == len(shape) and all(r == (0, shape[d]) for d, r in enumerate(rest, 1)):
                start, stop, _ = index[0].indices(shape[0])
                return self.tensors.rows(self.name, start, max(start, stop))
        return self.tensors.value(self.name)[index]

    def get_shape(self) -> list[int]:  # as safetensors' slices answer it
        return list(self.tensors.shape(self.name))


def dequantized_state_dict(checkpoint: Checkpoint, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under its own names, quantized weights dequantized to ``dtype`` (MXFP4 experts
    transposed to transformers' (E, in, out) parameter layout), layers beyond num_hidden_layers left out."""
    lazy = LazyTensors(checkpoint, dtype)
    try:
        return {name: lazy.value(name) for name in lazy.entries}
    finally:
        lazy.close()


def drop_extra_layers(checkpoint: Checkpoint, tensors: dict[str, T]) -> dict[str, T]:
    """Without the layers at index >= num_hidden_layers (DeepSeek-V3's multi-token-prediction layer), which
    transformers' models do not have; logged."""
    layers = checkpoint.num_hidden_layers
    if layers is None:
        return tensors
    extra = sorted({m.group(1) for k in tensors if (m := _LAYER.match(k)) and int(m.group(1)) >= layers}, key=int)
    if not extra:
        return tensors
    dropped = [k for k in tensors if (m := _LAYER.match(k)) and int(m.group(1)) >= layers]
    log.info("model: %d tensors of layer(s) %s left out (beyond num_hidden_layers %d: a multi-token-prediction "
             "layer, which transformers' model does not run)", len(dropped), ", ".join(extra), layers)
    return {k: v for k, v in tensors.items() if k not in set(dropped)}


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# The names of parameters (always floats); some models persist integer buffers (position_ids, token_type_ids).
_PARAMETER = re.compile(r"(weight|bias|_proj|sinks)$")
