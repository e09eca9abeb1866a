"""The command line: clear one-line failures, and the main job on the embedded fleet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.processes import ROOT, free_port

pytestmark = pytest.mark.timeout(180)


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_worker_with_bad_model_path_says_so_and_exits(redis_url):
    out = _run("worker", "--model", "/no/such/dir", "--broker", redis_url)
    assert out.returncode == 2
    assert "is not a directory" in out.stderr and "Traceback" not in out.stderr


def test_worker_with_unreachable_broker_says_so_and_exits(model_dir):
    out = _run("worker", "--model", str(model_dir), "--broker", f"redis://127.0.0.1:{free_port()}/0")
    assert out.returncode == 2
    assert "cannot reach Redis" in out.stderr and "Traceback" not in out.stderr


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
    from producer import ServiceClient
    from tinkerq.errors import BrokerUnavailableError
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
        assert r["sample_s"] > 0 and r["samples_per_s"] == pytest.approx(16 / r["sample_s"], rel=0.01)
        assert parts == pytest.approx(r["iteration_s"], abs=2e-3)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["samples_per_s"] > 0 and sum(summary["share"].values()) == pytest.approx(1.0, abs=0.01)
    assert "samples/s while sampling" in out.stdout and "sampling " in out.stdout


def test_rl_reward_rule():
    from recipes.rl import reward, rule_target

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
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_sft_job_against_a_running_fleet(tmp_path: Path, redis_url, worker, model_dir):
    """`tinkerq sft --broker redis://...` drives the real worker process instead of an embedded fleet."""
    out = _run("sft", "--broker", redis_url, "--model", str(model_dir), "--steps", "4", "--batch-size", "8",
               "--eval-examples", "5", "--out", str(tmp_path / "run"), timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "using the fleet at redis://127.0.0.1" in out.stdout and "embedded" not in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["fb_tokens_per_s"] > 0 for r in rows)  # the worker's timing, logged
