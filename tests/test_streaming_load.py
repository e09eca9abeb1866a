"""Streaming sharded loads (worker/sharding/streaming.py): each rank of a group reads only its own shards.

Real CPU process groups (gloo, started by torch.multiprocessing.spawn; tests/streaming_ranks.py): the streamed shards
are bitwise those of the whole model loaded by ``from_pretrained`` (or our dequantizer) and then sharded, for every
family and every published checkpoint layout, and they train alike; a 4-rank group's peak host memory per rank is its
shard plus what the planner allows for the load, far from the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from tests import streaming_ranks
from tinkerq.launcher.processes import free_port
from tinkerq.recipes.families import FAMILIES, TEXT_OF_VISION_LANGUAGE, build_family
from tinkerq.recipes.published import LAYOUTS, build_published
from tinkerq.worker.checkpoints.reader import ModelLoadError
from tinkerq.worker.loading import support
from tinkerq.worker.loading.models import load_skeleton
from tinkerq.worker.memory.estimates import ModelShape, streamed_load_bytes

pytestmark = pytest.mark.timeout(600)


def _spawn(fn, world: int, *args) -> list[dict]:
    out = args[-1]
    torch.multiprocessing.spawn(fn, args=(world, free_port(), *args), nprocs=world)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


# The families a shard group serves (worker/loading/support.py refuses the others when the shards are filled).
# kimi_k25's and inkling2's checkpoints are vision-language ones: a shard group refuses them when the ranks build the
# model (below).
SHARDED = [f for f in FAMILIES if support.refusal(FAMILIES[f][0], "shard_group") is None
           and f not in TEXT_OF_VISION_LANGUAGE]


def test_streamed_shards_are_the_whole_models_and_train_alike(tmp_path):
    models = [build_family(f, tmp_path / f, seed=3) for f in SHARDED]
    models += [build_published(name, tmp_path / name, seed=5) for name in LAYOUTS]
    ranks = _spawn(streaming_ranks.compare, 2, [str(m) for m in models], str(tmp_path))
    for rank, found in enumerate(ranks):
        assert set(found) == {str(m) for m in models}
        for path, f in found.items():
            name = Path(path).name
            assert f["names"], (rank, name)
            assert f["differ"] == [], (rank, name, f["differ"][:5])
            assert f["same_logprobs"], (rank, name)
            assert f["grads"] > 0, (rank, name)
            assert f["local_elements"] < f["elements"], (rank, name)  # a shard, not the whole model
    for path in ranks[0]:  # the two ranks' shards together are the whole model: no row read twice or skipped
        assert ranks[0][path]["local_elements"] + ranks[1][path]["local_elements"] == ranks[0][path]["elements"]


def test_a_class_whose_streamed_load_is_not_proven_is_refused_before_any_weight_is_read(tmp_path):
    from tinkerq.worker.sharding.streaming import fill_shards

    assert [f for f in FAMILIES if f not in SHARDED] == ["inkling2", "deepseek_v4", "kimi_linear", "kimi_k25"]
    with pytest.raises(ModelLoadError, match=r"Kimi_K25Config is a vision-language checkpoint whose text model a "
                                             r"shard group cannot stream .+; serve it on a single worker"):
        load_skeleton(str(build_family("kimi_k25", tmp_path / "kimi_k25")))
    path = str(build_family("kimi_linear", tmp_path / "kimi_linear"))
    skeleton = load_skeleton(path)
    with pytest.raises(ModelLoadError, match=r"a shard group of KimiLinearForCausalLM is not served: .+; serve it on "
                                             r"a single worker \(without --shards\)"):
        fill_shards(skeleton, skeleton, skeleton, path, device="cpu", dtype=torch.float32)
    assert all(p.device.type == "meta" for p in skeleton.parameters())  # nothing allocated, nothing read


# Models of ~400 MiB in float32 whose largest weight is the output projection (Llama) or one layer's fused experts
# (Qwen3-MoE: the loader stacks 16 experts' tensors, then concatenates gate and up).
BIG = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=512)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=4000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_experts=16,
        num_experts_per_tok=2, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=512)),
}


@pytest.mark.parametrize("family", list(BIG))
def test_a_rank_holds_its_shard_plus_the_planned_load_never_the_whole_model(family, tmp_path):
    torch.manual_seed(0)
    BIG[family]().save_pretrained(tmp_path / "model")
    shape = ModelShape.of(load_skeleton(str(tmp_path / "model")))
    world = 4
    ranks = _spawn(streaming_ranks.peak, world, str(tmp_path / "model"), str(tmp_path))
    planned = shape.param_bytes // world + streamed_load_bytes(shape)
    for rank, r in enumerate(ranks):
        print(f"{family} rank {rank}: peak growth {r['peak_growth'] / 2**20:.1f} MiB, shard "
              f"{r['local_bytes'] / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB (largest weight "
              f"{shape.largest_weight_bytes / 2**20:.1f} MiB), whole model {shape.param_bytes / 2**20:.1f} MiB")
        assert r["local_bytes"] == pytest.approx(shape.param_bytes / world, rel=0.02)
        assert r["local_bytes"] <= r["peak_growth"] <= planned, rank
        assert r["peak_growth"] < 0.5 * shape.param_bytes, rank


def test_a_weight_missing_from_the_files_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = build_family("llama", tmp_path / "llama")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    torch.multiprocessing.spawn(streaming_ranks.load_error, args=(1, free_port(), str(directory), str(tmp_path)),
                                nprocs=1)
    message = json.loads((tmp_path / "rank0.json").read_text())["error"]
    assert "model.layers.1.mlp.down_proj.weight" in message and "not in its files" in message, message
    assert ModelLoadError.__name__ in json.loads((tmp_path / "rank0.json").read_text())["type"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_range_of_rows_is_read_and_dequantized_alone_and_bitwise(layout, tmp_path, monkeypatch):
    """What transformers' shard-on-read asks of the reader: rows [a, b) of a weight (the others whole). Only those
    rows are read and dequantized (block FP8: the tiles they fall in), and they are the whole weight's rows."""
    from tinkerq.worker.checkpoints.reader import LazyTensors, open_checkpoint

    lazy = LazyTensors(open_checkpoint(build_published(layout, tmp_path / layout, seed=5)), torch.float32)
    names = [n for n in lazy.entries if len(lazy.shape(n)) >= 2]
    whole = {n: lazy.value(n) for n in names}
    assert any(n in lazy.checkpoint.quantized for n in names) == (layout != "qwen3_moe-bf16" and
                                                                  layout != "llama-bf16-tied")
    monkeypatch.setattr(LazyTensors, "value", lambda self, name: pytest.fail(f"{name} was read whole"))
    checked = 0
    for name in names:
        shape = lazy.shape(name)
        for a, b in ((0, shape[0]), (1, max(1, shape[0] // 2)), (shape[0] // 3, shape[0] - 1)):
            index = (slice(a, b), *(slice(0, n) for n in shape[1:]))
            assert torch.equal(lazy.entries[name][index], whole[name][a:b]), (name, a, b)
            checked += 1
    assert checked >= 3 * len(names) > 0
