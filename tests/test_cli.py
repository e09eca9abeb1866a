"""The command line: clear one-line failures, and the main job on the embedded fleet."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tinkerq.launcher.processes import ROOT, free_port

pytestmark = pytest.mark.timeout(180)


def _run(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``tinkerq ARGS`` in a subprocess, with no TINKERQ_* setting from the caller's environment unless ``env``
    gives it (a developer's TINKERQ_BROKER_URL must not change what a test sees)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TINKERQ_")}
    return subprocess.run([sys.executable, "-m", "tinkerq.launcher.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**clean, **(env or {})})


def test_worker_with_bad_model_path_says_so_and_exits(redis_url):
    out = _run("worker", "--model", "/no/such/dir", "--broker", redis_url)
    assert out.returncode == 2
    assert "is not a directory" in out.stderr and "Traceback" not in out.stderr


def test_worker_with_unreachable_broker_says_so_and_exits(tmp_path: Path):
    """The broker is checked before the model loads: given a model that cannot load, the worker still says only
    that Redis is unreachable (loading first, it would have named the model)."""
    unloadable = tmp_path / "unloadable"
    unloadable.mkdir()
    (unloadable / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    # The URL (with a password, so no warning) in the environment: --broker would warn about a password in argv.
    out = _run("worker", "--model", str(unloadable),
               env={"TINKERQ_BROKER_URL": f"redis://:secret@127.0.0.1:{free_port()}/0"})
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "cannot reach Redis" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "unloadable" not in out.stderr and "secret" not in out.stderr


def test_worker_with_wrong_password_says_so(redis_url, model_dir):
    import redis

    client = redis.Redis.from_url(redis_url)
    client.acl_setuser("tq", enabled=True, passwords=["+right"], commands=["+@all"], keys=["*"], channels=["*"])
    try:
        url = redis_url.replace("redis://", "redis://tq:wrong@")
        out = _run("worker", "--model", str(model_dir), "--broker", url)
        assert out.returncode == 2
        assert "credentials" in out.stderr and "wrong" not in out.stderr  # the password is never echoed
    finally:
        client.acl_deluser("tq")


def test_producer_fails_fast_without_broker():
    from tinkerq.errors import BrokerUnavailableError
    from tinkerq.producer import ServiceClient
    from tinkerq.settings import Settings

    with pytest.raises(BrokerUnavailableError, match="cannot reach Redis"):
        ServiceClient(settings=Settings(broker_url=f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=1))


def test_sft_job_runs_on_the_embedded_fleet(tmp_path: Path):
    """A short `tinkerq sft` end to end: progress, metrics JSONL, loss PNG, before/after evaluation."""
    out = _run("sft", "--steps", "12", "--eval-examples", "10", "--out", str(tmp_path / "run"), timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "before:" in out.stdout and "after:" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns, even in 12 steps
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["after"]["heldout_nll"] < summary["before"]["heldout_nll"]
    assert "sft: 100%" in out.stderr  # the progress bar ran to the end


def test_rl_job_runs_on_the_embedded_fleet(tmp_path: Path):
    """A short `tinkerq rl`: sampling, rewards, importance-sampling steps, metrics JSONL and reward PNG."""
    out = _run("rl", "--warmup-steps", "5", "--iterations", "3", "--prompts", "4", "--group-size", "4",
               "--out", str(tmp_path / "run"), timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
    trained = [r for r in rows if r["datums"] > 0]
    assert trained and all(r["ratio_mean"] == pytest.approx(1.0, abs=1e-3) for r in trained)  # on-policy
    assert (tmp_path / "run" / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert "after RL:" in out.stdout
    # Where the time went: every iteration splits into snapshot + sampling + training (+ client work).
    for r in rows:
        parts = r["snapshot_s"] + r["sample_s"] + r["train_s"]
        # samples_per_s is rounded to 0.1 and computed from sample_s before sample_s is rounded to 1e-4: a short
        # sampling phase (0.046 s: 16/s moves 0.38 per 5e-5) widens the bound by that rounding.
        rounding = 0.051 + 16 * 5e-5 / (r["sample_s"] - 5e-5) ** 2
        assert r["sample_s"] > 0 and r["samples_per_s"] == pytest.approx(16 / r["sample_s"], abs=rounding)
        assert parts == pytest.approx(r["iteration_s"], abs=2e-3)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["samples_per_s"] > 0 and sum(summary["share"].values()) == pytest.approx(1.0, abs=0.01)
    assert "samples/s while sampling" in out.stdout and "sampling " in out.stdout


def test_sft_job_with_lora_on_the_embedded_fleet(tmp_path: Path):
    """`tinkerq sft --lora-rank 4`: a LoRA session, its size reported at start, the LoRA default lr, and the
    usual curve, evaluation and saved weights (a PEFT adapter, plus the merged model exact match loads)."""
    from tinkerq.recipes.demo_model import DEFAULT_LR

    out = _run("sft", "--lora-rank", "4", "--steps", "6", "--eval-examples", "5", "--out", str(tmp_path / "run"),
               timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"LoRA rank 4: [\d,]+ trainable parameters \([\d.]+% of [\d.]+M\), [\d.]+ [KM]iB of training "
                     r"state", out.stdout), out.stdout
    assert "before:" in out.stdout and "after:" in out.stdout and "trained 6 steps" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[0]["learning_rate"] == pytest.approx(DEFAULT_LR)  # an unset --lr: the demo's, LoRA or not
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["lora"]["rank"] == 4 and 0 < summary["lora"]["trainable_parameters"] < 1_000_000
    assert summary["after"]["heldout_nll"] < summary["before"]["heldout_nll"]
    assert summary["after"]["exact_match"] is not None  # scored on <weights>/merged
    assert (Path(summary["weights"]) / "adapter_config.json").is_file()


def test_rl_job_with_lora_on_the_embedded_fleet(tmp_path: Path):
    """`tinkerq rl --lora-rank 4`: warm-up, snapshots sampled from the adapter, RL steps, all on a LoRA session."""
    from tinkerq.recipes.demo_model import DEFAULT_LR
    from tinkerq.recipes.rl import DEFAULT_RL_LR

    out = _run("rl", "--lora-rank", "4", "--warmup-steps", "3", "--iterations", "2", "--prompts", "4",
               "--group-size", "4", "--out", str(tmp_path / "run"), timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"LoRA rank 4: [\d,]+ trainable parameters", out.stdout), out.stdout
    assert f"RL learning rate {DEFAULT_RL_LR:g} (SFT warm-up peak {DEFAULT_LR:g})" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2] and all(0.0 <= r["reward"] <= 1.0 for r in rows)
    assert "after RL:" in out.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["lora"]["rank"] == 4 and summary["learning_rate"] == pytest.approx(DEFAULT_RL_LR)


@pytest.mark.parametrize("command", ["sft", "rl"])
@pytest.mark.parametrize("rank", ["0", "-3", "four"])
def test_lora_rank_must_be_positive(command, rank):
    out = _run(command, "--lora-rank", rank)
    assert out.returncode == 2 and "--lora-rank" in out.stderr and "positive integer" in out.stderr
    assert "Traceback" not in out.stderr


def test_lora_size_line():
    from tinkerq.recipes.sft import describe_lora
    from tinkerq.types import ModelInfo

    info = ModelInfo(model_id="m", base_model="b", vocab_size=10, max_seq_len=8, num_parameters=3_100_000, worker="w",
                     extra={"lora": {"rank": 8, "trainable_parameters": 12_345, "state_bytes": 193 * 1024}})
    assert describe_lora(info) == ("LoRA rank 8: 12,345 trainable parameters (0.4% of 3.1M), 193 KiB of training "
                                   "state")


def test_rl_reward_rule():
    from tinkerq.recipes.rl import reward, rule_target

    assert rule_target("abcdef>") == "fed" and rule_target("abc>") == "cba"
    assert reward("abcdef>", "fed") == 1.0
    assert reward("abcdef>", "fedcba") == pytest.approx(0.5)  # the whole reversal: too long
    assert reward("abcdef>", "") == 0.0 and reward("abcdef>", "xyz") == 0.0


def test_plot_command(tmp_path: Path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "loss": 4.0 / i, "grad_norm": 1.0}) + "\n" for i in range(1, 30)))
    out = _run("plot", str(metrics), "--keys", "loss", "grad_norm", "--out", str(tmp_path / "curve.png"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    missing = _run("plot", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "nope.jsonl: no such file" in missing.stderr


def test_sft_job_against_a_running_fleet(tmp_path: Path, redis_url, worker, model_dir):
    """`tinkerq sft --broker redis://...` drives the real worker process instead of an embedded fleet."""
    out = _run("sft", "--broker", redis_url, "--model", str(model_dir), "--steps", "4", "--batch-size", "8",
               "--eval-examples", "5", "--out", str(tmp_path / "run"), timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "using the fleet at redis://127.0.0.1" in out.stdout and "embedded" not in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["fb_tokens_per_s"] > 0 for r in rows)  # the worker's timing, logged
