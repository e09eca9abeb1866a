"""tinkerq's adapter archive for every family, read by tinker-cookbook 0.6.1's own weight tools (the oracle anyone
can run): ``build_hf_model`` merges it into the base checkpoint and the merged model gives the session's logprobs;
``build_lora_adapter`` converts it wherever the cookbook supports the family (all but DeepSeek-V3), and for the
dense families PEFT loads the result with the session's logprobs. ``merged=True`` gives the same merged model
without the cookbook.

The cookbook runs in its own venv (scripts/cookbook-venv), through tests/cookbook_weights_driver.py. On a
tied-embedding family the archive's output-projection adapter would be merged by the cookbook into the shared
embedding (changing the input side too), so those sessions train with ``train_unembed=False``, as the cookbook's
own tests do.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import make_batch, reference_logprobs
from tinkerq import types
from tinkerq.recipes.families import FAMILIES, build_family
from tinkerq.worker.loading.models import load_causal_lm
from tinkerq.worker.lora.session import LoraBase, LoraSession
from tinkerq.worker.training.logprobs import LogprobComputer

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parent.parent
COOKBOOK_PYTHON = ROOT / ".venv-cookbook-061" / "bin" / "python"
NO_CONVERSION = {"deepseek_v3"}  # build_lora_adapter refuses it ("use build_hf_model")
PEFT_LOADABLE = {"llama", "qwen3", "mistral", "phi3", "olmo2", "gemma3"}  # every target a whole Linear
# Families whose transformers class the cookbook's venv lacks (tinker-cookbook pins transformers <= 5.5.4 through
# 0.5.8's dependencies: scripts/cookbook-venv): its build_hf_model cannot load their base model there, so their
# merge is checked by tinkerq's own merged=True export only (tests/test_families_fleet.py, test_moe_classes.py's
# merged reference). test_the_cookbooks_transformers_lacks_these_classes keeps the list true.
COOKBOOK_LACKS = {"inkling": "InklingForCausalLM", "inkling2": "Inkling2ForCausalLM",
                  "deepseek_v32": "DeepseekV32ForCausalLM", "deepseek_v4": "DeepseekV4ForCausalLM",
                  "kimi_linear": "KimiLinearForCausalLM",
                  "kimi_k25": "Kimi_K25ForConditionalGeneration"}
COOKBOOK_FAMILIES = [f for f in FAMILIES if f not in COOKBOOK_LACKS]


@pytest.fixture(scope="module")
def archives(tmp_path_factory, cookbook_venvs):
    """Per family: the session's logprobs on a few datums, its archive and merged export, and the cookbook's
    merge and conversion of the archive."""
    if not COOKBOOK_PYTHON.exists():
        pytest.fail("the cookbook venv is missing: run scripts/cookbook-venv (scripts/test does)")
    root = tmp_path_factory.mktemp("cookbook-weights")
    data = make_batch(np.random.default_rng(8), 3, max_len=16)
    runs, jobs = {}, []
    for family in COOKBOOK_FAMILIES:
        model_dir = build_family(family, root / "models" / family)
        model = load_causal_lm(str(model_dir))
        base = LoraBase(model, LogprobComputer(model, "torch"), model_dir=str(model_dir), microbatch_tokens=256)
        config = types.LoraConfig(rank=4, seed=3, train_unembed=not getattr(model.config, "tie_word_embeddings", False))
        session = LoraSession("s", base, config, base_model=str(model_dir))
        with torch.no_grad():  # a trained-looking adapter: B nonzero everywhere
            for p in session.engine.params:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        out = session.run_loss(data, "cross_entropy", None, backward=False)
        saved = Path(session.save_weights(str(root / "checkpoints"), family, base_model=str(model_dir), merged=True))
        runs[family] = dict(model_dir=model_dir, saved=saved, logprobs=[o["logprobs"].to_numpy()
                                                                         for o in out.loss_fn_outputs])
        jobs.append(dict(name=family, base=str(model_dir), adapter=str(saved), merged=str(root / "merged" / family),
                         peft=None if family in NO_CONVERSION else str(root / "peft" / family)))
    (root / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([str(COOKBOOK_PYTHON), str(ROOT / "tests" / "cookbook_weights_driver.py"),
                           str(root / "jobs.json")], capture_output=True, text=True, timeout=500,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            runs[result["name"]].update(cookbook=result, merged=root / "merged" / result["name"],
                                        peft=root / "peft" / result["name"])
    return data, runs


def _assert_logprobs(model, data, expected) -> None:
    with torch.no_grad():
        for d, want in zip(data, expected, strict=True):
            np.testing.assert_allclose(reference_logprobs(model, d).numpy(), want, atol=2e-5)


def test_the_cookbooks_transformers_lacks_these_classes(cookbook_venvs):
    if not COOKBOOK_PYTHON.exists():
        pytest.fail("the cookbook venv is missing: run scripts/cookbook-venv (scripts/test does)")
    code = f"import transformers; print([n for n in {sorted(COOKBOOK_LACKS.values())!r} if hasattr(transformers, n)])"
    done = subprocess.run([str(COOKBOOK_PYTHON), "-c", code], capture_output=True, text=True, timeout=120,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"the cookbook's transformers has {done.stdout.strip()}: check those families"


@pytest.mark.parametrize("family", COOKBOOK_FAMILIES)
def test_the_cookbook_merges_our_archive_into_the_sessions_model(archives, family):
    data, runs = archives
    run = runs[family]
    assert run["cookbook"]["merged"] == "ok", run["cookbook"]["merged"]
    merged = AutoModelForCausalLM.from_pretrained(run["merged"], dtype=torch.float32).eval()
    _assert_logprobs(merged, data, run["logprobs"])
    ours = AutoModelForCausalLM.from_pretrained(run["saved"] / "merged", dtype=torch.float32).eval()  # merged=True
    _assert_logprobs(ours, data, run["logprobs"])


@pytest.mark.parametrize("family", sorted(set(COOKBOOK_FAMILIES) - NO_CONVERSION))
def test_the_cookbook_converts_our_archive_to_a_serving_adapter(archives, family):
    import peft

    data, runs = archives
    run = runs[family]
    assert run["cookbook"]["peft"] == "ok", run["cookbook"]["peft"]
    config = json.loads((run["peft"] / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 32
    if family in PEFT_LOADABLE:
        base = AutoModelForCausalLM.from_pretrained(run["model_dir"], dtype=torch.float32)
        _assert_logprobs(peft.PeftModel.from_pretrained(base, str(run["peft"])).eval(), data, run["logprobs"])
