"""A full session's saved weights are the session's model: every parameter and every persistent buffer.

DeepSeek-V3's and Nemotron-H's routers keep ``e_score_correction_bias`` as a persistent buffer (not trained, part of
``state_dict()``); a save of the parameters alone reloads with the buffer re-created as zeros and other routing.
The family models draw such buffers nonzero (recipes/families.py), so a dropped one changes the logprobs.

For every family: the worker's own session (SessionFactory over the model as the worker loads it) trains a step,
saves weights for the sampler, and plain ``AutoModelForCausalLM.from_pretrained`` of that directory gives the
session's logprobs and buffers. Then save_state -> load_state into a session whose base buffers differ (another
seed), a state without buffers (as written before they were saved), the sampling snapshot, and the sharded path
(FSDP2 over a one-rank shard group, in process).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.helpers import make_batch, reference_logprobs
from tinkerq import types
from tinkerq.launcher.processes import free_port
from tinkerq.recipes.families import FAMILIES, build_family
from tinkerq.settings import Settings
from tinkerq.store import MemoryStore
from tinkerq.worker.loading.models import load_causal_lm
from tinkerq.worker.sampling.snapshots import Snapshots
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.session import FullSession
from tinkerq.worker.training.sessions import SessionFactory

pytestmark = pytest.mark.timeout(120)
ADAM = types.AdamParams(learning_rate=1e-2)
# The families whose models have persistent buffers (their routers' e_score_correction_bias)
WITH_BUFFERS = ("deepseek_v3", "nemotron_h", "inkling", "inkling2", "deepseek_v32", "deepseek_v4", "glm_moe_dsa",
                "kimi_linear", "kimi_k25")


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict's entries that are not parameters (written plainly here, not with the worker's helper)."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {n: t for n, t in model.state_dict().items() if n not in params}


def factory(model_dir: Path, checkpoint_dir: Path) -> SessionFactory:
    """What a worker makes its sessions with: the model loaded as the worker loads it."""
    model = load_causal_lm(str(model_dir))
    return SessionFactory(Settings(checkpoint_dir=str(checkpoint_dir)), model, str(model_dir),
                          LogprobComputer(model, "torch"), "tiny", "w", None, evictable=lambda *_: None)


def full_session(make: SessionFactory, model_id: str = "a" * 32) -> FullSession:
    session = make.make(model_id, None, {}, lambda _: None)
    assert isinstance(session, FullSession)
    return session


def session_logprobs(session: FullSession, data: list[types.Datum]) -> list[np.ndarray]:
    out = session.run_loss(data, "cross_entropy", None, backward=False)
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def assert_logprobs(model: torch.nn.Module, data: list[types.Datum], expected: list[np.ndarray]) -> None:
    with torch.no_grad():
        for d, want in zip(data, expected, strict=True):
            np.testing.assert_allclose(reference_logprobs(model, d).numpy(), want, atol=1e-5, rtol=0)


def assert_same_buffers(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    found = persistent_buffers(model)
    assert found.keys() == expected.keys()
    for name, want in expected.items():
        torch.testing.assert_close(found[name], want, atol=0, rtol=0, msg=name)


@pytest.fixture(scope="module")
def families_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families")


def test_the_family_models_have_nonzero_persistent_buffers():
    """What makes the tests below see a dropped buffer; rotary inv_freq (not persistent) stays as the config says."""
    from tinkerq.recipes.families import build_model

    for family in WITH_BUFFERS:
        model = build_model(family)
        buffers = persistent_buffers(model)
        # (an integer table, DeepSeek-V4's tid2eid of expert ids, is drawn: not all zeros, though 0 is an id)
        assert buffers and all(float(b.abs().min()) > 0 if b.is_floating_point() else bool(b.any())
                               for b in buffers.values()), family
        fresh = type(model)(model.config)  # transformers' own initialisation: zeros
        assert all(float(b.abs().max()) == 0 for b in persistent_buffers(fresh).values())
        for name, b in model.named_buffers():
            if name.endswith("inv_freq"):
                torch.testing.assert_close(b, dict(fresh.named_buffers())[name])
        with torch.no_grad():
            assert torch.isfinite(model(input_ids=torch.arange(3, 20)[None]).logits).all()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_saved_weights_reload_to_the_sessions_model(family, families_dir, tmp_path):
    model_dir = build_family(family, families_dir / family)
    session = full_session(factory(model_dir, tmp_path))
    data = make_batch(np.random.default_rng(3), 3, max_len=16)
    session.run_loss(data, "cross_entropy", None, backward=True)
    session.optim_step(ADAM)
    expected = session_logprobs(session, data)
    trained = session.model  # the worker's TrainingSession
    buffers = {n: t.clone() for n, t in persistent_buffers(trained).items()}
    assert (family in WITH_BUFFERS) == bool(buffers)

    saved = session.save_weights(str(tmp_path), "step1", base_model="tiny")
    reloaded, info = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]  # nothing re-created as zeros
    assert_logprobs(reloaded.eval(), data, expected)
    assert_same_buffers(reloaded, buffers)
    assert_same_buffers(load_causal_lm(saved), buffers)  # how a sampler loads the path (worker/sampling/snapshots.py)

    snapshot = session.snapshot()  # what save_weights_and_get_sampling_client() samples
    assert_logprobs(snapshot, data, expected)
    assert_same_buffers(snapshot, buffers)


@pytest.mark.parametrize("family", WITH_BUFFERS)
def test_save_state_then_load_state_carries_the_buffers(family, tmp_path):
    """A state saved on one base loads into a session whose base has other buffers (and other weights: another
    seed, same shapes): the weights and buffers become the saved ones, in the session and in its snapshot. A state
    written without buffers (before they were saved) still loads; the session keeps its own buffers."""
    data = make_batch(np.random.default_rng(5), 3, max_len=16)
    source = full_session(factory(build_family(family, tmp_path / "a", seed=0), tmp_path / "ckpt"))
    source.run_loss(data, "cross_entropy", None, backward=True)
    source.optim_step(ADAM)
    expected = session_logprobs(source, data)
    buffers = {n: t.clone() for n, t in persistent_buffers(source.model).items()}
    state = Path(source.save_state(str(tmp_path / "ckpt"), "s", base_model="tiny", seq_id=1))

    worker_b = factory(build_family(family, tmp_path / "b", seed=7), tmp_path / "ckpt")
    other = full_session(worker_b, "b" * 32)
    own = {n: t.clone() for n, t in persistent_buffers(other.model).items()}
    assert all(not torch.equal(own[n], buffers[n]) for n in buffers)
    other.load_state(state)
    assert other.steps == 1
    assert_same_buffers(other.model, buffers)
    np.testing.assert_allclose(np.concatenate(session_logprobs(other, data)), np.concatenate(expected), atol=1e-5)
    snapshot = other.snapshot()  # its blank is a copy of this worker's base: the buffers must be the session's
    assert_same_buffers(snapshot, buffers)
    assert_logprobs(snapshot, data, expected)
    # Published for another worker of the same base (worker/sampling/snapshots.py), it loads with the same buffers.
    store, settings = MemoryStore(), Settings(checkpoint_dir=str(tmp_path / "ckpt"))
    maker = Snapshots(store, settings, "tiny", worker_b.model, worker_id="w1")
    snapshot_id = maker.add(snapshot, other.model_id)
    maker.publish(snapshot_id)
    elsewhere = Snapshots(store, settings, "tiny", copy.deepcopy(worker_b.model), worker_id="w2")  # base: seed 7
    assert_same_buffers(elsewhere.resolve({"snapshot": snapshot_id})[1], buffers)

    # The same state as written before buffers were saved: the weights load, the buffers stay the session's own.
    old = tmp_path / "ckpt" / "old"
    old.mkdir()
    for f in state.iterdir():
        if f.name.startswith("model") and f.suffix == ".safetensors":
            save_file({k: v for k, v in load_file(str(f)).items() if k not in buffers}, str(old / f.name),
                      metadata={"format": "pt"})
        else:
            (old / f.name).write_bytes(f.read_bytes())
    fresh = full_session(factory(tmp_path / "b", tmp_path / "ckpt"), "c" * 32)
    fresh.load_state(old)
    assert_same_buffers(fresh.model, own)
    trained = dict(source.model.named_parameters())
    for name, p in fresh.model.named_parameters():
        torch.testing.assert_close(p, trained[name], atol=0, rtol=0, msg=name)


def test_a_sharded_session_saves_its_buffers(tmp_path):
    """FSDP2 (a one-rank shard group, in process): parameters are DTensors, buffers plain tensors; the leader's
    save and snapshot carry both, and load_state puts saved buffers back."""
    from tinkerq.worker.sharding.group import ShardGroup, ShardSpec
    from tinkerq.worker.sharding.host import LeaderSession, ShardHost

    model_dir = build_family("deepseek_v3", tmp_path / "model")
    model = load_causal_lm(str(model_dir))
    group = ShardGroup(ShardSpec(1, 0, "127.0.0.1", free_port(), "cpu", 30.0, 30.0))
    group.form()
    try:
        host = ShardHost(group, model, model_dir=str(model_dir), logprobs=LogprobComputer(model, "torch"),
                         microbatch_tokens=256)
        session = LeaderSession(host, "a" * 32)
        data = make_batch(np.random.default_rng(6), 3, max_len=16)
        session.run_loss(data, "cross_entropy", None, backward=True)
        session.optim_step(ADAM)
        expected = session_logprobs(session, data)
        buffers = {n: t.clone() for n, t in persistent_buffers(model).items()}
        assert buffers

        saved = session.save_weights(str(tmp_path / "ckpt"), "w", base_model="tiny")
        reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
        assert_logprobs(reloaded, data, expected)
        assert_same_buffers(reloaded, buffers)
        assert_same_buffers(session.snapshot(), buffers)

        state = Path(session.save_state(str(tmp_path / "ckpt"), "s", base_model="tiny", seq_id=1))
        engine = host.sessions["a" * 32]
        with torch.no_grad():
            for t in engine.fixed:
                t.zero_()
        assert float(engine.gather_weights()[next(iter(buffers))].abs().max()) == 0
        session.load_state(state)
        assert_same_buffers(session.snapshot(), buffers)
        np.testing.assert_allclose(np.concatenate(session_logprobs(session, data)), np.concatenate(expected),
                                   atol=1e-5)
        session.close()
    finally:
        group.leave("the test is over")
