"""save_state / load_state: a resumed run continues exactly; bad paths are clear user errors; writes are atomic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers import make_batch, max_weight_diff
from tinkerq import errors, types

pytestmark = pytest.mark.timeout(180)
ADAM = types.AdamParams(learning_rate=5e-3, weight_decay=0.01)


def _steps(tc, batches):
    futures = [(tc.forward_backward(b), tc.optim_step(ADAM)) for b in batches]
    return [fb.result(timeout=60).metrics["loss:sum"] for fb, _ in futures]


def test_resumed_run_equals_the_uninterrupted_one(service, model_dir):
    rng = np.random.default_rng(50)
    batches = [make_batch(rng, 3) for _ in range(6)]
    a = service.create_training_client(str(model_dir))
    try:
        _steps(a, batches[:3])
        saved = a.save_state("mid").result(timeout=60).path
        uninterrupted = _steps(a, batches[3:])
        end_a = a.save_weights_for_sampler("end-a").result(timeout=60).path
    finally:
        a.close()
    assert (Path(saved) / "tinkerq_state.json").is_file()
    b = service.create_training_client_from_state(saved)
    try:
        resumed = _steps(b, batches[3:])
        end_b = b.save_weights_for_sampler("end-b").result(timeout=60).path
    finally:
        b.close()
    assert resumed == pytest.approx(uninterrupted, rel=1e-6, abs=1e-7)
    from transformers import AutoModelForCausalLM

    assert max_weight_diff(AutoModelForCausalLM.from_pretrained(end_a), end_b) < 1e-6


def test_pending_gradients_travel_with_the_state(service, model_dir):
    batch = make_batch(np.random.default_rng(51), 2)
    a = service.create_training_client(str(model_dir))
    b = service.create_training_client(str(model_dir))
    try:
        a.forward_backward(batch)
        path = a.save_state("pending").result(timeout=60).path
        norm_a = a.optim_step(ADAM).result(timeout=60).metrics["grad_norm:mean"]
        b.load_state(path).result(timeout=60)
        norm_b = b.optim_step(ADAM).result(timeout=60).metrics["grad_norm:mean"]
        assert norm_b == pytest.approx(norm_a, rel=1e-6) and norm_a > 0
    finally:
        a.close()
        b.close()


def test_bad_checkpoint_paths_and_names_are_user_errors(training_client, checkpoint_dir, tmp_path):
    tc = training_client
    weights_only = tc.save_weights_for_sampler("weights-only").result(timeout=60).path
    cases = [
        (str(tmp_path), "outside"),
        (str(Path(checkpoint_dir) / "no-such-state"), "does not exist"),
        (weights_only, "not a training state"),
        (str(Path(checkpoint_dir) / ".." / "escape"), "outside"),
        ("", "non-empty"),
    ]
    for path, words in cases:
        err = tc.load_state(path).exception(timeout=30)
        assert isinstance(err, errors.UserError) and words in err.message, (path, err)
    for name in ("../up", "", "a/b", "x" * 200):
        err = tc.save_state(name).exception(timeout=30)
        assert isinstance(err, errors.UserError) and "checkpoint name" in err.message, (name, err)
    # The session is untouched and keeps working.
    assert np.isfinite(tc.forward(make_batch(np.random.default_rng(52), 1)).result(timeout=30).metrics["loss:sum"])


def test_writes_are_atomic(tmp_path):
    from worker.checkpoints import write_atomically

    def crash(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(tmp_path / "ckpt", crash)
    assert list(tmp_path.iterdir()) == []  # neither a half-written checkpoint nor a leftover temp dir
    write_atomically(tmp_path / "ckpt", lambda d: (d / "ok").write_text("1"))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and (tmp_path / "ckpt" / "ok").exists()
