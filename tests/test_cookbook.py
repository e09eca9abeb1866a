"""tinker-cookbook's own training loops, unmodified, against a real `tinkerq gateway`, worker and Redis.

The cookbook lives in its own venvs, made by ./scripts/cookbook-venv (./scripts/test runs it), because it pins
other transformers/huggingface_hub versions than the project. Each test runs once per cookbook version:
  0.5.8         .venv-cookbook, a normal install.
  0.6.1-nodeps  .venv-cookbook-061: 0.5.8's dependencies + the 0.6.1 wheel installed with --no-deps, since
                0.6.1 requires tml-renderers>=0.4.1 and the registry has at most 0.2.1 (role_colon, the
                renderer used here, does not use tml_renderers; see scripts/cookbook-venv).
tests/cookbook_driver.py runs ``tinker_cookbook.supervised.train.main`` and ``tinker_cookbook.rl.train.main``
there, as a subprocess. One gateway and worker serve both versions.

The worker serves a tiny Llama under a cookbook registry name (``meta-llama/Llama-3.2-3B``: renderer
``role_colon``; the cookbook loads its tokenizer from the hub repo it maps every meta-llama/Llama-3* to). The
tokenizer is a 261-token byte-level one (ids 0-255 are the bytes, 256-260 Llama-3's special tokens), saved with
the model (the worker decodes the renderer's stop string with it) and put in a fake, offline HF cache for the
cookbook. test_gateway.py serves another model as meta-llama/Llama-3.2-1B, hence the other name here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.conftest import start_named_worker
from tests.test_gateway import start_gateway
from tinkerq.connection import Connection
from tinkerq.settings import Settings
from tinkerq.tenants import ApiKeys

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parent.parent
# test id -> (venv, the tinker-cookbook version the driver checks it holds)
VENVS = {"0.5.8": (".venv-cookbook", "0.5.8"), "0.6.1-nodeps": (".venv-cookbook-061", "0.6.1")}
NAME = "meta-llama/Llama-3.2-3B"
TOKENIZER_REPO = "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer"  # get_tokenizer's meta-llama/Llama-3* map
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
VOCAB = 256 + len(SPECIALS)
DRIVER_TIMEOUT_S = 240


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build_byte_llama(out_dir: Path, seed: int = 0) -> Path:
    """A tiny random Llama with vocab 261 and its byte-level tokenizer (BPE without merges: id == byte)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in _bytes_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    # role_colon prepends encode(bos_token) and strips a trailing eos_token_id.
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[4],
                            pad_token=SPECIALS[1]).save_pretrained(out_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=256, eos_token_id=260, pad_token_id=257)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def fake_hub_cache(model_dir: Path, hf_home: Path) -> None:
    """$HF_HOME/hub/models--org--name/{refs/main, snapshots/<rev>/...}: what an offline hub lookup reads.
    transformers needs config.json there too (AutoTokenizer loads the config first)."""
    repo = hf_home / "hub" / ("models--" + TOKENIZER_REPO.replace("/", "--"))
    rev = "0" * 40
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        if (model_dir / name).exists():
            (snapshot / name).write_bytes((model_dir / name).read_bytes())


@pytest.fixture(params=list(VENVS), ids=list(VENVS))
def cookbook_venv(request, cookbook_venvs) -> tuple[str, Path, str]:
    """(test id, the venv's python, the tinker-cookbook version it must hold). Fails if the venv is missing."""
    venv, version = VENVS[request.param]
    python = ROOT / venv / "bin" / "python"
    if not python.exists():
        pytest.fail(f"tinker-cookbook {version}'s venv {venv} is missing: run ./scripts/cookbook-venv "
                    "(./scripts/test does)")
    return request.param, python, version


@pytest.fixture(scope="module")
def cookbook(redis_url: str, checkpoint_dir: Path, tmp_path_factory, cookbook_venvs) -> Iterator[dict]:
    work = tmp_path_factory.mktemp("cookbook")
    model_dir = build_byte_llama(work / "byte-llama")
    fake_hub_cache(model_dir, work / "hf_home")
    conn = Connection.open(Settings(broker_url=redis_url))
    try:
        assert not conn.workers_serving(NAME), f"another worker already serves {NAME}"
    finally:
        conn.close()
    worker = start_named_worker(model_dir, redis_url, NAME, work / "worker.log",
                                env={"TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir)})
    gateway, url = start_gateway(redis_url, work / "gateway.log")
    keys = ApiKeys.open(Settings(broker_url=redis_url))
    key = keys.create(f"cookbook-{uuid.uuid4().hex[:6]}")
    keys.close()
    yield {"url": url, "key": key, "work": work}
    for proc in (gateway, worker):
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_driver(cookbook: dict, venv: tuple[str, Path, str], mode: str) -> Path:
    test_id, python, version = venv
    log_dir = cookbook["work"] / f"{test_id}-{mode}"
    what = f"cookbook {test_id} {mode}"
    env = {**os.environ, "TINKER_API_KEY": cookbook["key"], "HF_HOME": str(cookbook["work"] / "hf_home"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)  # keep the project's packages out of the cookbook's interpreter
    started = time.monotonic()
    try:
        done = subprocess.run([str(python), str(ROOT / "tests" / "cookbook_driver.py"), "--base-url", cookbook["url"],
                               "--log-dir", str(log_dir), "--mode", mode, "--model-name", NAME,
                               "--expect-version", version],
                              env=env, cwd=cookbook["work"], capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what} ran past {DRIVER_TIMEOUT_S} s\n{_tail(e.stdout)}\n{_tail(e.stderr)}"
                    f"\n--- gateway.log ---\n{_tail((cookbook['work'] / 'gateway.log').read_text())}")
    print(f"{what}: {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, (f"{what} failed (rc {done.returncode})\n{_tail(done.stdout)}\n"
                                  f"{_tail(done.stderr)}\n--- gateway.log ---\n"
                                  f"{_tail((cookbook['work'] / 'gateway.log').read_text())}")
    return log_dir


def _tail(text: str | bytes | None, n: int = 6000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def check_checkpoints(cookbook: dict, log_dir: Path, names: list[str]) -> None:
    """checkpoints.jsonl names tinker:// paths that the gateway lists for the training run, with the key."""
    rows = jsonl(log_dir / "checkpoints.jsonl")
    assert [r["name"] for r in rows] == names
    paths = [r[kind] for r in rows for kind in ("state_path", "sampler_path")]
    assert all(p.startswith("tinker://") for p in paths), paths
    run_ids = {p.removeprefix("tinker://").split("/")[0] for p in paths}
    assert len(run_ids) == 1, run_ids
    (run_id,) = run_ids
    r = requests.get(f"{cookbook['url']}/api/v1/training_runs/{run_id}/checkpoints",
                     headers={"X-API-Key": cookbook["key"]}, timeout=30)
    assert r.ok, r.text
    listed = {c["tinker_path"] for c in r.json()["checkpoints"]}
    assert set(paths) <= listed, (paths, listed)
    run = requests.get(f"{cookbook['url']}/api/v1/training_runs/{run_id}", headers={"X-API-Key": cookbook["key"]},
                       timeout=30).json()
    assert run["base_model"] == NAME and run["is_lora"] and run["lora_rank"] == 4


def test_cookbook_supervised_training_loop(cookbook, cookbook_venv):
    log_dir = run_driver(cookbook, cookbook_venv, "sl")
    metrics = jsonl(log_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert finite(m["train_mean_nll"]) and m["train_mean_nll"] > 0, m
        assert finite(m["grad_norm:mean"]) and m["grad_norm:mean"] > 0, m
        assert m["num_sequences"] == 2 and m["num_loss_tokens"] > 0, m
    # The evaluator's NLL on the 2 held-out conversations, from compute_logprobs on a sampling session.
    evals = [m["test/nll"] for m in metrics if "test/nll" in m]
    assert len(evals) == 2 and all(finite(v) and v > 0 for v in evals), metrics
    # An untrained 261-token model is near uniform; a few LoRA steps cannot make it worse than that by far.
    assert metrics[0]["train_mean_nll"] < 2 * math.log(256)
    check_checkpoints(cookbook, log_dir, ["000002", "final"])


def test_cookbook_rl_training_loop(cookbook, cookbook_venv):
    log_dir = run_driver(cookbook, cookbook_venv, "rl")
    rows = jsonl(log_dir / "metrics.jsonl")
    metrics = [m for m in rows if "env/all/total_episodes" in m]  # one row per training step
    assert [m["step"] for m in metrics] == [0, 1], rows
    totals = [m for m in rows if m not in metrics]
    if cookbook_venv[2] == "0.5.8":
        assert totals == [], rows
    else:  # 0.6.1 logs its token totals as one more row after the last step
        assert [m["step"] for m in totals] == [2], rows
        assert 0 < totals[0]["tokens/cumulative/sampled"] <= 2 * 4 * 8 and totals[0]["tokens/cumulative/trained"] > 0
    for m in metrics:
        # 2 groups x 2 samples of at most max_tokens=8, each rewarded by the arithmetic environment.
        assert m["env/all/total_episodes"] == 4, m
        assert finite(m["env/all/reward/total"]), m
        assert 0 < m["env/all/ac_tokens_per_turn"] <= 8, m
        assert finite(m["optim/entropy"]) and m["optim/entropy"] > 0, m
        # The sampler's logprobs (from /asample) and the trainer's (from forward_backward) for the same tokens
        # and weights: the cookbook's KL estimate between them is ~0 when the two agree.
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m
    check_checkpoints(cookbook, log_dir, ["000001", "000002", "final"])
