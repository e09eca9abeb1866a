"""Checkpoints in the layouts model makers publish (recipes/published.py) load with ``load_causal_lm``: every weight
equals a reference dequantization written here from each format's definition, the logits equal plain transformers
on the equivalent float checkpoint, and each kind of bad checkpoint is one clear ModelLoadError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinkerq.recipes.published import LAYOUTS, build_published
from tinkerq.worker.checkpoints.reader import read_quantized_tensors
from tinkerq.worker.loading.models import ModelLoadError, load_causal_lm

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published")
    return {name: build_published(name, root / name, seed=5) for name in LAYOUTS}


# -- reference dequantization, from the formats' definitions (not worker/checkpoints/quant_formats.py)
# -------------------------

def ref_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """W[r, c] = fp8[r, c] * scale_inv[r // br, c // bc], element by element (a partial last tile is just
    the tile the index falls in)."""
    rows, cols = weight.shape
    r_tile = torch.arange(rows) // block[0]
    c_tile = torch.arange(cols) // block[1]
    return weight.float() * scale_inv.float()[r_tile][:, c_tile]


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Each byte two E2M1 codes (low nibble = even element), sign bit 3; block value * 2 ** (scale - 127)."""
    def e2m1(code: torch.Tensor) -> torch.Tensor:
        magnitude = torch.tensor(E2M1)[(code & 7).long()]
        return torch.where(code >= 8, -magnitude, magnitude)

    low, high = e2m1(blocks & 0x0F), e2m1(blocks >> 4)
    values = torch.stack((low, high), dim=-1).reshape(*blocks.shape[:-1], 32)  # (..., G, 32)
    factor = torch.pow(2.0, scales.double() - 127).float().unsqueeze(-1)
    return (values * factor).reshape(*blocks.shape[:-2], -1)


def ref_int4(packed: torch.Tensor, scale: torch.Tensor, shape: list[int], group: int) -> torch.Tensor:
    """Element c of a row is the 4-bit field c % 8 of int32 word c // 8 (little end first), stored as q + 8;
    W = q * scale[r, c // group]."""
    rows, cols = shape
    words = packed.to(torch.int64) & 0xFFFFFFFF  # the word's bits, unsigned
    out = torch.empty(rows, cols)
    for c in range(cols):
        q = ((words[:, c // 8] >> (4 * (c % 8))) & 0xF) - 8
        out[:, c] = q.float() * scale[:, c // group].float()
    return out


def reference_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor dequantized by the reference functions, under the names an unquantized checkpoint of
    the same model has (gpt-oss experts as transformers' (E, in, out) parameters); float32."""
    config = json.loads((directory / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    stored: dict[str, torch.Tensor] = {}
    for file in directory.glob("*.safetensors"):
        stored.update(load_file(str(file)))
    out = {}
    for name, t in stored.items():
        if name.endswith(("_scale_inv", "_scales", ".weight_scale", ".weight_shape")):
            continue
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            out[base] = ref_mxfp4(t, stored[base + "_scales"]).transpose(-1, -2)
        elif name.endswith(".weight_packed"):
            base = name.removesuffix("_packed")
            group = quant["config_groups"]["group_0"]["weights"]["group_size"]
            out[base] = ref_int4(t, stored[base + "_scale"], stored[base + "_shape"].tolist(), group)
        elif name + "_scale_inv" in stored:
            out[name] = ref_fp8(t, stored[name + "_scale_inv"], quant["weight_block_size"])
        else:
            out[name] = t.float()
    return out


def float_checkpoint(directory: Path, out: Path) -> Path:
    """The equivalent float checkpoint: the reference tensors (the MTP layer left out), config.json without its
    quantization_config, in one model.safetensors."""
    config = json.loads((directory / "config.json").read_text())
    config.pop("quantization_config", None)
    layers = config["num_hidden_layers"]
    tensors = {k: v.contiguous() for k, v in reference_tensors(directory).items()
               if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= layers)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    return out


# -- every layout ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_weight_is_the_reference_dequantization(built, layout):
    from transformers.core_model_loading import revert_weight_conversion

    model = load_causal_lm(str(built[layout]))
    ours = revert_weight_conversion(model, model.state_dict())  # back to the checkpoint's (per-expert) names
    reference = reference_tensors(built[layout])
    layers = model.config.num_hidden_layers
    compared = 0
    for name, want in reference.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            assert name not in ours  # the MTP layer: left out on purpose
            continue
        assert name in ours, name
        torch.testing.assert_close(ours[name], want, rtol=0, atol=0, msg=name)
        compared += 1
    assert compared >= len(ours) - 1  # everything the model has (a tied head is the embeddings)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_equal_plain_transformers_on_the_float_model(built, layout, tmp_path):
    from transformers import AutoModelForCausalLM

    model = load_causal_lm(str(built[layout]))
    plain = AutoModelForCausalLM.from_pretrained(float_checkpoint(built[layout], tmp_path / "float"),
                                                 dtype=torch.float32).eval()
    assert type(plain) is type(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=1e-5)


def test_layouts_are_the_makers(built):
    index = json.loads((built["qwen3_moe-bf16"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(index.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert index["model.layers.1.mlp.experts.7.gate_proj.weight"]
    assert len({index[k] for k in index if k.startswith("model.layers.0.")}
               | {index[k] for k in index if k.startswith("model.layers.1.")}) == 2
    tied = load_file(str(built["llama-bf16-tied"] / "model.safetensors"))
    assert "lm_head.weight" not in tied and tied["model.embed_tokens.weight"].dtype == torch.bfloat16
    gpt = reference_shapes(built["gpt_oss-mxfp4"])
    assert gpt["model.layers.0.mlp.experts.gate_up_proj_blocks"] == ((8, 64, 2, 16), torch.uint8)  # (E, 2I, H/32, 16)
    assert gpt["model.layers.0.mlp.experts.down_proj_scales"] == ((8, 64, 1), torch.uint8)  # (E, H, I/32)
    kimi = reference_shapes(built["kimi_k2-int4"])
    assert kimi["model.layers.1.mlp.experts.3.down_proj.weight_packed"] == ((64, 4), torch.int32)
    assert kimi["model.layers.1.mlp.experts.3.down_proj.weight_scale"] == ((64, 1), torch.bfloat16)
    assert kimi["model.layers.1.self_attn.kv_b_proj.weight"][1] == torch.bfloat16  # attention not quantized
    ds = reference_shapes(built["deepseek_v3-fp8"])
    assert ds["model.layers.1.mlp.gate.weight"][1] == torch.bfloat16
    assert ds["model.layers.1.mlp.gate.e_score_correction_bias"][1] == torch.float32
    for mtp in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.head.weight", "self_attn.o_proj.weight"):
        assert f"model.layers.2.{mtp}" in ds  # num_hidden_layers 2: the MTP layer is index 2
    quantized = [k for k in ds if k.endswith("_scale_inv")]
    assert {k.removesuffix("_scale_inv") for k in quantized} == {
        k for k, (shape, dtype) in ds.items() if dtype == torch.float8_e4m3fn}
    assert any(".mlp.experts.0.down_proj" in k for k in quantized) and any("shared_experts" in k for k in quantized)


def reference_shapes(directory: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for file in directory.glob("*.safetensors"):
        out.update({k: (tuple(v.shape), v.dtype) for k, v in load_file(str(file)).items()})
    return out


def test_fp8_partial_tiles_at_deepseek_geometry(built):
    """kv_a_proj_with_mqa (576, 200): a (5, 2) grid, its last row tile 64 rows and its last column tile 72 columns;
    the tiles' scales land exactly there (inferring the tile from the grid, 576 // 5, would not)."""
    directory = built["deepseek_v3-fp8"]
    stored = reference_shapes(directory)
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert stored[name] == ((576, 200), torch.float8_e4m3fn) and stored[name + "_scale_inv"][0] == (5, 2)
    assert stored["model.layers.0.mlp.down_proj.weight"][0] == (200, 136)  # partial on both axes
    tensors = {}
    for file in directory.glob("*.safetensors"):
        tensors.update(load_file(str(file)))
    weight, scale = tensors[name], tensors[name + "_scale_inv"]
    model = load_causal_lm(str(directory))
    got = model.model.layers[1].self_attn.kv_a_proj_with_mqa.weight.detach()
    corner = weight[512:, 128:].float() * scale[4, 1]  # the partial corner tile, one scale
    torch.testing.assert_close(got[512:, 128:], corner, rtol=0, atol=0)
    torch.testing.assert_close(got[:128, :128], weight[:128, :128].float() * scale[0, 0], rtol=0, atol=0)
    inferred = 576 // 5  # the tile height transformers 5.24 infers from the grid: rows 460.. would take scale row 4
    rows = slice(4 * inferred, 4 * inferred + 4)
    assert not torch.equal(got[rows, :128], weight[rows, :128].float() * scale[4, 0])


def test_int4_reference_agrees_with_compressed_tensors(built):
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    quant_config = pytest.importorskip("compressed_tensors.quantization").QuantizationConfig
    directory = built["kimi_k2-int4"]
    config = json.loads((directory / "config.json").read_text())
    parsed = quant_config.model_validate(config["quantization_config"])  # the library accepts the maker's config
    assert parsed.format == "pack-quantized" and parsed.config_groups["group_0"].weights.group_size == 32
    quantized = read_quantized_tensors(directory)
    assert len(quantized) == 24  # 8 experts x 3 projections, layer 1
    for name, q in quantized.items():
        shape = q.shape
        unpacked = ct.unpack_from_int32(q.parts["packed"], 4, torch.Size(shape)).float()  # (R, C) in [-8, 7]
        theirs = unpacked * q.parts["scale"].float().repeat_interleave(32, dim=1)[:, :shape[1]]
        ours = ref_int4(q.parts["packed"], q.parts["scale"], list(shape), 32)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)
        assert name.endswith(".weight") and ".mlp.experts." in name


def test_read_quantized_tensors_keys(built):
    fp8 = read_quantized_tensors(built["deepseek_v3-fp8"])
    kv = fp8["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert (kv.format, kv.shape, kv.block) == ("fp8_block", (576, 200), (128, 128))
    mx = read_quantized_tensors(built["gpt_oss-mxfp4"])
    assert sorted(mx) == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")]
    assert mx["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)  # (E, 2I, H), stored rows
    assert read_quantized_tensors(built["qwen3_moe-bf16"]) == {}


# -- bad checkpoints: one clear error each -----------------------------------------------------------------------

def _copy(built: dict[str, Path], layout: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(built[layout], tmp_path / layout))


def _edit_tensor(directory: Path, name: str, change) -> None:
    index = directory / "model.safetensors.index.json"
    file = (directory / json.loads(index.read_text())["weight_map"][name]) if index.exists() \
        else directory / "model.safetensors"
    tensors = load_file(str(file))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(directory: Path, change) -> None:
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))


def _fails(directory: Path, *expected: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_causal_lm(str(directory))
    message = str(info.value)
    assert "\n" not in message and str(directory) in message, message
    for text in expected:
        assert text in message, message
    return message


def test_missing_shard(built, tmp_path):
    directory = _copy(built, "qwen3_moe-bf16", tmp_path)
    (directory / "model-00002-of-00002.safetensors").unlink()
    _fails(directory, "names 1 file(s) that are not there (model-00002-of-00002.safetensors)", "download")


def test_wrong_dtype(built, tmp_path):
    directory = _copy(built, "llama-bf16-tied", tmp_path)
    _edit_tensor(directory, "model.norm.weight", lambda t: t.to(torch.int32))
    _fails(directory, "model.norm.weight is stored as I32", "a weight is a float")


def test_wrong_shape(built, tmp_path):
    directory = _copy(built, "qwen3_moe-bf16", tmp_path)
    _edit_tensor(directory, "model.layers.0.self_attn.q_proj.weight", lambda t: t[:-1])
    _fails(directory, "model.layers.0.self_attn.q_proj.weight has shape (31, 32) where config.json makes it (32, 32)")


def test_wrong_shape_of_a_quantized_weight(built, tmp_path):
    directory = _copy(built, "deepseek_v3-fp8", tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    _edit_tensor(directory, name, lambda t: t[:, :16].contiguous())
    _edit_tensor(directory, name + "_scale_inv", lambda t: t[:, :1].contiguous())
    _fails(directory, f"{name} has shape (200, 16) where config.json makes it (200, 32)")


def test_scale_grid_that_does_not_fit_its_weight(built, tmp_path):
    directory = _copy(built, "deepseek_v3-fp8", tmp_path)
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    _edit_tensor(directory, name, lambda t: t[:4].contiguous())  # 576 // 128 rows: floor-divided
    _fails(directory, "kv_a_proj_with_mqa.weight: weight (576, 200) in weight_block_size [128, 128] tiles "
                      "(ceil-divided) needs a weight_scale_inv grid (5, 2), got (4, 2)")
    mx = _copy(built, "gpt_oss-mxfp4", tmp_path)
    _edit_tensor(mx, "model.layers.0.mlp.experts.down_proj_scales", lambda t: t[:, :-1].contiguous())
    _fails(mx, "MXFP4 blocks (..., G, 16) need scales (..., G)")
    int4 = _copy(built, "kimi_k2-int4", tmp_path)
    _edit_tensor(int4, "model.layers.1.mlp.experts.0.up_proj.weight_scale", lambda t: t[:-1].contiguous())
    _fails(int4, "model.layers.1.mlp.experts.0.up_proj.weight: weight_shape (32, 64) in groups of 32 needs")


def test_unknown_quant_method(built, tmp_path):
    directory = _copy(built, "gpt_oss-mxfp4", tmp_path)
    _edit_config(directory, lambda c: c["quantization_config"].update(quant_method="awq"))
    _fails(directory, "quant_method 'awq' is not one tinkerq reads", "dequantize the checkpoint to bf16")
    ct = _copy(built, "kimi_k2-int4", tmp_path / "ct")
    _edit_config(ct, lambda c: c["quantization_config"].update(format="float-quantized"))
    _fails(ct, "compressed-tensors format 'float-quantized'")


def test_config_that_needs_remote_code(built, tmp_path):
    directory = _copy(built, "kimi_k2-int4", tmp_path)
    _edit_config(directory, lambda c: c.update(model_type="kimi_k2", auto_map={
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}))
    _fails(directory, "model_type 'kimi_k2' is not one the installed transformers knows and its auto_map names "
                      "remote code", "trust_remote_code")


def test_any_other_transformers_failure_is_wrapped(built, tmp_path, monkeypatch):
    import transformers

    def broken(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'shape'")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", broken)
    _fails(built["llama-bf16-tied"], "cannot load a causal LM from",
           "AttributeError: 'NoneType' object has no attribute 'shape'")


def test_fleet_up_with_a_bad_checkpoint_exits_2_with_the_message(built, tmp_path):
    from tests.test_fleet_cli import _up_fails
    from tinkerq.launcher.processes import free_port

    directory = _copy(built, "gpt_oss-mxfp4", tmp_path)
    _edit_config(directory, lambda c: c["quantization_config"].update(quant_method="awq"))
    line = _up_fails("--model", str(directory), "--fleet", "bad", "--redis-port", str(free_port()),
                     "--flower-port", "0", env={"TINKERQ_HOME": str(tmp_path / "home")})
    assert f"the worker for {directory} exited during start-up: " in line
    assert "quant_method 'awq' is not one tinkerq reads" in line


def test_families_build_layout_published_prints_each_directory(built, tmp_path, capsys):
    from tinkerq.launcher.main import main

    assert main(["families", "build", str(tmp_path), "--layout", "published", "--seed", "5"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / name) for name in LAYOUTS]
    for name in LAYOUTS:  # the seed reached the weights: the same tensors as the fixture's build with seed 5
        ours, theirs = reference_shapes(tmp_path / name), reference_shapes(built[name])
        assert ours == theirs, name
    theirs = read_quantized_tensors(built["deepseek_v3-fp8"])
    for key, q in read_quantized_tensors(tmp_path / "deepseek_v3-fp8").items():
        torch.testing.assert_close(q.dequantize(), theirs[key].dequantize(), rtol=0, atol=0, msg=key)


def test_wrong_shape_of_an_int4_expert(built, tmp_path):
    directory = _copy(built, "kimi_k2-int4", tmp_path)
    base = "model.layers.1.mlp.experts.2.gate_proj.weight"
    _edit_tensor(directory, base + "_packed", lambda t: t[:-1].contiguous())  # 31 rows, consistently
    _edit_tensor(directory, base + "_scale", lambda t: t[:-1].contiguous())
    _edit_tensor(directory, base + "_shape", lambda t: torch.tensor([31, 64]))
    _fails(directory, f"{base} has shape (31, 64) where config.json makes it (32, 64)")


def test_an_auto_map_beside_a_known_model_type_loads_transformers_own_class(built, tmp_path):
    """The real DeepSeek-V3 config.json names remote code (auto_map) and model_type deepseek_v3: no code is run."""
    directory = _copy(built, "deepseek_v3-fp8", tmp_path)
    remote = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
              "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    _edit_config(directory, lambda c: c.update(auto_map=remote))
    assert type(load_causal_lm(str(directory))).__module__.startswith("transformers.models.deepseek_v3")


@pytest.mark.parametrize("layout", ["gpt_oss-mxfp4", "deepseek_v3-fp8", "kimi_k2-int4"])
def test_served_in_bfloat16_the_weights_are_the_reference_rounded_once(built, layout):
    from transformers.core_model_loading import revert_weight_conversion

    model = load_causal_lm(str(built[layout]), dtype="bfloat16")
    ours = revert_weight_conversion(model, model.state_dict())
    quantized = read_quantized_tensors(built[layout])
    for name, want in reference_tensors(built[layout]).items():
        if name not in ours:
            continue
        if name in quantized:
            assert ours[name].dtype == torch.bfloat16, name
        # Rounded to bf16 once; the float32 correction bias is kept as stored. transformers keeps DeepSeek's router
        # in float32 (its bf16 values, then).
        rounded = want if name.endswith("e_score_correction_bias") else want.to(torch.bfloat16)
        torch.testing.assert_close(ours[name], rounded.to(ours[name].dtype), rtol=0, atol=0, msg=name)
