"""LoRA on a shard group: the base sharded once (FSDP2, frozen), each tenant's adapter and AdamW state on every rank.

Rank 0 runs in this process (its :class:`ShardHost`, driven as the worker's compute loop drives it); ranks 1..N-1
are real ``tinkerq worker --shards N --rank R`` processes. Every number is compared with the same sessions on one
unsharded process (itself checked against PEFT and plain PyTorch in test_lora.py / test_families_lora.py), after
several forward_backward + optim_step rounds with variable-length datums, alone and in mixed passes.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import build_tiny_llama, make_batch
from tinkerq import types
from tinkerq.errors import NonFiniteError, ValidationError
from tinkerq.launcher.processes import free_port, start_process, worker_command
from tinkerq.settings import Settings
from tinkerq.worker.loading.models import load_causal_lm
from tinkerq.worker.lora.batch import LossItem
from tinkerq.worker.lora.session import LoraBase, LoraSession
from tinkerq.worker.sharding.follower import build_host
from tinkerq.worker.sharding.host import ShardHost
from tinkerq.worker.training.logprobs import LogprobComputer

pytestmark = pytest.mark.timeout(600)

MICROBATCH_TOKENS = 64
TOLERANCE = 1e-5
GRAD_TOLERANCE = 4e-5  # relative to the largest element: _assert_same_grads
# eps 1e-3 as in test_families_lora.py: with a tiny eps AdamW turns gradient elements at rounding-noise level (A's
# first gradients, from B near zero) into full +-lr steps, so any reordering of a sum shows as ~1e-5 in the weights.
# The gradients themselves are compared before every step (_assert_same_grads).
ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0, eps=1e-3)
CONFIGS = [  # tenants with different targets: every rank's backward must still join the same collectives
    types.LoraConfig(rank=8, seed=1),
    types.LoraConfig(rank=4, seed=2, train_mlp=False),
    types.LoraConfig(rank=8, seed=3, train_attn=False, train_mlp=False),  # unembed only
]


class Group:
    """Rank 0 here, ranks 1..N-1 as `tinkerq worker` processes."""

    def __init__(self, model_dir: Path, shards: int, logs: Path, expert_parallel: bool = False) -> None:
        self.model_dir = model_dir
        self.expert_parallel = expert_parallel
        address = f"tcp://127.0.0.1:{free_port()}"
        env = {"TINKERQ_MICROBATCH_TOKENS": str(MICROBATCH_TOKENS), "TINKERQ_COLLECTIVE_TIMEOUT_S": "120",
               "TINKERQ_RENDEZVOUS_TIMEOUT_S": "120", "TINKERQ_LOSS_BACKEND": "torch"}
        ep = ["--expert-parallel"] if expert_parallel else []
        self.procs = [start_process(worker_command(str(model_dir), threads=1, extra=[
            "--shards", str(shards), "--rank", str(rank), "--rendezvous", address, *ep]), logs / f"rank{rank}.log",
            env) for rank in range(1, shards)]
        settings = Settings.from_env({}, shards=shards, shard_rank=0, rendezvous=address,
                                     microbatch_tokens=MICROBATCH_TOKENS, expert_parallel=expert_parallel,
                                     collective_timeout_s=120.0, rendezvous_timeout_s=120.0, loss_backend="torch")
        self.host: ShardHost = build_host(str(model_dir), settings)
        self.host.group.form()

    def stop(self) -> None:
        self.host.shutdown()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def model_dir(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"sharded-lora-{request.param}")
    if request.param == "llama":
        return build_tiny_llama(out, seed=3)
    from tinkerq.recipes.families import build_family

    return build_family(request.param, out, seed=3)


@pytest.fixture(scope="module", params=["2", "4", "4-ep"])
def group(request, model_dir, tmp_path_factory) -> Iterator[Group]:
    """2 ranks, and 4: FSDP2 alone for the dense model, expert parallel ("4-ep") for the MoE one (its experts and the
    tenants' per-expert factors split by expert, worker/sharding/experts.py; the MoE model's FSDP2-only layout is
    the 2-rank group's)."""
    ranks, _, ep = request.param.partition("-")
    dense = model_dir.name.startswith("sharded-lora-llama")
    if ranks == "4" and bool(ep) == dense:
        pytest.skip("4 ranks: FSDP2 alone for the dense model, expert parallel for the MoE one")
    g = Group(model_dir, int(ranks), tmp_path_factory.mktemp("shard-logs"), expert_parallel=bool(ep))
    yield g
    g.stop()


def _alone_base(group: Group) -> LoraBase:
    """The same base on this process, unsharded, loaded from the files (the group's ranks hold only their shards):
    the reference."""
    model = load_causal_lm(str(group.model_dir))
    return LoraBase(model, LogprobComputer(model, "torch"), model_dir="/nonexistent",
                    microbatch_tokens=MICROBATCH_TOKENS)


def _batches(seed: int, rounds: int) -> list[list[types.Datum]]:
    rng = np.random.default_rng(seed)
    return [make_batch(rng, int(rng.integers(1, 8)), min_len=3, max_len=30) for _ in range(rounds)]


def _assert_close(sharded: types.ForwardBackwardOutput, alone: types.ForwardBackwardOutput) -> None:
    assert abs(sharded.metrics["loss:sum"] - alone.metrics["loss:sum"]) <= TOLERANCE * max(
        1.0, abs(alone.metrics["loss:sum"]))
    assert len(sharded.loss_fn_outputs) == len(alone.loss_fn_outputs)
    for a, b in zip(sharded.loss_fn_outputs, alone.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=TOLERANCE)


def _assert_same_grads(one: LoraSession, other: LoraSession) -> None:
    """The pending gradients (rank 0's: summed over the ranks) equal one process's, relative to their scale.

    The ranks' partial sums are added in another order than one process adds them (and with other intra-op thread
    counts): a CI run saw 1.03e-5 of the largest element on qwen3_moe, so the bound is 4e-5 (float32 rounding over a
    few hundred terms), far below what a dropped datum or a rank counted twice changes."""
    for g, h in zip(_whole_grads(one), _whole_grads(other), strict=True):
        assert float((g - h).abs().max()) <= GRAD_TOLERANCE * max(1.0, float(h.abs().max()))


def _whole_grads(session: LoraSession) -> list[torch.Tensor]:
    """The pending gradients, whole: gathered from every rank where per-expert factors are sharded."""
    if not session.sharded:
        return session.engine.grads()
    saved = session._run("gather_state")
    return [saved.grads[n] if saved.grads else torch.zeros(shape)
            for n, shape in zip(session.engine.param_names, session.engine.shapes().values(), strict=True)]


def _max_diff(one: LoraSession, other: LoraSession) -> float:
    a, b = one._whole_weights(), other._whole_weights()
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).detach().abs().max()) for n in a)


def _open(group: Group, tag: str) -> tuple[list[LoraSession], list[LoraSession]]:
    alone_base = _alone_base(group)
    sharded = [group.host.open_lora(f"{tag}-{i}", c, base_model="tiny") for i, c in enumerate(CONFIGS)]
    alone = [LoraSession(f"alone-{tag}-{i}", alone_base, c, base_model="tiny") for i, c in enumerate(CONFIGS)]
    return sharded, alone


def test_lora_sessions_alone_equal_one_process(group):
    """Each session's own forward_backward (its datums split over the ranks) + optim_step, several rounds."""
    sharded, alone = _open(group, "alone")
    try:
        for i, (s, a) in enumerate(zip(sharded, alone, strict=True)):
            for batch in _batches(10 + i, 3):
                _assert_close(s.run_loss(batch, "cross_entropy", None, backward=True),
                              a.run_loss(batch, "cross_entropy", None, backward=True))
                _assert_same_grads(s, a)
                s_step, a_step = s.optim_step(ADAM), a.optim_step(ADAM)
                assert s_step.metrics["grad_norm:mean"] == pytest.approx(a_step.metrics["grad_norm:mean"], rel=1e-5)
            assert _max_diff(s, a) <= TOLERANCE
            # a forward afterwards sees the trained adapter on every rank alike
            probe = _batches(99, 1)[0]
            _assert_close(s.run_loss(probe, "cross_entropy", None, backward=False),
                          a.run_loss(probe, "cross_entropy", None, backward=False))
    finally:
        for s in sharded:
            s.close()
    assert not group.host.lora_sessions  # closed on rank 0; the followers were told in the same command


def test_mixed_tenant_passes_on_the_group_equal_one_process(group):
    """The three tenants' requests in one mixed pass per round (what the compute loop runs), on the group and on one
    process; a forward-only pass too."""
    sharded, alone = _open(group, "mixed")
    try:
        base = sharded[0].pass_group
        for round_ in range(3):
            batches = [_batches(100 * round_ + i, 1)[0] for i in range(len(CONFIGS))]
            items = [LossItem(s, b, "cross_entropy", None) for s, b in zip(sharded, batches, strict=True)]
            base.run_pass(items, True)
            refs = [LossItem(a, b, "cross_entropy", None) for a, b in zip(alone, batches, strict=True)]
            alone[0].pass_group.run_pass(refs, True)
            for item, ref in zip(items, refs, strict=True):
                assert item.error is None and ref.error is None
                _assert_close(item.output, ref.output)
            for s, a in zip(sharded, alone, strict=True):
                _assert_same_grads(s, a)
                s.optim_step(ADAM)
                a.optim_step(ADAM)
        for s, a in zip(sharded, alone, strict=True):
            assert _max_diff(s, a) <= TOLERANCE
        probe = [_batches(7, 1)[0] for _ in CONFIGS]
        items = [LossItem(s, b, "importance_sampling", None) for s, b in zip(sharded, _with_rl(probe), strict=True)]
        refs = [LossItem(a, b, "importance_sampling", None) for a, b in zip(alone, _with_rl(probe), strict=True)]
        base.run_pass(items, False)
        alone[0].pass_group.run_pass(refs, False)
        for item, ref in zip(items, refs, strict=True):
            _assert_close(item.output, ref.output)
    finally:
        for s in sharded:
            s.close()


def _with_rl(batches: list[list[types.Datum]]) -> list[list[types.Datum]]:
    """The same datums with importance-sampling inputs (sampler logprobs, advantages)."""
    rng = np.random.default_rng(5)
    out = []
    for batch in batches:
        rows = []
        for d in batch:
            n = d.model_input.length
            rows.append(types.Datum(model_input=d.model_input, loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "logprobs": types.TensorData.from_numpy(rng.normal(-2.0, 0.5, n).astype(np.float32)),
                "advantages": types.TensorData.from_numpy(rng.normal(0.0, 1.0, n).astype(np.float32))}))
        out.append(rows)
    return out


def test_dimuon_on_the_group_equals_one_process_and_an_expert_parallel_group_refuses_it(group):
    """Dimuon (docs/optimizers.md) on replicated adapters: every rank takes the same step, and the weights equal one
    process's after several rounds. On an expert-parallel group the per-expert factors are split by expert, so the
    session is refused, by every rank alike, and the group goes on serving."""
    dimuon, config = types.DimuonOptimizerConfig(), CONFIGS[0]
    hyper = types.DimuonParams(learning_rate=1e-2, grad_clip_norm=5.0, beta1=0.9)
    if group.expert_parallel:
        with pytest.raises(ValidationError, match="Dimuon needs every trained matrix whole on a rank"):
            group.host.open_lora("dimuon-ep", config, base_model="tiny", optimizer=dimuon)
        assert "dimuon-ep" not in group.host.sessions
        group.host.run("ping")  # every rank agreed; the group is healthy
        return
    sharded = group.host.open_lora("dimuon", config, base_model="tiny", optimizer=dimuon)
    alone = LoraSession("alone-dimuon", _alone_base(group), config, base_model="tiny", optimizer=dimuon)
    try:
        for batch in _batches(30, 3):
            _assert_close(sharded.run_loss(batch, "cross_entropy", None, backward=True),
                          alone.run_loss(batch, "cross_entropy", None, backward=True))
            _assert_same_grads(sharded, alone)
            s_step, a_step = sharded.optim_step(hyper).metrics, alone.optim_step(hyper).metrics
            assert s_step["grad_norm:mean"] == pytest.approx(a_step["grad_norm:mean"], rel=1e-5)
            assert s_step["learning_rate:mean"] == a_step["learning_rate:mean"] == pytest.approx(1e-2 * 4 ** 0.175)
        assert _max_diff(sharded, alone) <= TOLERANCE
        probe = _batches(98, 1)[0]
        _assert_close(sharded.run_loss(probe, "cross_entropy", None, backward=False),
                      alone.run_loss(probe, "cross_entropy", None, backward=False))
    finally:
        sharded.close()


def test_a_non_finite_loss_in_one_tenant_is_refused_by_every_rank_and_spares_the_others(group):
    sharded, alone = _open(group, "nan")
    try:
        good = _batches(3, 2)
        bad = [types.Datum(model_input=d.model_input, loss_fn_inputs={
            **d.loss_fn_inputs, "weights": types.TensorData.from_numpy(
                np.full(d.model_input.length, np.nan, dtype=np.float32))}) for d in _batches(4, 1)[0]]
        items = [LossItem(sharded[0], good[0], "cross_entropy", None), LossItem(sharded[1], bad, "cross_entropy", None)]
        sharded[0].pass_group.run_pass(items, True)
        assert isinstance(items[1].error, NonFiniteError) and "loss is nan" in items[1].error.message
        assert items[0].error is None
        ref = alone[0].run_loss(good[0], "cross_entropy", None, backward=True)
        _assert_close(items[0].output, ref)
        # the refused tenant's adapter got nothing: its next step equals a fresh session's
        assert all(float(g.abs().max()) == 0.0 for g in sharded[1].engine.grads())
    finally:
        for s in sharded:
            s.close()


def test_merged_weights_saved_on_the_group_are_one_process_merged_weights(group, tmp_path):
    """Rank 0 holds no whole base (each rank streams its shards): a merged save reads it from the files."""
    from safetensors.torch import load_file

    sharded, alone = _open(group, "merged")
    try:
        s, a = sharded[0], alone[0]
        batch = _batches(30, 1)[0]
        s.run_loss(batch, "cross_entropy", None, backward=True)
        s.optim_step(ADAM)
        a.run_loss(batch, "cross_entropy", None, backward=True)
        a.optim_step(ADAM)
        ours = Path(s.save_weights(str(tmp_path), "m-group", base_model="tiny", merged=True)) / "merged"
        theirs = Path(a.save_weights(str(tmp_path), "m-alone", base_model="tiny", merged=True)) / "merged"
        got, want = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
        assert got.keys() == want.keys()
        base = load_file(Path(group.model_dir) / "model.safetensors")
        changed = 0
        for name, tensor in want.items():
            assert float((got[name] - tensor).abs().max()) <= TOLERANCE, name
            changed += int(name in base and not torch.equal(tensor, base[name]))
        assert changed > 0  # the adapter was merged in
    finally:
        for s in sharded:
            s.close()


def test_lora_state_saved_on_the_group_resumes_on_one_process(group, tmp_path):
    sharded, alone = _open(group, "state")
    try:
        s, a = sharded[0], alone[0]
        for batch in _batches(20, 2):
            s.run_loss(batch, "cross_entropy", None, backward=True)
            s.optim_step(ADAM)
            a.run_loss(batch, "cross_entropy", None, backward=True)
            a.optim_step(ADAM)
        path = Path(s.save_state(str(tmp_path), "ckpt", base_model="tiny", seq_id=5))
        fresh = LoraSession("fresh", a.base, CONFIGS[0], base_model="tiny")
        fresh.load_state(path)
        assert _max_diff(fresh, a) <= TOLERANCE
        # and back: the group loads what one process saved, then both take the same step
        path2 = Path(a.save_state(str(tmp_path), "ckpt2", base_model="tiny", seq_id=6))
        s.load_state(path2)
        batch = _batches(21, 1)[0]
        _assert_close(s.run_loss(batch, "cross_entropy", None, backward=True),
                      a.run_loss(batch, "cross_entropy", None, backward=True))
        s.optim_step(ADAM)
        a.optim_step(ADAM)
        assert _max_diff(s, a) <= TOLERANCE
    finally:
        for s in sharded:
            s.close()


def test_the_base_is_sharded_once_and_adapters_are_whole_on_each_rank(group):
    sharded, _ = _open(group, "memory")
    try:
        base = sharded[0].pass_group
        from torch.distributed.tensor import DTensor

        layer_params = [p for n, p in base.model.named_parameters() if ".layers." in n]
        assert layer_params and all(isinstance(p, DTensor) for p in layer_params)
        whole = sum(p.numel() for p in layer_params)
        local = sum(p.to_local().numel() for p in layer_params)
        assert local <= whole / group.host.group.world + 64 * len(layer_params)  # 1/N, plus padding of uneven dims
        assert not any(p.requires_grad for p in base.model.parameters())
        world = group.host.group.world
        if not group.expert_parallel:
            # whole copies (a follower's copy that drifted would change its rows' logprobs: the tests above compare)
            assert all(not isinstance(p, DTensor) for p in sharded[0].engine.params)
            return
        # Expert parallel: each rank holds E/N experts of the base, and of each adapter's per-expert factors (w1/w3's
        # B, w2's A); the shared factors and every other target's are whole on every rank.
        experts = [m for m in base.model.modules() if hasattr(m, "_tinkerq_ep")]
        assert experts and all(m.gate_up_proj.to_local().shape[0] == m.num_experts // world for m in experts)
        for s in sharded:
            for name, p in s.adapter.named_pairs():
                per_expert = p.dim() == 3 and p.shape[0] > 1
                assert isinstance(p, DTensor) == per_expert, name
                if per_expert:
                    assert p.to_local().shape[0] == p.shape[0] // world, name
        assert any(isinstance(p, DTensor) for p in sharded[0].engine.params)  # CONFIGS[0] adapts the experts
        from tinkerq.worker.lora.adapter import Adapter

        whole_bytes = Adapter(base.targets(CONFIGS[0]), CONFIGS[0], "cpu").state_bytes()
        assert sharded[0].adapter.state_bytes() < whole_bytes  # rank 0 keeps only its experts' factors
        # A snapshot is frozen: training on does not change it (its factors gathered whole, then its own copies).
        snapshot = sharded[0].snapshot()
        before = {n: (a.clone(), b.clone()) for n, (a, b) in snapshot.pairs.items()}
        sharded[0].run_loss(_batches(41, 1)[0], "cross_entropy", None, backward=True)
        sharded[0].optim_step(ADAM)
        assert all(torch.equal(snapshot.pairs[n][0], a) and torch.equal(snapshot.pairs[n][1], b)
                   for n, (a, b) in before.items())
        assert _max_diff(sharded[0], LoraSession("fresh", _alone_base(group), CONFIGS[0], base_model="tiny")) > 0
    finally:
        for s in sharded:
            s.close()


def _sample(model, adapters, prompts, *, seed: int, include_prompt: bool = False):
    """Every (adapter, prompt) job in one engine (continuous batching: their rows share each forward)."""
    from tinkerq.worker.sampling.engine import SampleJob, StopRule
    from tinkerq.worker.sampling.torch_engine import TorchEngine

    engine, done, prompt_lps = TorchEngine(max_rows=64), {}, {}
    for i, (adapter, prompt) in enumerate(zip(adapters, prompts, strict=True)):
        job = SampleJob(model=model, model_key="base", prompt=prompt, num_samples=2,
                        params=types.SamplingParams(temperature=1.0, seed=seed + i), stop=StopRule([], [], None),
                        max_tokens=6, adapter=adapter)
        job.on_done = lambda seqs, err, i=i: done.__setitem__(i, (seqs, err))
        if include_prompt:
            job.on_prompt_logprobs = lambda lps, i=i: prompt_lps.__setitem__(i, lps)
        engine.submit(job)
    engine.run_until_idle()
    engine.close()
    assert all(err is None for _, err in done.values()), done
    return [done[i][0] for i in range(len(prompts))], [prompt_lps.get(i) for i in range(len(prompts))]


def test_the_group_samples_its_lora_snapshots_over_the_sharded_base(group):
    """Rank 0's engine samples the base and two tenants' adapters on the sharded base (each forward on every
    rank): the same tokens as one process over the whole base, and logprobs equal to the group's own forward."""
    sharded, alone = _open(group, "sample")
    host = group.host
    forwards = []
    run = host.run
    host.run = lambda op, **a: (forwards.append(op), run(op, **a))[1]  # count what rank 0 sends the group
    try:
        for s, a in zip(sharded, alone, strict=True):  # trained a little, so each adapter changes the samples
            batch = _batches(30, 1)[0]
            s.run_loss(batch, "cross_entropy", None, backward=True)
            a.run_loss(batch, "cross_entropy", None, backward=True)
            s.optim_step(ADAM)
            a.optim_step(ADAM)
        rng = np.random.default_rng(8)
        prompts = [rng.integers(3, 50, size=n).tolist() for n in (5, 9, 5)]  # ids every family has
        model = host.sampling_model()
        got, got_prompt = _sample(model, [None, sharded[0].snapshot(), sharded[1].snapshot()], prompts, seed=40,
                                  include_prompt=True)
        assert forwards.count("sample_forward") >= 6  # prefills and decode steps ran on every rank
        whole = alone[0].pass_group
        want, want_prompt = _sample(whole.model, [None, alone[0].snapshot(), alone[1].snapshot()], prompts, seed=40,
                                    include_prompt=True)
        for g, w in zip(got, want, strict=True):
            assert [q.tokens for q in g] == [q.tokens for q in w]
            for x, y in zip(g, w, strict=True):
                np.testing.assert_allclose(x.logprobs, y.logprobs, atol=TOLERANCE)
        for g, w in zip(got_prompt, want_prompt, strict=True):
            np.testing.assert_allclose(g, w, atol=TOLERANCE)  # (the first is NaN in both)
        # Logprobs equal the forward's: each sampled sequence scored by the group's forward under its adapter.
        for session, prompt, seqs in zip(sharded[:2], prompts[1:], got[1:], strict=True):
            for seq in seqs:
                tokens = prompt + seq.tokens
                datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                    loss_fn_inputs={"target_tokens": tokens[1:],
                                                    "weights": np.ones(len(tokens) - 1, dtype=np.float32)})
                out = session.run_loss([datum], "cross_entropy", None, backward=False)
                scored = out.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1:]
                np.testing.assert_allclose(seq.logprobs, scored, atol=TOLERANCE)
    finally:
        host.run = run
        for s in sharded:
            s.close()

