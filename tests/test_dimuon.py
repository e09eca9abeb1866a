"""The Dimuon optimizer (docs/optimizers.md: tinkerq's definition), in process, against a plain reference written here
from that definition (numpy, float64, one matrix at a time): the engine's step on parameters of every shape it
meets (a matrix, a 3-D expert tensor, a 1-D bias, a rank-deficient gradient), with clipping and momentum over two
steps, for LoRA ranks 4 and 64; the direction's norm; damping; the state's round trip; then a LoRA session (against
PEFT trained with the reference) and a full-parameter session (against a plain transformers model trained with it).

The SDK, gateway and producer paths against a real worker are in tests/test_sdk_dimuon.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import build_tiny_llama, load_reference, make_batch, reference_loss
from tinkerq import optimizers, types
from tinkerq.errors import ValidationError
from tinkerq.worker.lora.session import LoraBase, LoraSession
from tinkerq.worker.training.engine import SingleProcess, TrainingEngine
from tinkerq.worker.training.logprobs import LogprobComputer
from tinkerq.worker.training.optimizers import direction
from tinkerq.worker.training.session import TrainingSession

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)
DIMUON = types.DimuonOptimizerConfig()


# -- the reference, plainly from the definition ------------------------------------------------------------------


def ref_sign(m: np.ndarray, damping: float) -> np.ndarray:
    """One matrix: P = diag(r + d)^(-1/4) M diag(c + d)^(-1/4), r / c the mean squares of M's rows / columns; then
    U V^T over P's singular values above 1e-7 of the largest."""
    r = (m ** 2).mean(axis=1)
    c = (m ** 2).mean(axis=0)
    p = np.diag((r + damping) ** -0.25) @ m @ np.diag((c + damping) ** -0.25)
    u, s, vt = np.linalg.svd(p, full_matrices=False)
    keep = s > 1e-7 * s.max() if s.max() > 0 else np.zeros_like(s, dtype=bool)
    return u[:, keep] @ vt[keep]


def ref_direction(m: np.ndarray, damping: float) -> np.ndarray:
    if m.ndim == 1:  # a 1 x n matrix
        return ref_sign(m[None, :], damping)[0]
    if m.ndim == 3:  # each expert's matrix apart
        return np.stack([ref_sign(m[e], damping) for e in range(m.shape[0])])
    return ref_sign(m, damping)


class Reference:
    """Dimuon on named float64 arrays: clip by the global norm (torch's coefficient, max / (norm + 1e-6), at most
    1), momentum M <- beta1 M + (1 - beta1) G, W <- W - lr (32 / rank)^e direction(M)."""

    def __init__(self, weights: dict[str, np.ndarray], rank: int) -> None:
        self.weights = {n: w.astype(np.float64) for n, w in weights.items()}
        self.momentum = {n: np.zeros_like(w) for n, w in self.weights.items()}
        self.rank = rank

    def step(self, grads: dict[str, np.ndarray], hyper: types.DimuonParams) -> tuple[float, float]:
        grads = {n: g.astype(np.float64) for n, g in grads.items()}
        norm = float(np.sqrt(sum(float((g ** 2).sum()) for g in grads.values())))
        if hyper.grad_clip_norm > 0:
            coefficient = min(1.0, hyper.grad_clip_norm / (norm + 1e-6))
            grads = {n: g * coefficient for n, g in grads.items()}
        lr = hyper.learning_rate * (32 / self.rank) ** hyper.rank_lr_correction_exponent
        for n, g in grads.items():
            self.momentum[n] = hyper.beta1 * self.momentum[n] + (1 - hyper.beta1) * g
            self.weights[n] = self.weights[n] - lr * ref_direction(self.momentum[n], hyper.damping)
        return norm, lr


# -- the engine's step --------------------------------------------------------------------------------------------


SHAPES = {"w": (8, 6), "experts": (3, 5, 4), "bias": (7,), "low": (10, 12), "tall": (16, 3)}


def engine_with(weights: dict[str, np.ndarray], rank: int | None) -> TrainingEngine:
    named = [(n, torch.nn.Parameter(torch.from_numpy(w.astype(np.float32)))) for n, w in weights.items()]
    return TrainingEngine(None, named, SingleProcess(), microbatch_tokens=64,  # type: ignore[arg-type]
                          device=torch.device("cpu"), optimizer=DIMUON, lora_rank=rank)


def gradients(rng: np.random.Generator) -> dict[str, np.ndarray]:
    grads = {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
    grads["w"][2] *= 30.0  # rows of very different scales: the preconditioner matters
    grads["low"] = (rng.normal(size=(10, 2)) @ rng.normal(size=(2, 12))).astype(np.float32)  # rank 2
    return grads


def set_grads(engine: TrainingEngine, grads: dict[str, np.ndarray]) -> None:
    for n, p in zip(engine.param_names, engine.params, strict=True):
        assert p.grad is not None
        p.grad.copy_(torch.from_numpy(grads[n]))


def weights_of(engine: TrainingEngine) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in zip(engine.param_names, engine.params, strict=True)}


@pytest.mark.parametrize("rank", [4, 64])
def test_two_clipped_steps_equal_the_reference(rank):
    rng = np.random.default_rng(rank)
    start = {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
    engine, ref = engine_with(start, rank), Reference(start, rank)
    steps = [types.DimuonParams(learning_rate=2e-2, grad_clip_norm=3.0, beta1=0.9),  # clips (norm ~80)
             types.DimuonParams(learning_rate=1e-2, grad_clip_norm=3.0, beta1=0.8, damping=1e-3,
                                rank_lr_correction_exponent=0.3)]
    for i, hyper in enumerate(steps):
        grads = gradients(rng)
        set_grads(engine, grads)
        metrics = engine.optim_step(hyper).metrics
        norm, lr = ref.step(grads, hyper)
        assert norm > hyper.grad_clip_norm  # clipping was on
        assert metrics == pytest.approx({"grad_norm:mean": norm, "learning_rate:mean": lr, "step:max": i + 1},
                                        rel=1e-6)
        for n, w in weights_of(engine).items():
            np.testing.assert_allclose(w, ref.weights[n], rtol=0, atol=1e-5, err_msg=n)
        assert all(not p.grad.any() for p in engine.params)  # the gradients were consumed
    # The two steps moved every parameter, momentum counted: the reference without it (beta1 0 at step 2) differs.
    for n, w in weights_of(engine).items():
        assert np.abs(w - start[n]).max() > 1e-3, n


def test_the_rank_correction_is_relative_to_rank_32():
    for rank, expected in [(4, 8 ** 0.175), (32, 1.0), (64, 0.5 ** 0.175)]:
        assert optimizers.corrected_learning_rate(1.0, rank, 0.175) == pytest.approx(expected)
        assert optimizers.corrected_learning_rate(0.1, rank, 0.0) == 0.1  # 0 turns it off
    full = engine_with({"w": np.ones((4, 3), np.float32)}, None)  # a full-parameter session: rank 32
    set_grads(full, {"w": np.arange(12, dtype=np.float32).reshape(4, 3)})
    assert full.optim_step(types.DimuonParams(learning_rate=0.01)).metrics["learning_rate:mean"] == 0.01


def test_the_direction_has_frobenius_norm_sqrt_rank():
    rng = np.random.default_rng(3)
    cases = {  # (matrix, its rank)
        "square": (rng.normal(size=(6, 6)), 6),
        "wide": (rng.normal(size=(4, 96)), 4),
        "tall": (rng.normal(size=(64, 8)), 8),
        # Rank-deficient, made in float32 (its rounding puts the missing singular values near 3e-8 of the largest):
        # a float32 SVD would count several of them (its own error is ~1e-7 to 7e-7), float64's does not.
        "rank 3": (rng.normal(size=(32, 3)).astype(np.float32) @ rng.normal(size=(3, 896)).astype(np.float32), 3),
        "rank 20": (rng.normal(size=(1000, 20)).astype(np.float32) @ rng.normal(size=(20, 64)).astype(np.float32),
                    20),
        "zero": (np.zeros((5, 7)), 0),
        "one row": (rng.normal(size=(9,)), 1),
    }
    for name, (m, rank) in cases.items():
        d = direction(torch.from_numpy(np.asarray(m, np.float32)), 1e-4)
        assert d.shape == m.shape
        assert float(torch.linalg.norm(d)) == pytest.approx(np.sqrt(rank), abs=1e-6), name
        np.testing.assert_allclose(d.numpy(), ref_direction(np.asarray(m, np.float32).astype(np.float64), 1e-4),
                                   atol=1e-6, err_msg=name)
        if rank > 0 and m.ndim == 2:  # an orthogonal factor: every singular value is 1 (or 0)
            s = np.linalg.svd(d.numpy(), compute_uv=False)
            np.testing.assert_allclose(s[:rank], 1.0, atol=1e-6)
            assert (s[rank:] < 1e-6).all(), name
    experts = torch.from_numpy(rng.normal(size=(3, 5, 4)))
    experts[1] = 0.0  # an expert no token reached
    norms = [float(torch.linalg.norm(e)) for e in direction(experts, 1e-4)]
    assert norms == pytest.approx([2.0, 0.0, 2.0], abs=1e-6)  # each expert's matrix apart


def test_damping_smooths_the_row_and_column_preconditioner():
    rng = np.random.default_rng(4)
    m = rng.normal(size=(6, 5)) * np.array([[100.0], [1.0], [1.0], [0.01], [1.0], [1.0]])  # rows of unequal scale
    plain_sign = ref_sign(m, 1e12)  # damping far above every row's mean square: P is M scaled, msign(M)
    u, _, vt = np.linalg.svd(m, full_matrices=False)
    np.testing.assert_allclose(plain_sign, u @ vt, atol=1e-9)
    t = torch.from_numpy(m.astype(np.float32))
    for damping in (1e-4, 1.0, 1e12):
        np.testing.assert_allclose(direction(t, damping).numpy(), ref_sign(m.astype(np.float32).astype(np.float64),
                                                                           damping), atol=1e-6)
    # A small damping equalizes the rows (the 100x row no longer dominates); a large one leaves msign(M).
    small, large = direction(t, 1e-4).numpy(), direction(t, 1e12).numpy()
    assert np.abs(small - large).max() > 0.1
    np.testing.assert_allclose(large, u @ vt, atol=1e-5)
    # Through a step: the damping a DimuonParams carries is the one applied.
    start = {"w": rng.normal(size=(6, 5)).astype(np.float32)}
    moved = []
    for damping in (1e-4, 10.0):
        engine = engine_with(start, 8)
        set_grads(engine, {"w": m.astype(np.float32)})
        engine.optim_step(types.DimuonParams(learning_rate=0.1, damping=damping))
        ref = Reference(start, 8)
        ref.step({"w": m.astype(np.float32)}, types.DimuonParams(learning_rate=0.1, damping=damping))
        np.testing.assert_allclose(weights_of(engine)["w"], ref.weights["w"], atol=1e-5)
        moved.append(weights_of(engine)["w"])
    assert np.abs(moved[0] - moved[1]).max() > 1e-2


def test_the_state_round_trip_continues_bitwise():
    rng = np.random.default_rng(5)
    start = {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
    first, second = gradients(rng), gradients(rng)
    hyper = types.DimuonParams(learning_rate=1e-2, grad_clip_norm=5.0)
    run = engine_with(start, 4)
    set_grads(run, first)
    run.optim_step(hyper)
    pending = gradients(rng)
    set_grads(run, pending)  # gradients pending at the save: they come back too
    saved = run.gather_state()
    assert saved is not None and set(saved.moments) == {f"{n}::momentum" for n in SHAPES}
    resumed = engine_with({n: np.zeros(s, np.float32) for n, s in SHAPES.items()}, 4)
    resumed.load(saved, {}, optimizer=True)
    assert resumed.steps == 1
    fresh = engine_with({n: np.zeros(s, np.float32) for n, s in SHAPES.items()}, 4)
    fresh.load(saved, {}, optimizer=False)  # weights only: momentum and step start afresh
    assert fresh.steps == 0 and not fresh.optimizer.state
    for engine in (run, resumed, fresh):
        for n, p in zip(engine.param_names, engine.params, strict=True):
            assert p.grad is not None
            p.grad.add_(torch.from_numpy(second[n]))  # onto the pending ones (zero on ``fresh``)
        engine.optim_step(hyper)
    for n, p, q, f in zip(run.param_names, run.params, resumed.params, fresh.params, strict=True):
        assert torch.equal(p, q), n
        assert torch.equal(run.optimizer.state[p]["momentum"], resumed.optimizer.state[q]["momentum"]), n
        assert not torch.equal(p, f), n  # without its momentum and pending gradients the run differs


def test_the_optimizer_is_fixed_and_bad_values_are_user_errors():
    engine = engine_with({"w": np.ones((3, 3), np.float32)}, 4)
    before = engine.params[0].detach().clone()
    engine.params[0].grad.fill_(1.0)  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match=r"created with optimizer=DimuonOptimizerConfig\(\) and steps with "
                                              r"DimuonParams, not AdamParams"):
        engine.optim_step(types.AdamParams())
    assert torch.equal(engine.params[0], before) and engine.params[0].grad.eq(1.0).all()  # untouched
    adam = TrainingEngine(None, [("w", torch.nn.Parameter(torch.ones(3, 3)))], SingleProcess(),  # type: ignore[arg-type]
                          microbatch_tokens=64, device=torch.device("cpu"))
    with pytest.raises(ValidationError, match=r"created with optimizer=AdamOptimizerConfig\(\)"):
        adam.optim_step(types.DimuonParams(learning_rate=1e-3))
    cases = [({"type": "dimuon", "learning_rate": 1e-3, "damping": 0.0}, "damping must be > 0"),
             ({"type": "dimuon", "learning_rate": 1e-3, "damping": -1.0}, "damping must be > 0"),
             ({"type": "dimuon", "learning_rate": -1e-3}, "learning_rate must be >= 0"),
             ({"type": "dimuon", "learning_rate": 1e-3, "beta1": 1.0}, r"beta1 must be in \[0, 1\)"),
             ({"type": "dimuon", "learning_rate": 1e-3, "rank_lr_correction_exponent": -0.1}, "must be >= 0"),
             ({"type": "dimuon", "learning_rate": float("nan")}, "must be a finite number"),
             ({"type": "dimuon", "learning_rate": 1e-3, "weight_decay": 0.1}, r"has no field\(s\) \['weight_decay'\]"),
             ({"type": "dimuon"}, "learning_rate is required"),
             ({"type": "sgd", "learning_rate": 1e-3}, "type 'sgd' are not served")]
    for raw, message in cases:
        with pytest.raises(ValidationError, match=message):
            optimizers.params_of(raw)
    # The SDK's spellings: its DimuonParams, and a raw OptimParamsBase with the two fields 0.38 dropped.
    tinker = pytest.importorskip("tinker")
    assert optimizers.params_of(tinker.DimuonParams(learning_rate=1e-3, beta1=0.5)) == types.DimuonParams(
        learning_rate=1e-3, beta1=0.5)
    from tinker.types.optimizer import OptimizerConfigBase, OptimParamsBase

    raw = OptimParamsBase(type="dimuon", learning_rate=1e-3, damping=1e-3, rank_lr_correction_exponent=0.0)
    assert optimizers.params_of(raw) == types.DimuonParams(learning_rate=1e-3, damping=1e-3,
                                                           rank_lr_correction_exponent=0.0)
    assert optimizers.config_of(tinker.DimuonOptimizerConfig()) == DIMUON
    assert optimizers.config_of(tinker.AdamOptimizerConfig()) == types.AdamOptimizerConfig()
    for config, message in [(OptimizerConfigBase(type="dimuon", version=2), "Dimuon version 2 is not served"),
                            (OptimizerConfigBase(type="lion"), "optimizer type 'lion' is not served"),
                            ({"type": "dimuon", "version": 1, "beta": 2}, "takes type and version only")]:
        with pytest.raises(ValidationError, match=message):
            optimizers.config_of(config)


# -- sessions -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("dimuon") / "m", seed=3)


def test_a_lora_session_steps_as_peft_with_the_reference(model_dir, tmp_path):
    """Two forward_backward + Dimuon steps of a LoRA session (rank 4: the correction applies) equal a PeftModel
    loaded from the session's initial adapter, its gradients stepped by the reference; the state saved then, loaded
    with its optimizer into a new session, gives the same third step."""
    from tests.test_lora import ce_loss, load, lora_params, peft_model

    model = load(model_dir)
    base = LoraBase(model, LogprobComputer(model, "torch"), model_dir=str(model_dir), microbatch_tokens=64)
    s = LoraSession("a" * 32, base, types.LoraConfig(rank=4, seed=11), base_model="tiny", optimizer=DIMUON)
    assert s.describe()["optimizer"] == {"type": "dimuon", "version": 1}
    oracle = peft_model(model_dir, s.save_weights(str(tmp_path), "init", base_model=str(model_dir)))
    params = lora_params(oracle)
    ours = dict(s.adapter.named_pairs())
    assert set(params) == set(ours)
    ref = Reference({n: p.detach().numpy() for n, p in params.items()}, rank=4)
    hyper = types.DimuonParams(learning_rate=2e-2, grad_clip_norm=0.5)
    rng = np.random.default_rng(1)
    for step in range(3):
        if step == 2:  # the third step on a session resumed from the state saved after two
            state = s.save_state(str(tmp_path), "two", base_model="tiny", seq_id=2)
            s = LoraSession("b" * 32, base, types.LoraConfig(rank=4, seed=99), base_model="tiny", optimizer=DIMUON)
            assert s.load_state(Path(state))["optimizer_steps"] == 2
            ours = dict(s.adapter.named_pairs())
        metrics, norm = _step_both(s, oracle, params, ref, hyper, make_batch(rng, 3), ce_loss)
        assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
        assert metrics["learning_rate:mean"] == pytest.approx(2e-2 * 8 ** 0.175) and metrics["step:max"] == step + 1
        for n, w in ref.weights.items():
            np.testing.assert_allclose(ours[n].detach().numpy(), w, rtol=0, atol=1e-5, err_msg=f"step {step}: {n}")
    assert all(np.abs(ref.weights[n]).max() > 0 for n in ref.weights if n.endswith("lora_B.weight"))  # it trained


def _step_both(session: Any, oracle: torch.nn.Module, params: dict[str, torch.nn.Parameter], ref: Reference,
               hyper: types.DimuonParams, data: list, loss: Any) -> tuple[dict[str, float], float]:
    """One forward_backward + Dimuon step of ``session`` and of ``ref`` on the oracle's gradients of ``loss``; the
    oracle's ``params`` then take the reference's weights. Returns the session's metrics and the reference's norm."""
    session.run_loss(data, "cross_entropy", None, backward=True)
    loss(oracle, data).backward()
    grads = {n: p.grad.detach().numpy() for n, p in params.items()}
    metrics = session.optim_step(hyper).metrics
    norm, _ = ref.step(grads, hyper)
    oracle.zero_grad()
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(torch.from_numpy(ref.weights[n]))
    return metrics, norm


def test_a_full_session_steps_as_the_plain_model_with_the_reference(model_dir):
    """Every weight of a full-parameter session (matrices, the 1-D norms) after two Dimuon steps equals a plain
    transformers model's stepped by the reference (rank 32: no correction)."""
    model = load_reference(model_dir)
    session = TrainingSession("c" * 32, load_reference(model_dir).requires_grad_(True), base_dir=str(model_dir),
                              microbatch_tokens=64, logprobs=LogprobComputer(model, "torch"),
                              blank_model=lambda: load_reference(model_dir), optimizer=DIMUON)
    plain = dict(model.named_parameters())
    ref = Reference({n: p.detach().numpy() for n, p in plain.items()}, rank=32)
    hyper = types.DimuonParams(learning_rate=1e-2, grad_clip_norm=2.0, beta1=0.9)
    rng = np.random.default_rng(2)
    for _ in range(2):
        metrics, norm = _step_both(session, model, plain, ref, hyper, make_batch(rng, 3), reference_loss)
        assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5) and metrics["learning_rate:mean"] == 1e-2
    ours = dict(session.model.named_parameters())
    assert any(p.dim() == 1 for p in ours.values())
    for n, w in ref.weights.items():
        np.testing.assert_allclose(ours[n].detach().numpy(), w, rtol=0, atol=1e-5, err_msg=n)
    start = dict(load_reference(model_dir).named_parameters())
    assert all(float((ours[n] - start[n]).detach().abs().max()) > 1e-3 for n in ours)  # every weight moved


def test_a_shard_group_refuses_dimuon_where_a_matrix_is_split(model_dir):
    """Full-parameter sessions (FSDP shards) and adapters on an expert-parallel group hold pieces of matrices: Dimuon is
    refused there at creation, one user error, before anything is made. (Replicated adapters on a group take it:
    tests/test_sharded_lora.py.)"""
    from types import SimpleNamespace

    from tinkerq.settings import Settings
    from tinkerq.worker.training.sessions import SessionFactory

    model = load_reference(model_dir)
    adapter = types.LoraConfig(rank=4, seed=1)
    full = "full-parameter sessions"
    for expert_parallel, lora, what in [(False, None, full), (True, None, full),
                                        (True, adapter, "LoRA sessions on an expert-parallel")]:
        shards = SimpleNamespace(expert_parallel=expert_parallel)  # make() refuses before it reaches the group
        factory = SessionFactory(Settings(), model, str(model_dir), LogprobComputer(model, "torch"), "tiny", "w1",
                                 shards, lambda *_: None)  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match=f"Dimuon optimizer is not served for {what}"):
            factory.make("d" * 32, lora, {}, lambda _: None, optimizer={"type": "dimuon", "version": 1})
