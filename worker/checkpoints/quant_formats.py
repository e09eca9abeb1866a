"""The quantized weight formats that published checkpoints ship in, and their dequantization.

Owned here rather than taken from transformers' quantizers: 5.24's block-FP8 dequantizer infers the block size from
the scale grid (``rows // scale_rows``), which fails on DeepSeek-V3's real shapes (``kv_a_proj_with_mqa`` is
(576, 7168) with a (5, 56) grid) and is silently wrong where a partial tile happens to divide; its MXFP4 path needs
``accelerate``. Each function takes the tensors as stored and returns the weight in ``dtype``; nothing is cached.

- Block FP8 (DeepSeek-V3/V3.1/R1, Kimi-K2's dense layers; ``quant_method: fp8``): ``weight`` float8_e4m3fn (R, C),
  ``weight_scale_inv`` float32 (ceil(R / br), ceil(C / bc)), one scale per (br, bc) tile of the config's
  ``weight_block_size``; the last tile of each axis may be partial. W = weight * scale_inv of the tile.
- MXFP4 (gpt-oss's routed experts; ``quant_method: mxfp4``): ``*_blocks`` uint8 (..., G, 16), two E2M1 codes per
  byte, low nibble first; ``*_scales`` uint8 (..., G), an E8M0 exponent biased by 127 per 32 values.
  W[..., 32 g + j] = E2M1(code j of block g) * 2 ** (scale g - 127).
- INT4 pack-quantized (Kimi-K2-Thinking's routed experts; ``quant_method: compressed-tensors``, format
  ``pack-quantized``): ``weight_packed`` int32 (R, ceil(C / 8)), element c of a row at bits 4c .. 4c + 3 of the row
  (little-endian words), stored as q + 8; ``weight_scale`` (R, ceil(C / group)); symmetric:
  W[r, c] = q * scale[r, c // group].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# E2M1 (fp4) code -> value: sign bit 3, exponent bits 2..1, mantissa bit 0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per E8M0 scale
MXFP4_SCALE_BIAS = 127


class QuantFormatError(ValueError):
    """Stored quantized tensors that do not fit their format (a shape, a dtype, a scale grid)."""


def fp8_scale_grid(shape: tuple[int, int] | torch.Size, block: tuple[int, int] | list[int]) -> tuple[int, int]:
    """The (rows, cols) of the scale grid a block-FP8 weight of ``shape`` needs: ceil-divided tiles."""
    rows, cols = int(shape[0]), int(shape[1])
    return math.ceil(rows / int(block[0])), math.ceil(cols / int(block[1]))


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int],
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A block-FP8 weight (R, C) with its (ceil(R/br), ceil(C/bc)) scales -> (R, C) in ``dtype``."""
    if weight.dim() != 2:
        raise QuantFormatError(f"a block-FP8 weight is 2-D, got shape {tuple(weight.shape)}")
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise QuantFormatError(f"a block-FP8 weight is float8_e4m3fn (or e5m2), got {weight.dtype}")
    br, bc = int(block[0]), int(block[1])
    grid = fp8_scale_grid(weight.shape, (br, bc))
    if tuple(scale_inv.shape) != grid:
        raise QuantFormatError(f"weight {tuple(weight.shape)} with weight_block_size [{br}, {bc}] needs a scale grid "
                               f"{grid}, got {tuple(scale_inv.shape)}")
    rows, cols = weight.shape
    # Each scale covers its tile; repeat_interleave then crop handles the partial last tile of each axis.
    scales = scale_inv.to(torch.float32).repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return (weight.to(torch.float32) * scales).to(dtype)  # (R, C)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 ``blocks`` (..., G, 16) uint8 and ``scales`` (..., G) uint8 -> (..., G * 32) in ``dtype`` (the
    stored row layout; gpt-oss's experts transpose it to (E, in, out))."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantFormatError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise QuantFormatError(f"MXFP4 blocks (..., G, {MXFP4_BLOCK // 2}) need scales (..., G): got blocks "
                               f"{tuple(blocks.shape)} and scales {tuple(scales.shape)}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # (..., G, 16, 2): low nibble first
    values = lut[codes].flatten(-2)  # (..., G, 32)
    exponents = scales.to(torch.int32) - MXFP4_SCALE_BIAS
    out = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))  # (..., G, 32)
    return out.flatten(-2).to(dtype)  # (..., G * 32)


def dequantize_int4_packed(packed: torch.Tensor, scale: torch.Tensor, shape: Sequence[int],
                           group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` symmetric INT4: ``packed`` int32 (R, ceil(C/8)), ``scale``
    (R, ceil(C/group)) -> (R, C) in ``dtype``."""
    rows, cols = int(shape[0]), int(shape[1])
    if packed.dtype != torch.int32:
        raise QuantFormatError(f"pack-quantized weights are int32, got {packed.dtype}")
    if tuple(packed.shape) != (rows, math.ceil(cols / 8)):
        raise QuantFormatError(f"a packed INT4 weight of shape ({rows}, {cols}) is stored as "
                               f"({rows}, {math.ceil(cols / 8)}) int32, got {tuple(packed.shape)}")
    grid = (rows, math.ceil(cols / group_size))
    if tuple(scale.shape) != grid:
        raise QuantFormatError(f"a ({rows}, {cols}) INT4 weight in groups of {group_size} needs scales {grid}, got "
                               f"{tuple(scale.shape)}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # element k of a word: bits 4k..4k+3
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # (R, words, 8)
    q = nibbles.flatten(-2)[:, :cols].to(torch.float32) - 8.0  # (R, C), in [-8, 7]
    scales = scale.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :cols]
    return (q * scales).to(dtype)


# -- quantizing (the inverse, for building checkpoints in the published layouts and for tests) ---------------------

FP8_E4M3_MAX = 448.0


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, C) -> (float8_e4m3fn (R, C), float32 scale_inv (ceil(R/br), ceil(C/bc))), scale = tile amax / 448."""
    br, bc = int(block[0]), int(block[1])
    rows, cols = weight.shape
    grid_r, grid_c = fp8_scale_grid(weight.shape, (br, bc))
    padded = torch.zeros(grid_r * br, grid_c * bc, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.reshape(grid_r, br, grid_c, bc)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_E4M3_MAX  # (grid_r, grid_c)
    q = (tiles / scale[:, None, :, None]).reshape(grid_r * br, grid_c * bc)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) with K a multiple of 32 -> (blocks uint8 (..., K/32, 16), scales uint8 (..., K/32)), each value
    rounded to the nearest E2M1 code under a power-of-two scale that keeps the block's amax within 6."""
    *prefix, k = weight.shape
    if k % MXFP4_BLOCK:
        raise QuantFormatError(f"MXFP4 rows are whole blocks of {MXFP4_BLOCK} values, got {k}")
    groups = weight.float().reshape(*prefix, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-MXFP4_SCALE_BIAS, 127)  # (..., G)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(dim=-1).to(torch.uint8)  # (..., G, 32)
    pairs = codes.reshape(*codes.shape[:-1], MXFP4_BLOCK // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponent + MXFP4_SCALE_BIAS).to(torch.uint8)


def quantize_int4_packed(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, C) -> (int32 packed (R, ceil(C/8)), float32 scales (R, ceil(C/group))), symmetric: scale = amax / 7."""
    rows, cols = weight.shape
    n_groups = math.ceil(cols / group_size)
    padded = torch.zeros(rows, n_groups * group_size, dtype=torch.float32)
    padded[:, :cols] = weight.float()
    scale = (padded.reshape(rows, n_groups, group_size).abs().amax(-1) / 7.0).clamp(min=1e-12)  # (R, G)
    q = torch.round(padded / scale.repeat_interleave(group_size, 1)).clamp(-8, 7)[:, :cols].to(torch.int32) + 8
    words = math.ceil(cols / 8)
    q = torch.nn.functional.pad(q, (0, words * 8 - cols)).reshape(rows, words, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    packed = (q << shifts).sum(-1, dtype=torch.int64)  # the word's bits as an unsigned value
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return packed, scale


# -- one stored quantized weight ----------------------------------------------------------------------------------

FP8_BLOCK, MXFP4, INT4_PACKED = "fp8_block", "mxfp4", "int4_packed"


@dataclass
class QuantizedTensor:
    """One weight as a checkpoint stores it: ``format`` (FP8_BLOCK, MXFP4, INT4_PACKED), its stored ``parts``
    (fp8: weight, scale_inv; mxfp4: blocks, scales; int4: packed, scale), the dequantized ``shape`` and the format's
    ``block`` (fp8: [br, bc]; int4: [group]). :meth:`dequantize` gives the weight as the checkpoint means it (for
    MXFP4 the stored row layout, (..., rows, K))."""

    format: str
    parts: dict[str, torch.Tensor]
    shape: tuple[int, ...]
    block: tuple[int, ...] = ()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.format == FP8_BLOCK:
            return dequantize_fp8_blocks(self.parts["weight"], self.parts["scale_inv"], self.block, dtype)
        if self.format == MXFP4:
            return dequantize_mxfp4(self.parts["blocks"], self.parts["scales"], dtype)
        if self.format == INT4_PACKED:
            return dequantize_int4_packed(self.parts["packed"], self.parts["scale"], self.shape, self.block[0], dtype)
        raise QuantFormatError(f"unknown quantized format {self.format!r}")

    @property
    def nbytes(self) -> int:
        """Bytes as stored (what a kept-quantized base holds in memory)."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def to(self, device: torch.device | str) -> QuantizedTensor:
        return QuantizedTensor(self.format, {k: v.to(device) for k, v in self.parts.items()}, self.shape, self.block)
