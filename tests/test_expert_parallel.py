"""Expert parallelism on a shard group (worker/sharding/experts.py): each rank holds E/N of every MoE layer's routed
experts, and tokens travel to them and back by all-to-all.

In-process groups (gloo, torch.multiprocessing.spawn; tests/expert_ranks.py) check every MoE family against the whole
model loaded by ``from_pretrained``: each rank's logprobs, and every parameter's whole gradient (a rank's experts get
every rank's tokens), also when every token is routed to one rank's experts. Real ``tinkerq worker`` processes check
the served path: a 2-rank expert-parallel group trains a full session as one unsharded worker does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import expert_ranks
from tests.conftest import WORKER_MICROBATCH_TOKENS, start_named_worker
from tests.helpers import build_tiny_llama, make_batch, max_weight_diff
from tinkerq import types
from tinkerq.errors import ValidationError
from tinkerq.launcher.processes import free_port
from tinkerq.recipes.families import FAMILIES, MOE_FAMILIES, TEXT_OF_VISION_LANGUAGE, build_family, build_model
from tinkerq.settings import Settings, SettingsError
from tinkerq.worker.loading import support
from tinkerq.worker.loading.models import load_skeleton
from tinkerq.worker.sharding.experts import check_expert_parallel

pytestmark = pytest.mark.timeout(600)
ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0)


def _spawn(world: int, paths: list[str], out: Path, skew: bool = False, checkpointing: bool = False) -> list[dict]:
    torch.multiprocessing.spawn(expert_ranks.compare, args=(world, free_port(), paths, str(out), skew, checkpointing),
                                nprocs=world)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _check(ranks: list[dict], world: int) -> None:
    for rank, found in enumerate(ranks):
        for path, f in found.items():
            name = Path(path).name
            assert f["experts_modules"] >= 1, (rank, name)
            assert f["weights_same"], (rank, name)  # the files' experts, each on its rank
            assert f["logprob_diff"] < 1e-5, (rank, name, f)
            assert f["grad_diff"] < 1e-5, (rank, name, f)
            # Each rank holds 1/world of the experts and an FSDP shard of the rest.
            assert f["local"] < f["whole"] and f["expert_local"] > 0, (rank, name, f)
    for path in ranks[0]:
        assert sum(r[path]["local"] for r in ranks) == ranks[0][path]["whole"]  # no expert held twice or skipped


# The MoE families an expert-parallel group serves (worker/loading/support.py refuses the others at group start).
# (the vision-language checkpoints of TEXT_OF_VISION_LANGUAGE: refused when a shard group's ranks build the model,
# tests/test_streaming_load.py)
EP_FAMILIES = [f for f in MOE_FAMILIES if all(support.refusal(FAMILIES[f][0], p) is None
                                               for p in ("shard_group", "expert_parallel"))
               and f not in TEXT_OF_VISION_LANGUAGE]


def test_a_family_whose_expert_parallel_path_is_not_proven_is_refused_at_group_start():
    refused = [f for f in MOE_FAMILIES if f not in EP_FAMILIES]
    assert refused == ["inkling", "inkling2", "deepseek_v4", "kimi_linear", "kimi_k25"]
    with pytest.raises(ValidationError, match=r"a shard group of KimiLinearForCausalLM is not served: .+; serve it "
                                              r"on a single worker"):
        check_expert_parallel(build_model("kimi_linear"), 2)
    with pytest.raises(ValidationError, match=r"expert parallelism of InklingForCausalLM is not served: .+; start "
                                              r"the shard group without --expert-parallel"):
        check_expert_parallel(build_model("inkling"), 2)


def test_every_moe_family_matches_the_whole_model_on_two_ranks(tmp_path):
    models = [str(build_family(f, tmp_path / f, seed=3)) for f in EP_FAMILIES]
    ranks = _spawn(2, models, tmp_path)
    _check(ranks, 2)
    for path in models:  # both ranks computed expert rows for the other's tokens too
        assert all(rows > 0 for r in ranks for rows in r[path]["rows"])


def test_four_ranks_and_every_token_to_one_ranks_experts(tmp_path):
    """8 experts over 4 ranks (2 each); then every token routed into rank 0's experts, with the decoder layers
    checkpointed: the other ranks compute nothing for that layer, and still join every collective, in the forward
    and again in the backward's recomputation (no deadlock), and the numbers still match."""
    model = str(build_family("qwen3_moe", tmp_path / "qwen3_moe", seed=5))
    (tmp_path / "even").mkdir()
    _check(_spawn(4, [model], tmp_path / "even"), 4)
    (tmp_path / "skew").mkdir()
    ranks = _spawn(4, [model], tmp_path / "skew", skew=True, checkpointing=True)
    _check(ranks, 4)
    assert ranks[0][model]["rows"][0] > 0 and all(r[model]["rows"] == [0] for r in ranks[1:]), ranks


def _spawn_lora(world: int, paths: list[str], out: Path, skew: bool = False, checkpointing: bool = False,
                kept: bool = False) -> dict:
    torch.multiprocessing.spawn(expert_ranks.lora_compare, nprocs=world,
                                args=(world, free_port(), paths, str(out), skew, checkpointing, kept))
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


def _assert_lora_equal(ranks: dict, paths: list[str]) -> None:
    for path in paths:
        zero = ranks[0][path]
        assert zero["logprob_diff"] < 1e-5 and zero["grad_diff"] < 4e-5 and zero["weight_diff"] < 1e-5, (path, zero)
        assert zero["trained_logprob_diff"] < 1e-5, (path, zero)
        # Two of the three tenants adapt the experts: their w1/w3 B and w2 A live with the experts on each rank.
        assert all(r[path]["sharded_factors"] > 0 and r[path]["sharded_factors"] % 2 == 0
                   for r in ranks.values()), path


def test_lora_tenants_on_an_expert_parallel_base_equal_the_whole_model(tmp_path):
    """Three LoRA tenants (expert factors of rank 4 and 8, one adapting no expert) in one mixed pass over an
    expert-parallel base, each tenant's per-expert factors split with the experts: every MoE family on 2 ranks, and
    Qwen3-MoE on 4 ranks with every token routed into rank 0's experts and the layers checkpointed (the other ranks
    receive no rows, and still join every collective). Outputs, every factor's whole gradient and the factors after
    an AdamW step equal the same tenants on the whole model loaded by ``from_pretrained``."""
    models = [str(build_family(f, tmp_path / f, seed=3)) for f in EP_FAMILIES]
    (tmp_path / "two").mkdir()
    (tmp_path / "skew").mkdir()
    runs = [(_spawn_lora(2, models, tmp_path / "two"), models),
            (_spawn_lora(4, models[:1], tmp_path / "skew", skew=True, checkpointing=True), models[:1])]
    for ranks, paths in runs:
        _assert_lora_equal(ranks, paths)
        assert all(r[p]["kept_modules"] == 0 for r in ranks.values() for p in paths)
    skewed = runs[1][0]
    assert skewed[0][models[0]]["rows"][0] > 0 and all(skewed[r][models[0]]["rows"] == [0] for r in (1, 2, 3))


def test_lora_over_an_expert_parallel_base_kept_quantized_equals_the_dequantized_model(tmp_path):
    """--quantized-base keep on an expert-parallel group: each rank keeps only its experts' stored parts (block FP8,
    INT4, MXFP4 as the model makers publish them: recipes/published.py), read from the files, and dequantizes them
    when used; the rest is dequantized into FSDP shards. Three LoRA tenants train as on the whole model
    dequantized on load: every layout on 2 ranks, DeepSeek's FP8 on 4 with every token routed into rank 0's experts
    and the layers checkpointed."""
    from tinkerq.recipes.published import build_published

    paths = [str(build_published(layout, tmp_path / layout)) for layout in ("deepseek_v3-fp8", "kimi_k2-int4",
                                                                              "gpt_oss-mxfp4")]
    (tmp_path / "two").mkdir()
    (tmp_path / "skew").mkdir()
    two = _spawn_lora(2, paths, tmp_path / "two", kept=True)
    _assert_lora_equal(two, paths)
    four = _spawn_lora(4, paths[:1], tmp_path / "skew", skew=True, checkpointing=True, kept=True)
    _assert_lora_equal(four, paths[:1])
    # Each rank holds only its own experts' stored parts: half of them on 2 ranks, a quarter on 4.
    assert all(r[p]["kept_modules"] >= 1 for r in two.values() for p in paths)
    assert {r[paths[0]]["stored_bytes"] for r in two.values()} == {2 * r[paths[0]]["stored_bytes"]
                                                                   for r in four.values()}
    # The worker admits a group's first LoRA session with that base counted from the files' headers: each rank's
    # stored experts and its share of the rest (FSDP pads uneven rows: a little more held than 1/N).
    for found in [r[p] for r in two.values() for p in paths] + [r[paths[0]] for r in four.values()]:
        assert 0.95 * found["base_admitted"] <= found["base_held"] <= 1.05 * found["base_admitted"], found


def test_expert_parallel_is_refused_where_it_cannot_apply(tmp_path):
    with pytest.raises(SettingsError, match="--shards N"):
        Settings.from_env({"TINKERQ_EXPERT_PARALLEL": "1"})
    group = {"TINKERQ_SHARDS": "2", "TINKERQ_RENDEZVOUS": "tcp://127.0.0.1:29500"}
    assert Settings.from_env({"TINKERQ_EXPERT_PARALLEL": "on", **group}).expert_parallel is True
    assert Settings.from_env(group).expert_parallel is False
    with pytest.raises(SettingsError, match="TINKERQ_EXPERT_PARALLEL='maybe'"):
        Settings.from_env({"TINKERQ_EXPERT_PARALLEL": "maybe", **group})
    # A group keeps a quantized base only split by expert (each shard its own experts as stored).
    with pytest.raises(SettingsError, match="add --expert-parallel"):
        Settings.from_env({"TINKERQ_QUANTIZED_BASE": "keep", **group})
    assert Settings.from_env({"TINKERQ_QUANTIZED_BASE": "keep", "TINKERQ_EXPERT_PARALLEL": "1", **group}).shards == 2
    dense = load_skeleton(str(build_tiny_llama(tmp_path / "llama")))
    with pytest.raises(ValidationError, match="has no routed experts"):
        check_expert_parallel(dense, 2)
    moe = load_skeleton(str(build_family("qwen3_moe", tmp_path / "moe", seed=1)))
    with pytest.raises(ValidationError, match="8 experts do not split evenly over 3 ranks"):
        check_expert_parallel(moe, 3)
    assert len(check_expert_parallel(moe, 4)) == 1


def test_the_worker_command_refuses_expert_parallel_where_it_cannot_apply(redis_url, tmp_path):
    """At start-up, before any rank waits for the others: exit status 2 and a line that says what to do."""
    from tests.test_sharding import _exits_with

    dense = build_tiny_llama(tmp_path / "llama")
    group = ["--shards", "2", "--rank", "1", "--rendezvous", f"tcp://127.0.0.1:{free_port()}"]
    for extra, words in ((["--expert-parallel"], "use --shards N (N > 1)"),
                         ([*group, "--expert-parallel"], "has no routed experts")):
        rc, out = _exits_with(extra, dense, redis_url, tmp_path / "ep.log", {}, timeout=60)
        assert rc == 2 and words in out, out


def _train_alike(clients, batches) -> None:
    """forward_backward + optim_step of each batch on both clients: the same outputs and gradient norms."""
    from tests.test_sharding import _assert_same_outputs

    for batch in batches:
        outs = [tc.forward_backward(batch) for tc in clients]
        _assert_same_outputs(outs[0].result(timeout=120), outs[1].result(timeout=120), len(batch))
        norms = [tc.optim_step(ADAM).result(timeout=60).metrics["grad_norm:mean"] for tc in clients]
        assert norms[1] == pytest.approx(norms[0], rel=1e-5)


def _snapshots_sample_alike(clients, prompt: list[int], seed: int) -> None:
    """Each client's sampling snapshot samples the same tokens, with logprobs within 1e-5."""
    params = types.SamplingParams(max_tokens=4, seed=seed)
    seqs = [tc.save_weights_and_get_sampling_client().sample(types.ModelInput.from_ints(prompt), 2, params)
            .result(timeout=120).sequences for tc in clients]
    assert [s.tokens for s in seqs[1]] == [s.tokens for s in seqs[0]] and len(seqs[0]) == 2
    for a, b in zip(*seqs, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def _losses(tc, batches) -> list[float]:
    futures = [(tc.forward_backward(b), tc.optim_step(ADAM)) for b in batches]
    return [fb.result(timeout=120).metrics["loss:sum"] for fb, _ in futures]


@pytest.mark.timeout(420)
def test_an_expert_parallel_group_of_workers_trains_as_one_worker(redis_url, tmp_path):
    """Two real `tinkerq worker --shards 2 --expert-parallel` processes serving a tiny Qwen3-MoE, against one
    unsharded worker on the same model: per-token outputs, gradient norms and the weights after pipelined steps
    (each datum a different length, several per rank) agree to float tolerance; the group reports its shards; its
    snapshot samples alike; a state saved by either resumes on the other and trains on alike; the base samples
    alike; a LoRA tenant on the group (its per-expert factors split with the experts) saves the same archive bytes as
    on one worker, trains alike, and its snapshot samples alike. The group runs with its decoder layers checkpointed
    (each layer's all-to-alls run again in the backward)."""
    from tests.test_sharding import ShardGroup, _assert_same_outputs
    from tinkerq.producer import ServiceClient

    model = build_family("qwen3_moe", tmp_path / "qwen3-moe", seed=7)
    checkpoints = tmp_path / "checkpoints"
    env = {"TINKERQ_CHECKPOINT_DIR": str(checkpoints), "TINKERQ_MICROBATCH_TOKENS": str(WORKER_MICROBATCH_TOKENS)}
    one_proc = start_named_worker(model, redis_url, "moe-one", tmp_path / "one.log", env=env)
    group = ShardGroup(model, redis_url, tmp_path, checkpoints, "moe-ep")
    try:
        with ServiceClient(broker_url=redis_url) as sc:
            flags = ("--expert-parallel", "--activation-checkpointing", "on")  # layers recomputed, all-to-alls too
            group.start(1, flags)
            time.sleep(1.0)
            group.start(0, flags)
            group.wait_serving(sc.connection)
            # Registered as expert parallel (`tinkerq fleet status` shows it), the unsharded worker not.
            assert [r.get("expert_parallel") for r in sc.connection.workers_serving("moe-ep")] == [True]
            assert [r.get("expert_parallel") for r in sc.connection.workers_serving("moe-one")] == [False]
            one, two = sc.create_training_client("moe-one"), sc.create_training_client("moe-ep")
            try:
                assert two.info.extra["shards"] == 2 and two.info.num_parameters == one.info.num_parameters
                rng = np.random.default_rng(80)
                batches = [make_batch(rng, n) for n in (1, 3, 5)]
                futures = {tc: [(tc.forward_backward(b), tc.optim_step(ADAM)) for b in batches] for tc in (one, two)}
                for i, batch in enumerate(batches):
                    (fb1, st1), (fb2, st2) = futures[one][i], futures[two][i]
                    _assert_same_outputs(fb1.result(timeout=120), fb2.result(timeout=120), len(batch))
                    m1, m2 = st1.result(timeout=60).metrics, st2.result(timeout=60).metrics
                    assert m2["grad_norm:mean"] == pytest.approx(m1["grad_norm:mean"], rel=1e-5)
                from transformers import AutoModelForCausalLM

                path_one = one.save_weights_for_sampler("ep-one").result(timeout=60).path
                path_two = two.save_weights_for_sampler("ep-two").result(timeout=60).path
                assert max_weight_diff(AutoModelForCausalLM.from_pretrained(path_one), path_two) < 1e-5
                probe = make_batch(rng, 3)
                _assert_same_outputs(one.forward(probe).result(timeout=60), two.forward(probe).result(timeout=60), 3)
                _snapshots_sample_alike((one, two), [1, 2, 3], seed=1)  # as the unsharded worker's
                # The state (weights, AdamW moments, a pending gradient) saved by one resumes on the other, both ways.
                two.forward_backward(probe).result(timeout=60)
                one.forward_backward(probe).result(timeout=60)
                saved = {"moe-ep": two.save_state("ep").result(timeout=60).path,
                         "moe-one": one.save_state("one").result(timeout=60).path}
                later = [make_batch(rng, n) for n in (2, 4)]
                for saver, loader in (("moe-ep", "moe-one"), ("moe-one", "moe-ep")):
                    tc = sc.create_training_client_from_state_with_optimizer(saved[saver], base_model=loader)
                    try:
                        resumed = _losses(tc, later)
                    finally:
                        tc.close()
                    assert resumed == pytest.approx(_losses(two if saver == "moe-ep" else one, later), rel=1e-5,
                                                    abs=1e-5), (saver, loader)
            finally:
                one.close()
                two.close()
            # The base model samples from the group as from one worker.
            prompt, params = types.ModelInput.from_ints([4, 5, 6]), types.SamplingParams(max_tokens=4, seed=2)
            base = [sc.create_sampling_client(base_model=name).sample(prompt, 2, params).result(timeout=120).sequences
                    for name in ("moe-one", "moe-ep")]
            assert [s.tokens for s in base[1]] == [s.tokens for s in base[0]]
            for a, b in zip(*base, strict=True):
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
            # A LoRA tenant on the same group (its base split by expert, its per-expert factors with their experts)
            # trains as on one worker; its archives are the same files.
            lora = [sc.create_lora_training_client(name, rank=4, seed=3).result(timeout=120)
                    for name in ("moe-one", "moe-ep")]
            try:
                fresh = [Path(tc.save_weights_for_sampler(f"fresh-{i}").result(timeout=60).path)
                         for i, tc in enumerate(lora)]
                fresh += [Path(tc.save_state(f"fresh-state-{i}").result(timeout=60).path) for i, tc in enumerate(lora)]
                files = [(p / "adapter_model.safetensors").read_bytes() for p in fresh]
                # The group's factors gathered whole: the same bytes as one worker's, for the sampler and in a state.
                assert files[0] == files[1] and files[2] == files[3]
                _train_alike(lora, batches[:2])
                from safetensors.torch import load_file

                trained = [Path(tc.save_weights_for_sampler(f"trained-{i}").result(timeout=60).path)
                           for i, tc in enumerate(lora)]
                got, want = (load_file(str(p / "adapter_model.safetensors")) for p in reversed(trained))
                assert got.keys() == want.keys() and any(k.endswith("experts.w1.lora_B.weight") for k in got)
                for key, tensor in want.items():
                    assert got[key].shape == tensor.shape and float((got[key] - tensor).abs().max()) < 1e-5, key
                # Its snapshot samples alike: rank 1 computes rank 0's rows at its experts with the factors shipped.
                _snapshots_sample_alike(lora, [2, 7, 1], seed=4)
            finally:
                for tc in lora:
                    tc.close()
    finally:
        group.stop()
        one_proc.terminate()
        one_proc.wait(30)
    log = (tmp_path / "moe-ep-rank0.log").read_text()
    assert "expert parallel over 2 ranks: 1 MoE layer(s), experts per rank 4" in log
    assert "decoder layers checkpointed" in log


def test_fleet_up_passes_expert_parallel_to_every_rank(tmp_path):
    """`tinkerq fleet up --shards 2 --expert-parallel` gives the flag to the ranks: on a dense model they refuse it at
    start-up, and `fleet up` says why, naming the rank's log."""
    from tests.test_fleet import _tinkerq

    dense = build_tiny_llama(tmp_path / "llama")
    env = {"TINKERQ_HOME": str(tmp_path / "home")}
    try:
        up = _tinkerq("fleet", "up", "--fleet", "ep", "--model", str(dense), "--shards", "2", "--expert-parallel",
                      "--flower-port", "0", "--threads", "1", env=env)
    finally:
        _tinkerq("fleet", "down", "--fleet", "ep", env=env)
    assert up.returncode == 2, up.stdout + up.stderr
    assert "exited during start-up" in up.stderr and "has no routed experts" in up.stderr, up.stderr


def test_admission_counts_every_ranks_rows_at_the_experts_of_an_expert_parallel_rank(tmp_path):
    """worker/memory activation_bytes(expert_ranks=W): a rank may compute its experts for every rank's concurrent
    micro-batch (all tokens routed to it), never more than the request's tokens; a dense model adds nothing."""
    from tinkerq.worker.memory import ModelShape, activation_bytes, batch_bytes

    moe = ModelShape.of(load_skeleton(str(build_family("qwen3_moe", tmp_path / "moe", seed=1))))
    dense = ModelShape.of(load_skeleton(str(build_tiny_llama(tmp_path / "llama"))))
    assert (moe.top_k, moe.routed_intermediate) == (2, 2 * 16) and (dense.top_k, dense.routed_intermediate) == (0, 0)

    def acts(shape, lengths, w, budget=64):
        return activation_bytes(shape, lengths, microbatch_tokens=budget, backward=True, chunk_tokens=None,
                                expert_ranks=w)

    many = [32] * 16  # 512 tokens in micro-batches of 64: each of 4 ranks' concurrent micro-batches may reach one
    one, four = acts(moe, many, 1), acts(moe, many, 4)
    n, layers = 64, moe.layers
    extra = (4 * n - n) * 6 * moe.routed_intermediate * 4 + 2 * (4 * n + n) * moe.top_k * moe.hidden * 4
    assert four - one == (layers + 1) * extra  # every layer saved for the backward, one more in flight
    # A request of one micro-batch: the other ranks' rows are among its own tokens; only the exchange is added.
    small = [16, 16]
    assert acts(moe, small, 4) - acts(moe, small, 1) == (layers + 1) * 2 * (32 + 32) * moe.top_k * moe.hidden * 4
    assert acts(dense, many, 4) == acts(dense, many, 1)
    kw = dict(microbatch_tokens=64, backward=True, chunk_tokens=None, shards=4)
    assert batch_bytes(moe, many, expert_parallel=True, **kw) - batch_bytes(moe, many, **kw) == four - one


def test_every_token_to_one_ranks_experts_stays_within_what_the_worker_admits(tmp_path):
    """Routing imbalance must not exceed the memory admitted: on 4 ranks, every token routed into rank 0's experts,
    decoder layers checkpointed, each rank's peak RSS growth over a forward_backward pass stays within what the
    worker admits for it (worker/memory/: the batch with its expert-parallel term, and FSDP's gather room without
    the routed experts). A Qwen3-MoE of ~30 MiB, so the pass's memory is far above the allocator's noise."""
    from tinkerq.recipes.families import build_model
    from tinkerq.worker.memory import ModelShape, batch_bytes, gather_bytes
    from tinkerq.worker.training.logprobs import chunk_tokens

    world, rows, tokens = 4, 2, 96
    build_model("qwen3_moe", 0, vocab_size=2000, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                num_experts=16, num_experts_per_tok=4, num_hidden_layers=2, mlp_only_layers=[],
                num_attention_heads=4, num_key_value_heads=2, head_dim=64).save_pretrained(tmp_path / "model")
    torch.multiprocessing.spawn(expert_ranks.peak_pass, nprocs=world,
                                args=(world, free_port(), str(tmp_path / "model"), str(tmp_path), rows, tokens))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert ranks[0]["rows"] == [world * rows * tokens * 4] * 2 and all(r["rows"] == [0, 0] for r in ranks[1:])
    shape = ModelShape.of(load_skeleton(str(tmp_path / "model")))
    admitted = batch_bytes(shape, [tokens] * (rows * world), microbatch_tokens=16384, backward=True,
                           chunk_tokens=chunk_tokens(shape.vocab), shards=world, checkpointing=True,
                           expert_parallel=True) + gather_bytes(shape, world, weight_grads=True, expert_parallel=True)
    growth = [r["growth"] for r in ranks]
    print(f"\npeak growth per rank {[round(g / 2**20, 1) for g in growth]} MiB; admitted {admitted / 2**20:.1f} MiB")
    assert max(growth) <= admitted, (growth, admitted)


def test_the_plan_covers_each_ranks_measured_peak_on_a_kept_expert_parallel_group(tmp_path):
    """Issue 30, part 5: `tinkerq plan --expert-parallel --quantized-base keep --activation-checkpointing on` at 4
    shards against each rank's measured peak of live tensor bytes (what `torch.cuda.max_memory_allocated` counts on
    a GPU; tests.helpers.LiveTensorBytes on the CPU) over a LoRA tenant's first forward_backward + optim_step, every
    token routed into rank 0's experts (the routing the plan covers), on the published DeepSeek-V3 FP8 and Kimi-K2
    INT4 layouts. The base a rank holds and the adapter are what is planned (within 1%; the adapter's 16 bytes per
    parameter are its weights, gradients and AdamW moments); the total covers every rank's peak and is within 15% of
    the fullest one's (1.04x FP8, 1.13x INT4: docs/planning.md, the measured check)."""
    from tinkerq.recipes.published import build_published
    from tinkerq.worker.planning import planner

    world, datums, seq_len, micro, rank = 4, 8, 64, 256, 8
    paths = [str(build_published(name, tmp_path / name)) for name in ("deepseek_v3-fp8", "kimi_k2-int4")]
    torch.multiprocessing.spawn(expert_ranks.planned_peak, nprocs=world,
                                args=(world, free_port(), paths, str(tmp_path), datums, seq_len, micro, rank))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    workload = planner.Workload(batch_tokens=datums * seq_len, seq_len=seq_len, microbatch_tokens=micro,
                                lora_rank=rank)
    for path in paths:
        p = planner.plan(path, devices=world, device_gb=64, dtype="float32", headroom_gb=0, workload=workload,
                         quantized_base="keep", expert_parallel="on", activation_checkpointing="on", at_shards=world)
        lora = p.lora
        assert lora.at == world and lora.checkpointing and p.expert_parallel, lora
        planned_base = lora.parts["frozen base, experts as stored (shared)"]
        measured = []
        for r, found in enumerate(ranks):
            m = found[path]
            assert all(rows == 0 for rows in m["rows"]) == (r > 0), (r, m["rows"])  # only rank 0's experts compute
            assert abs(m["base"] - planned_base) <= 0.01 * planned_base, (path, r, m["base"], planned_base)
            assert 4 * m["adapter"] == lora.adapter_bytes, (path, r)
            measured.append(m["base"] + m["adapter"] + m["step_peak"])
        print(f"\n{Path(path).name}: planned per rank {lora.total:,} B "
              f"({', '.join(f'{k} {v:,}' for k, v in lora.parts.items())}, adapter {lora.adapter_bytes:,}); "
              f"measured peak per rank {[f'{x:,}' for x in measured]}; plan / rank 0 {lora.total / measured[0]:.2f}")
        assert max(measured) == measured[0]
        assert measured[0] <= lora.total <= 1.15 * measured[0], (path, lora.total, measured)


@pytest.mark.timeout(420)
def test_a_group_keeps_a_published_fp8_base_split_by_expert(redis_url, tmp_path):
    """`tinkerq worker --shards 2 --expert-parallel --quantized-base keep` on a DeepSeek-V3 checkpoint as published
    (block FP8, per-expert keys, its MTP layer): each rank keeps its experts' stored parts; a LoRA tenant trains, and
    its snapshot samples, as on one worker that dequantized the checkpoint on load; a full session is one user error
    naming the fix."""
    from tests.test_sharding import ShardGroup
    from tinkerq.errors import TinkerqError
    from tinkerq.producer import ServiceClient
    from tinkerq.recipes.published import build_published

    model = build_published("deepseek_v3-fp8", tmp_path / "deepseek-fp8")
    checkpoints = tmp_path / "checkpoints"
    env = {"TINKERQ_CHECKPOINT_DIR": str(checkpoints), "TINKERQ_MICROBATCH_TOKENS": str(WORKER_MICROBATCH_TOKENS)}
    one_proc = start_named_worker(model, redis_url, "fp8-one", tmp_path / "one.log", env=env,
                                  extra=["--dtype", "float32"])
    group = ShardGroup(model, redis_url, tmp_path, checkpoints, "fp8-kept")
    try:
        with ServiceClient(broker_url=redis_url) as sc:
            flags = ("--expert-parallel", "--quantized-base", "keep", "--dtype", "float32")
            group.start(1, flags)
            group.start(0, flags)
            group.wait_serving(sc.connection)
            lora = [sc.create_lora_training_client(name, rank=4, seed=11).result(timeout=120)
                    for name in ("fp8-one", "fp8-kept")]
            try:
                rng = np.random.default_rng(12)
                _train_alike(lora, [make_batch(rng, n) for n in (3, 4)])
                _snapshots_sample_alike(lora, [3, 1, 4], seed=5)
            finally:
                for tc in lora:
                    tc.close()
            with pytest.raises(TinkerqError, match="quantized-base dequantize"):
                sc.create_training_client("fp8-kept").result(timeout=60)
    finally:
        group.stop()
        one_proc.terminate()
        one_proc.wait(30)
    for rank in (0, 1):
        log = (tmp_path / f"fp8-kept-rank{rank}.log").read_text()
        assert "kept quantized: 1 experts module(s), this rank's experts as stored" in log, rank
