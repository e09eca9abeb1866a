"""save_state / load_state: a resumed run continues exactly; bad paths are clear user errors; writes are atomic."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

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
    b = service.create_training_client_from_state_with_optimizer(saved)
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
        b.load_state_with_optimizer(path).result(timeout=60)
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
    from tinkerq.worker.checkpoints import write_atomically

    def crash(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(tmp_path / "ckpt", crash)
    assert list(tmp_path.iterdir()) == []  # neither a half-written checkpoint nor a leftover temp dir
    write_atomically(tmp_path / "ckpt", lambda d: (d / "ok").write_text("1"))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and (tmp_path / "ckpt" / "ok").exists()


# -- load_state without the optimizer (Tinker's load_state; load_state_with_optimizer keeps it) ----------------


def client_of(tc):
    """The TrainingClient itself: create_training_client may give a future of it (Tinker's Backcompat future)."""
    return tc.result(timeout=120) if callable(getattr(type(tc), "result", None)) else tc


def _full_session(model_dir):
    from tests.helpers import load_reference
    from tinkerq.worker.training.logprobs import LogprobComputer
    from tinkerq.worker.training.session import TrainingSession

    model = load_reference(model_dir).requires_grad_(True)
    return TrainingSession("a" * 32, model, base_dir=str(model_dir), microbatch_tokens=96,
                           logprobs=LogprobComputer(model, "torch"), blank_model=lambda: load_reference(model_dir))


def _lora_session(model_dir, name="b" * 32):
    from tests.helpers import load_reference
    from tinkerq.worker.lora.session import LoraBase, LoraSession
    from tinkerq.worker.training.logprobs import LogprobComputer

    base = load_reference(model_dir)
    lora = LoraBase(base, LogprobComputer(base, "torch"), model_dir=str(model_dir), microbatch_tokens=96)
    return LoraSession(name, lora, types.LoraConfig(rank=4, seed=5), base_model="tiny")


def _step(session, batch) -> dict:
    session.run_loss(batch, "cross_entropy", None, backward=True)
    return session.optim_step(ADAM).metrics


def _weights(session) -> dict:
    return {n: p.detach().clone() for n, p in zip(session.engine.param_names, session.engine.params, strict=True)}


def _assert_weights(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=name)


def _trained_then_saved(session, tmp_path, rng):
    """Two steps and a pending gradient, saved; then the step that continues it (its weights are returned), and
    more training with a pending gradient again, so that loading has something to undo."""
    for _ in range(2):
        _step(session, make_batch(rng, 3))
    session.run_loss(make_batch(rng, 2), "cross_entropy", None, backward=True)  # pending when saved
    path = session.save_state(str(tmp_path), "mid", base_model="tiny", seq_id=3)
    probe = make_batch(rng, 3)
    continued = (_step(session, probe), _weights(session))
    _step(session, make_batch(rng, 4))
    session.run_loss(make_batch(rng, 2), "cross_entropy", None, backward=True)
    return Path(path), probe, continued


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_load_state_with_and_without_the_optimizer(model_dir, tmp_path, kind):
    from tinkerq.worker.checkpoints import PEFT_PREFIX
    from tinkerq.worker.lora.session import LoraSession

    rng = np.random.default_rng(60)
    session = _full_session(model_dir) if kind == "full" else _lora_session(model_dir)
    path, probe, (continued_metrics, continued) = _trained_then_saved(session, tmp_path, rng)

    # With the optimizer: exactly the step that followed the save (moments, step count and pending gradients).
    meta = session.load_state(path, optimizer=True)
    assert meta["optimizer_steps"] == 2 and session.steps == 2
    metrics = _step(session, probe)
    assert metrics["step:max"] == 3 and metrics["grad_norm:mean"] == pytest.approx(continued_metrics["grad_norm:mean"])
    _assert_weights(_weights(session), continued, atol=0.0)

    # Without: the saved weights, AdamW as in a new session and no pending gradient.
    session.load_state(path, optimizer=False)
    assert session.steps == 0 and not session.engine.optimizer.state
    assert all(not p.grad.any() for p in session.engine.params)
    metrics = _step(session, probe)
    assert metrics["step:max"] == 1

    # The plain-PyTorch reference: the saved weights, a fresh torch.optim.AdamW, one step on the same batch.
    if kind == "full":
        from transformers import AutoModelForCausalLM

        from tests.helpers import reference_step

        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        opt = torch.optim.AdamW(ref.parameters(), lr=0.0)
        norm = reference_step(ref, opt, [probe], ADAM)
        want = {n: p.detach() for n, p in ref.named_parameters()}
    else:  # the saved adapter as PEFT loads it over the base, trained by a fresh torch.optim.AdamW
        import peft

        from tests.helpers import load_reference, reference_step

        ref = peft.PeftModel.from_pretrained(load_reference(model_dir), str(path), is_trainable=True).eval()
        trained = [p for p in ref.parameters() if p.requires_grad]
        norm = reference_step(ref, torch.optim.AdamW(trained, lr=0.0), [probe], ADAM)
        want = {n.removeprefix(PEFT_PREFIX).replace(".default", ""): p.detach()
                for n, p in ref.named_parameters() if p.requires_grad}
        assert isinstance(session, LoraSession) and len(want) == len(trained)
    assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
    _assert_weights(_weights(session), want, atol=1e-6)
    assert max(float((continued[n] - want[n]).abs().max()) for n in want) > 1e-4  # the two really differ


def test_load_state_optimizer_flag_on_the_wire(service, model_dir):
    """Through a worker: a body without "optimizer" restores it (as before); False starts AdamW afresh; anything
    else is a user error that changes nothing."""
    tc = client_of(service.create_training_client(str(model_dir)))
    try:
        rng = np.random.default_rng(61)
        _steps(tc, [make_batch(rng, 2)])
        path = tc.save_state("wire-optimizer").result(timeout=60).path

        def load(body):
            return tc._submit("load_state", body, lambda b: b, argsrepr="test")

        assert load({"path": path}).result(timeout=60)["optimizer_steps"] == 1
        reply = load({"path": path, "optimizer": False}).result(timeout=60)
        assert reply["optimizer_steps"] == 0 and reply["optimizer"] is False
        assert tc.optim_step(ADAM).result(timeout=60).metrics["step:max"] == 1
        for bad in (1, "no", None):
            err = load({"path": path, "optimizer": bad}).exception(timeout=60)
            assert isinstance(err, errors.ValidationError) and "optimizer" in err.message, bad
        assert tc.optim_step(ADAM).result(timeout=60).metrics["step:max"] == 2
    finally:
        tc.close()


SHARDED = "tiny-sharded-checkpoints"


@pytest.fixture(scope="module")
def sharded(model_dir, redis_url, checkpoint_dir, tmp_path_factory, worker):
    """A model in two shards (tests/test_sharding.py), under a name of its own."""
    from tests.test_sharding import _start_group
    from tinkerq.producer import ServiceClient

    with ServiceClient(broker_url=redis_url) as sc:
        group = _start_group(model_dir, redis_url, checkpoint_dir, tmp_path_factory, sc, SHARDED)
    yield SHARDED
    group.stop()


def test_sharded_load_state_with_and_without_the_optimizer(service, sharded):
    """A session in two shards takes the same engine path: load_state(optimizer=False) then one step equals the
    plain-PyTorch reference that starts AdamW afresh from the saved weights; optimizer=True continues exactly."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import reference_step

    rng = np.random.default_rng(62)
    tc = client_of(service.create_training_client(sharded))

    def load(path, **flags):
        return tc._submit("load_state", {"path": path, **flags}, lambda b: b, argsrepr="test").result(timeout=60)

    def weights(tag):
        return tc.save_weights_for_sampler(tag).result(timeout=60).path

    try:
        _steps(tc, [make_batch(rng, 3), make_batch(rng, 2)])
        tc.forward_backward(make_batch(rng, 2))  # pending when saved
        path = tc.save_state("sharded-optimizer").result(timeout=60).path
        probe = make_batch(rng, 3)
        _steps(tc, [probe])
        continued = weights("sharded-continued")
        _steps(tc, [make_batch(rng, 4)])
        tc.forward_backward(make_batch(rng, 2))

        assert load(path, optimizer=True)["optimizer_steps"] == 2
        _steps(tc, [probe])
        assert max_weight_diff(AutoModelForCausalLM.from_pretrained(continued), weights("sharded-again")) < 1e-6

        assert load(path, optimizer=False)["optimizer_steps"] == 0
        tc.forward_backward(probe)
        step = tc.optim_step(ADAM).result(timeout=60).metrics
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        norm = reference_step(ref, torch.optim.AdamW(ref.parameters(), lr=0.0), [probe], ADAM)
        assert step["step:max"] == 1 and step["grad_norm:mean"] == pytest.approx(norm, rel=1e-4)
        assert max_weight_diff(ref, weights("sharded-fresh")) < 1e-5
    finally:
        tc.close()


def test_a_crash_while_a_checkpoint_is_replaced_leaves_a_complete_one(tmp_path, monkeypatch):
    """write_atomically moves the old directory aside before the new one takes its name: a crash between the two
    renames leaves the old one, complete, at previous_path (an adopter loads the automatic snapshot from there),
    and the next write cleans it up."""
    from tinkerq.worker import checkpoints

    final = tmp_path / "m" / "state" / ".auto"

    def fill(text):
        return lambda d: (d / "tinkerq_state.json").write_text(text)

    checkpoints.write_atomically(final, fill("old"))
    real_replace = os.replace

    def crash(src, dst):
        raise OSError("killed here")

    monkeypatch.setattr(checkpoints.os, "replace", crash)
    with pytest.raises(OSError, match="killed here"):
        checkpoints.write_atomically(final, fill("new"))
    assert not final.exists()
    assert (checkpoints.previous_path(final) / "tinkerq_state.json").read_text() == "old"
    monkeypatch.setattr(checkpoints.os, "replace", real_replace)
    checkpoints.write_atomically(final, fill("newer"))
    assert (final / "tinkerq_state.json").read_text() == "newer"
    assert not checkpoints.previous_path(final).exists()
    assert sorted(p.name for p in final.parent.iterdir()) == [".auto"]


def test_a_checkpoint_write_shows_no_progress_bar_of_transformers(model_dir, tmp_path, capfd):
    """Every checkpoint write (automatic snapshots every few steps among them) runs with transformers' progress
    bars off, so its "Writing model shards" bar does not cut through ``tinkerq sft``'s own bar; they are on again
    after, and a save outside a checkpoint write still shows it (the check can fail)."""
    from transformers.utils import logging as hf_logging

    from tests.helpers import load_reference
    from tinkerq.worker import checkpoints

    model = load_reference(model_dir)
    assert hf_logging.is_progress_bar_enabled()
    capfd.readouterr()
    final = checkpoints.weights_path(str(tmp_path), "d" * 32, "quiet")
    checkpoints.write_atomically(final, lambda d: model.save_pretrained(d))
    assert (final / "model.safetensors").is_file()
    assert "Writing model shards" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
    model.save_pretrained(tmp_path / "outside")
    assert "Writing model shards" in capfd.readouterr().err
