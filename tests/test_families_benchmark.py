"""benchmarks/families.py runs each of its parts to the end on the CPU, at sizes that take seconds (so the GPU path,
``--shape real-small``, does not rot unseen). Nothing here looks at a timing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tinkerq.launcher.processes import ROOT

pytestmark = pytest.mark.timeout(300)


def _bench(*args: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "families.py"), "--threads", "1", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "error:" not in out.stdout, out.stdout
    return out.stdout


def test_table_and_moe_parts():
    out = _bench("--families", "llama", "qwen3_moe", "--reps", "1", "--warmup", "0")
    assert "[table]" in out and "[moe]" in out and "RATIO qwen3_moe: LoRA fb / base fb (b)" in out


def test_real_small_path_shrunk_for_the_cpu():
    out = _bench("--shape", "real-small", "--layers", "1", "--shrink", "16", "--datums", "2", "--seq-len", "16",
                 "--prompts", "2", "--new-tokens", "4", "--reps", "1", "--warmup", "0", "--peak-tflops", "1")
    rows = [line.split()[0] for line in out.split("[real-small]")[1].splitlines()[3:6]]
    assert rows == ["llama", "qwen3_moe", "gpt_oss"], out
    assert "LoRA ckpt tok/s" in out  # LoRA forward_backward with activation checkpointing too (issue 30)


def test_counts_match_the_cookbook_for_llama_1b():
    out = _bench("--counts")
    assert "Qwen3-30B-A3B" in out and "DeepSeek-V3" in out and "gpt-oss-20b" in out
    assert "published per-rank counts (attn 212,992, mlp 491,520, unembed 130,304): equal" in out
