"""``tinkerq families build``: a family's tiny model written to DIR/<family>, loadable, with the line that serves it;
mistakes in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_cli import _run
from tinkerq.recipes.families import build_model

pytestmark = pytest.mark.timeout(120)


def test_build_one_family_writes_a_model_that_loads_and_prints_the_worker_line(tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = _run("families", "build", str(tmp_path / "models"), "--family", "qwen3_moe", "--seed", "3")
    assert out.returncode == 0, out.stderr
    target = tmp_path / "models" / "qwen3_moe"
    assert f"tinkerq worker --model {target}" in out.stdout.splitlines()
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["qwen3_moe"]  # only the family asked for
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    reference = build_model("qwen3_moe", seed=3)  # the seed reached the weights
    for (name, p), q in zip(reference.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(q, p, msg=name)
    assert AutoTokenizer.from_pretrained(target).vocab_size <= model.config.vocab_size


def test_mistakes_are_one_line(tmp_path: Path):
    unknown = _run("families", "build", str(tmp_path), "--family", "no_such_family")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1 and "invalid choice" in unknown.stderr
    a_file = tmp_path / "file"
    a_file.write_text("")
    not_dir = _run("families", "build", str(a_file), "--family", "llama")
    assert not_dir.returncode == 2 and "not a directory" in not_dir.stderr and "Traceback" not in not_dir.stderr
    negative = _run("families", "build", str(tmp_path), "--seed", "-1")
    assert negative.returncode == 2 and negative.stderr.count("\n") == 1
