"""The served dtype (worker/loading/dtypes.py): ``auto`` resolved against the checkpoint and the device, the same way
by the
worker and the planner; a worker serving bfloat16 answers as plain transformers does in bfloat16; ``fleet up
--dtype`` reaches every worker process it starts."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.helpers import VOCAB, make_batch, reference_logprobs
from tinkerq.settings import Settings, SettingsError
from tinkerq.worker.loading.dtypes import checkpoint_dtype, resolve_dtype

pytestmark = pytest.mark.timeout(120)

BF16_CONFIG = {"model_type": "llama", "torch_dtype": "bfloat16"}
FP8_CONFIG = {"model_type": "deepseek_v3", "torch_dtype": "bfloat16",
              "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
MXFP4_CONFIG = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}  # names no dtype

# The worker and plain transformers run the same bfloat16 weights, but the worker pads datums of different lengths
# into one batch and computes the unembedding in chunks: its bfloat16 matmuls accumulate in another order, so a
# rounding may go the other way. bfloat16 keeps 8 significant bits: a logit in [4, 8) is rounded to 2^-5 = 0.031,
# and one flipped rounding of the largest logits moves a logprob by about that. Measured over 8 batches of 5 datums
# (seeds 0-7): per token at most 0.043 (1.4 such steps) and 0.0021 on average (most tokens agree exactly); the
# forward's loss within 2.6e-4 relative. Bounds: 2 rounding steps of the largest logit per token, 0.005 on average,
# 1e-3 of a loss. The same worker is 0.018-0.023 per token on average from the float32 answer (9x and more): the
# test asserts that gap too, so a worker computing in float32 could not pass.
LOGPROB_ROUNDINGS = 2
MEAN_ATOL = 0.005
LOSS_RTOL = 1e-3


# -- resolution ---------------------------------------------------------------------------------------------------


def test_auto_is_the_checkpoints_dtype_on_a_gpu_with_bf16():
    assert resolve_dtype("auto", BF16_CONFIG, "cuda", bf16_supported=True) == "bfloat16"
    assert resolve_dtype("auto", {"dtype": "bfloat16"}, "cuda:1", bf16_supported=True) == "bfloat16"  # transformers 5
    assert resolve_dtype("auto", {"torch_dtype": "float16"}, "cuda", bf16_supported=True) == "float16"
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, "cuda", bf16_supported=True) == "float32"
    assert resolve_dtype("auto", {}, "cuda", bf16_supported=True) == "float32"  # names none: from_pretrained's default
    assert resolve_dtype("auto", {"text_config": {"dtype": "bfloat16"}}, "cuda", bf16_supported=True) == "bfloat16"


def test_auto_serves_a_quantized_checkpoint_in_bf16_on_a_gpu():
    assert checkpoint_dtype(FP8_CONFIG) == checkpoint_dtype(MXFP4_CONFIG) == "bfloat16"
    assert resolve_dtype("auto", FP8_CONFIG, "cuda", bf16_supported=True) == "bfloat16"
    assert resolve_dtype("auto", MXFP4_CONFIG, "cuda", bf16_supported=True) == "bfloat16"


def test_auto_is_float32_on_the_cpu_and_on_a_gpu_without_bf16():
    for config in (BF16_CONFIG, FP8_CONFIG, {"torch_dtype": "float16"}):
        assert resolve_dtype("auto", config, "cpu") == "float32"
    assert resolve_dtype("auto", BF16_CONFIG, "cuda", bf16_supported=False) == "float32"
    # This machine's own answer: without a CUDA device that has bf16, auto never picks it.
    if not torch.cuda.is_available():
        assert resolve_dtype("auto", BF16_CONFIG, "cuda") == "float32"


def test_an_explicit_dtype_wins_everywhere():
    for dtype in ("float32", "bfloat16", "float16"):
        for device, bf16 in (("cpu", None), ("cuda", True), ("cuda", False)):
            assert resolve_dtype(dtype, FP8_CONFIG, device, bf16_supported=bf16) == dtype
    with pytest.raises(ValueError, match="auto, float32"):
        resolve_dtype("float64", BF16_CONFIG, "cpu")


def test_settings_default_to_auto_and_refuse_other_names():
    assert Settings().dtype == "auto"
    assert Settings.from_env({"TINKERQ_DTYPE": "bfloat16"}).dtype == "bfloat16"
    with pytest.raises(SettingsError, match="auto, float32, bfloat16 or float16"):
        Settings.from_env({"TINKERQ_DTYPE": "fp8"})


def test_the_planner_resolves_auto_as_the_worker_does_on_its_gpu(tmp_path):
    from tinkerq.worker.planning import planner

    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "torch_dtype": "float16", "vocab_size": 97, "hidden_size": 32, '
        '"intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}')
    assert planner.plan(str(tmp_path), devices=1, device_gb=1, headroom_gb=0).dtype == "float16"
    assert planner.plan("gpt-oss-20b", devices=8, device_gb=80).dtype == "bfloat16"  # MXFP4, names no dtype
    assert planner.plan("deepseek-v3.1", devices=8, device_gb=80, dtype="auto").dtype == "bfloat16"  # FP8
    assert planner.plan("qwen3-8b", devices=8, device_gb=80, dtype="float32").dtype == "float32"


# -- a request in bfloat16 ----------------------------------------------------------------------------------------


def build_bf16_llama(out_dir: Path) -> Path:
    """A tiny Llama saved in bfloat16, as published checkpoints are (its config.json says dtype bfloat16)."""
    torch.manual_seed(3)
    # initializer_range 0.2: logits spread like a trained model's (log-softmax std ~1.6 nats), so bfloat16 and
    # float32 answer visibly differently; at the default 0.02 they would be near-uniform and agree to 0.003.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bf16_llama(tmp_path_factory.mktemp("models") / "bf16-llama")


@contextlib.contextmanager
def embedded(model_dir: Path, dtype: str) -> Iterator:
    """An in-process worker (worker/core/embedded.py: the worker's own assembly) serving ``model_dir`` on the CPU."""
    from tinkerq.producer import ServiceClient
    from tinkerq.worker.core.embedded import EmbeddedFleet

    with EmbeddedFleet(str(model_dir), Settings(device="cpu", dtype=dtype)) as fleet, \
            ServiceClient(settings=fleet.settings) as sc:
        yield fleet, sc


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_auto_on_the_cpu_serves_a_bf16_checkpoint_in_float32_and_says_why(bf16_dir, caplog):
    from tinkerq.worker.loading.dtypes import served_dtype

    with caplog.at_level(logging.INFO, logger="tinkerq.worker"):
        assert served_dtype(str(bf16_dir), "auto", "cpu") == "float32"
    assert "dtype auto: float32 (checkpoint: bfloat16, device: cpu; --dtype bfloat16 serves it in bfloat16" in (
        caplog.text)
    assert served_dtype(str(bf16_dir), "bfloat16", "cpu") == "bfloat16"
    assert served_dtype(str(bf16_dir / "missing"), "auto", "cuda") == "float32"  # the loader then says what is wrong


def test_a_bf16_worker_answers_as_plain_transformers_in_bf16(bf16_dir):
    data = make_batch(np.random.default_rng(7), 5, min_len=4, max_len=40)
    ref16 = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16).eval()
    ref32 = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want16 = [reference_logprobs(ref16, d).numpy() for d in data]
        want32 = [reference_logprobs(ref32, d).numpy() for d in data]
        largest = max(float(ref16(input_ids=torch.tensor([d.model_input.to_ints()])).logits.abs().max()) for d in data)
    atol = LOGPROB_ROUNDINGS * 2.0 ** (math.floor(math.log2(largest)) - 7)  # bfloat16's step at the largest logit
    loss16 = sum(float(-(w * np.asarray(d.loss_fn_inputs["weights"].to_numpy())).sum()) for w, d in zip(
        want16, data, strict=True))

    with embedded(bf16_dir, "bfloat16") as (fleet, sc):
        model = fleet.worker.service.model
        # The parameters really are bfloat16: half the bytes of the same model in float32.
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert 2 * _param_bytes(model) == _param_bytes(ref32)
        (registration,) = fleet.worker.connection.workers_serving(fleet.base_model)
        assert registration["dtype"] == "bfloat16"

        tc = sc.create_training_client(fleet.base_model)
        assert tc.info.extra["dtype"] == "bfloat16"
        out = tc.forward(data, "cross_entropy").result(timeout=60)
        got = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
        fb = tc.forward_backward(data, "cross_entropy").result(timeout=60)
        tc.close()

    got_all, want16_all, want32_all = (np.concatenate(x) for x in (got, want16, want32))
    drift16 = float(np.abs(got_all - want16_all).mean())
    drift32 = float(np.abs(got_all - want32_all).mean())
    print(f"bf16 worker vs transformers, mean |logprob diff|: bf16 {drift16:.4f}, float32 {drift32:.4f}; max bf16 "
          f"{np.abs(got_all - want16_all).max():.4f} (bound {atol:.4f}); loss worker {fb.metrics['loss:sum']:.4f} "
          f"transformers bf16 {loss16:.4f}")
    for g, w in zip(got, want16, strict=True):
        np.testing.assert_allclose(g, w, atol=atol, rtol=0)
    assert drift16 < MEAN_ATOL
    assert drift32 > 3 * drift16  # the worker computed in bfloat16, not in float32
    assert fb.metrics["loss:sum"] == pytest.approx(loss16, rel=LOSS_RTOL)
    assert out.metrics["loss:sum"] == pytest.approx(loss16, rel=LOSS_RTOL)


# -- fleet up --dtype -----------------------------------------------------------------------------------------------


def test_fleet_up_passes_its_dtype_to_every_worker_process(tmp_path, monkeypatch):
    """Each worker rank and sampler `fleet up` starts gets --dtype, and its command line parses to it; without
    --dtype, none does (the workers read TINKERQ_DTYPE, default auto)."""
    from tinkerq.launcher import processes
    from tinkerq.launcher.fleet import start as fleet
    from tinkerq.launcher.main import build_parser

    started: list[list[str]] = []

    class Started:
        pid = 1

    def start_process(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Started:
        started.append(cmd)
        return Started()

    monkeypatch.setattr(processes, "start_process", start_process)
    parser = build_parser()
    for dtype in ("bfloat16", None):
        started.clear()
        argv = ["fleet", "up", "--model", str(tmp_path), "--served-name", "org/M", "--samplers", "1", "--shards", "2",
                *(["--dtype", dtype] if dtype else [])]
        args = parser.parse_args(argv)
        state = {"logs": str(tmp_path), "broker": "redis://127.0.0.1:1/0", "workers": []}
        fleet.start_workers(args, state, tmp_path, threads=1)
        assert len(started) == 3  # two ranks and a sampler
        for cmd in started:
            worker = parser.parse_args(cmd[3:])
            assert worker.dtype == dtype and worker.name == "org/M", cmd
