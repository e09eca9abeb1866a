"""The training and sampling surface of the official SDK 0.38 not walked elsewhere: the async spellings of
ServiceClient, TrainingClient and SamplingClient, client-side custom losses, sampler handles, the tokenizer and
telemetry getters, and the RL losses, against a real worker, gateway and Redis.

Checked independently: every async spelling against the sync spelling on a twin client (same seed, same data),
bit for bit; forwards and sampler logprobs against a plain transformers forward of the tiny Llama; the RL losses
against plain-torch definitions from docs/rl.md written here (variable-length datums, clipping triggered); a
client-side custom loss against its own value on the reference logprobs, and its step against a plain
cross_entropy step with weights = -dC/dlogprobs on a twin; the tokenizer against the model directory's own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import load_reference, make_batch, reference_logprobs
from tests.sdk_fleet import Fleet, sdk_fleet
from tests.test_gateway import ADAM, NAME, sdk_batch
from tinkerq import types

tinker = pytest.importorskip("tinker")

pytestmark = [pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore:DEPRECATED:FutureWarning")]
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
ATOL = 1e-5


@pytest.fixture(scope="module")
def fleet(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[Fleet]:
    os.environ["TINKER_TELEMETRY"] = "0"  # the SDK then keeps no telemetry: get_telemetry() is None
    with sdk_fleet(model_dir, redis_url, checkpoint_dir, tmp_path_factory.mktemp("sdk-walk")) as made:
        yield made


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> torch.nn.Module:
    return load_reference(model_dir)


def service(fleet: Fleet) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=fleet.url, api_key=fleet.keys["alice"])


def batch(seed: int, n: int = 3) -> list:
    return sdk_batch(make_batch(np.random.default_rng(seed), n, max_len=12))


def logprobs_of(out) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].to_numpy()) for o in out.loss_fn_outputs]


def ref_t(model: torch.nn.Module, datum) -> torch.Tensor:
    """The base model's target logprobs for an SDK datum, by a plain transformers forward."""
    ours = types.Datum(model_input=types.ModelInput.from_ints(datum.model_input.to_ints()),
                       loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"].data})
    with torch.no_grad():
        return reference_logprobs(model, ours)


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


# -- ServiceClient and TrainingClient async spellings against sync twins ------------------------------------------


def test_async_training_walk_matches_sync_twin(fleet: Fleet, reference, model_dir: Path, tmp_path, monkeypatch):
    sc = service(fleet)
    data, probe = batch(1), batch(2)
    adam = tinker.AdamParams(**ADAM)

    caps = sc.get_server_capabilities()
    assert NAME in [m.model_name for m in caps.supported_models]
    assert asyncio.run(sc.get_server_capabilities_async()) == caps
    assert sc.get_telemetry() is None  # TINKER_TELEMETRY=0: documented to keep none

    twin = sc.create_lora_training_client(NAME, rank=4, seed=11).result(timeout=120)
    fwd0 = twin.forward(data, "cross_entropy").result()
    # A fresh LoRA adapter is the base model: the forward is a plain transformers forward.
    for d, got in zip(data, logprobs_of(fwd0), strict=True):
        np.testing.assert_allclose(got, ref_t(reference, d).numpy(), atol=ATOL)
    fb_sync = twin.forward_backward(data, "cross_entropy").result()
    twin.optim_step(adam).result()
    state_sync = twin.save_state("walk-sync").result(timeout=120).path
    twin.forward_backward(data, "cross_entropy").result()
    twin.optim_step(adam).result()
    after_two = logprobs_of(twin.forward(probe, "cross_entropy").result())
    info_sync = twin.get_info()

    async def main() -> dict:
        tc = await sc.create_lora_training_client_async(NAME, rank=4, seed=11)
        got: dict = {"fwd0": await (await tc.forward_async(data, "cross_entropy"))}
        got["fb"] = await (await tc.forward_backward_async(data, "cross_entropy"))
        await (await tc.optim_step_async(adam))
        got["state"] = (await (await tc.save_state_async("walk-async"))).path
        got["info"] = await tc.get_info_async()
        got["sampler_path"] = (await (await tc.save_weights_for_sampler_async("walk-async-w"))).path
        got["sampler"] = await tc.save_weights_and_get_sampling_client_async()
        got["from_tc"] = await tc.create_sampling_client_async(got["sampler_path"])
        got["from_sc"] = await sc.create_sampling_client_async(model_path=got["sampler_path"])
        # Restores: a new client from the state (weights only, and with the optimizer), and loads into fresh ones.
        plain = await sc.create_training_client_from_state_async(got["state"])
        with_opt = await sc.create_training_client_from_state_with_optimizer_async(got["state"])
        loaded = await sc.create_lora_training_client_async(NAME, rank=4, seed=99)
        await (await loaded.load_state_async(got["state"]))
        loaded_opt = await sc.create_lora_training_client_async(NAME, rank=4, seed=99)
        await (await loaded_opt.load_state_with_optimizer_async(got["state"]))
        got["restored"] = {k: logprobs_of(await (await c.forward_async(probe, "cross_entropy")))
                           for k, c in {"plain": plain, "loaded": loaded}.items()}
        got["stepped"] = {}
        for k, c in {"with_opt": with_opt, "loaded_opt": loaded_opt, "tc": tc}.items():
            await (await c.forward_backward_async(data, "cross_entropy"))
            await (await c.optim_step_async(adam))
            got["stepped"][k] = logprobs_of(await (await c.forward_async(probe, "cross_entropy")))
        return got

    got = asyncio.run(main())
    assert_same(logprobs_of(got["fwd0"]), logprobs_of(fwd0))
    assert got["fb"].metrics["loss:sum"] == fb_sync.metrics["loss:sum"]
    assert_same(logprobs_of(got["fb"]), logprobs_of(fb_sync))
    assert got["info"].model_data.model_name == info_sync.model_data.model_name == NAME
    assert got["info"].lora_rank == info_sync.lora_rank == 4
    # Every restore reads the state the sync twin also saved after one step: same weights, bit for bit.
    one_step = logprobs_of(sc.create_training_client_from_state(state_sync).result(timeout=120)
                           .forward(probe, "cross_entropy").result())
    for restored in got["restored"].values():
        assert_same(restored, one_step)
    # With the optimizer state the next step is the twin's second step; the sync spelling of the load too.
    sync_loaded = sc.create_lora_training_client(NAME, rank=4, seed=99).result(timeout=120)
    sync_loaded.load_state_with_optimizer(state_sync).result(timeout=120)
    sync_loaded.forward_backward(data, "cross_entropy").result()
    sync_loaded.optim_step(adam).result()
    for stepped in [*got["stepped"].values(), logprobs_of(sync_loaded.forward(probe, "cross_entropy").result())]:
        assert_same(stepped, after_two)

    # The samplers made after one step: all compute the same prompt logprobs; the sync twin's state agrees.
    lp_sc = got["from_sc"].compute_logprobs(tinker.ModelInput.from_ints(PROMPT)).result()
    for s in (got["sampler"], got["from_tc"], twin.create_sampling_client(got["sampler_path"]).result(timeout=120)):
        assert s.compute_logprobs(tinker.ModelInput.from_ints(PROMPT)).result() == lp_sc
    seq = tinker.Datum(model_input=tinker.ModelInput.from_ints(PROMPT[:-1]),
                       loss_fn_inputs={"target_tokens": tinker.TensorData(data=PROMPT[1:], dtype="int64",
                                                                          shape=[len(PROMPT) - 1]),
                                       "weights": tinker.TensorData(data=[1.0] * (len(PROMPT) - 1), dtype="float32",
                                                                    shape=[len(PROMPT) - 1])})
    trained = logprobs_of(sc.create_training_client_from_state(state_sync).result(timeout=120)
                          .forward([seq], "cross_entropy").result())[0]
    np.testing.assert_allclose(lp_sc[1:], trained, atol=1e-4)  # sampler vs trainer: docs/rl.md's 1e-4
    assert twin.get_telemetry() is None and got["sampler"].get_telemetry() is None

    # get_tokenizer loads AutoTokenizer.from_pretrained(tokenizer_id) (training: the served name; sampling: the
    # SDK's Llama-3 mapping); offline, a local directory under that name serves it: the tiny model's tokenizer.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in (NAME, "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer"):
        shutil.copytree(model_dir, tmp_path / name)
    from transformers import AutoTokenizer
    expected = AutoTokenizer.from_pretrained(model_dir).encode("hello world")
    assert twin.get_tokenizer().encode("hello world") == expected
    assert got["sampler"].get_tokenizer().encode("hello world") == expected


# -- SamplingClient --------------------------------------------------------------------------------------------------


def test_sampling_client_walk(fleet: Fleet, reference, caplog):
    sc = service(fleet)
    base = sc.create_sampling_client(base_model=NAME).result(timeout=120)
    prompt = tinker.ModelInput.from_ints(PROMPT)
    params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=5)

    async def main() -> dict:
        # These two return the result itself (not a future to await again).
        return {"lp": await base.compute_logprobs_async(prompt),
                "sample": await base.sample_async(prompt, 2, params),
                "base_model": await base.get_base_model_async()}

    got = asyncio.run(main())
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([PROMPT])).logits[0].float()
    plain = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(PROMPT[1:]).unsqueeze(-1)).squeeze(-1)
    assert got["lp"][0] is None
    np.testing.assert_allclose(got["lp"][1:], plain.numpy(), atol=1e-4)
    assert got["lp"] == base.compute_logprobs(prompt).result()
    assert got["base_model"] == base.get_base_model() == NAME
    sync = base.sample(prompt, 2, params).result()
    assert [s.tokens for s in got["sample"].sequences] == [s.tokens for s in sync.sequences]
    for s in got["sample"].sequences:  # each sampled token's logprob is the plain forward's
        full = PROMPT + s.tokens
        with torch.no_grad():
            lg = torch.log_softmax(reference(input_ids=torch.tensor([full])).logits[0].float(), -1)
        want = lg[len(PROMPT) - 1:-1].gather(-1, torch.tensor(s.tokens).unsqueeze(-1)).squeeze(-1)
        np.testing.assert_allclose(s.logprobs, want.numpy(), atol=1e-4)
    assert base.get_telemetry() is None

    # A handle carries no key: from_sampler_handle with the key reaches the same sampler.
    handle = base.get_sampler_handle()
    assert fleet.keys["alice"] not in handle
    again = tinker.SamplingClient.from_sampler_handle(handle, api_key=fleet.keys["alice"])
    assert again.compute_logprobs(prompt).result() == got["lp"]
    # SamplingClient.create on the service's holder, by base model: the same numbers.
    created = tinker.SamplingClient.create(sc.holder, base_model=NAME).result(timeout=120)
    assert created.compute_logprobs(prompt).result() == got["lp"]

    # on_queue_state_change: ACTIVE is silent; a pause logs one warning naming the sampler and the reason.
    from tinker.lib.api_future_impl import QueueState
    with caplog.at_level(logging.WARNING):
        base.on_queue_state_change(QueueState.ACTIVE, None)
        assert not [r for r in caplog.records if "Sampling is paused" in r.getMessage()]
        base.on_queue_state_change(QueueState.PAUSED_CAPACITY, "test pause")
    paused = [r.getMessage() for r in caplog.records if "Sampling is paused" in r.getMessage()]
    assert len(paused) == 1 and "test pause" in paused[0] and base._sampling_session_id in paused[0]


# -- custom losses, client-side ---------------------------------------------------------------------------------------


def squared(logprobs, weights):
    loss = (weights * logprobs**2).sum()
    return loss, {"custom/squared:sum": loss}


def test_custom_loss_client_side(fleet: Fleet, reference):
    sc = service(fleet)
    data, probe = batch(3), batch(4)
    adam = tinker.AdamParams(**ADAM)
    # The gateway's client config says custom_loss_server_side false: the SDK traces the loss, does not upload it
    # (no loss_id), and runs it on the client.
    handle = sc.create_custom_loss(squared, {"logprobs": 1, "weights": 1}).result(timeout=60)
    assert handle.loss_id is None

    by_handle, by_fn, plain = (sc.create_lora_training_client(NAME, rank=4, seed=21).result(timeout=120)
                               for _ in range(3))
    out_handle = by_handle.forward_backward_custom(data, handle).result(timeout=120)

    def fn(ds, lps):
        return sum((squared(lp, torch.tensor(d.loss_fn_inputs["weights"].data))[0] for d, lp in zip(ds, lps,
                                                                                                   strict=True)),
                   torch.zeros(())), {}

    async def main():
        return await (await by_fn.forward_backward_custom_async(data, fn))

    out_fn = asyncio.run(main())

    # The twin: a plain forward gives the same logprobs the SDK differentiated; weights = -dC/dlp = -2·w·lp.
    lps = logprobs_of(plain.forward(data, "cross_entropy").result())
    # float64 sums: the SDK's float32 sum of a few hundred differs in the last bits, hence rel 1e-6.
    want = sum(float((np.asarray(d.loss_fn_inputs["weights"].data, np.float64) * lp.astype(np.float64) ** 2).sum())
               for d, lp in zip(data, lps, strict=True))
    ref = sum(float((torch.tensor(d.loss_fn_inputs["weights"].data) * ref_t(reference, d) ** 2).sum()) for d in data)
    linear = [tinker.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"],
        "weights": tinker.TensorData(data=(-2 * np.asarray(d.loss_fn_inputs["weights"].data, np.float32)
                                           * lp.astype(np.float32)).tolist(), dtype="float32", shape=[len(lp)])})
        for d, lp in zip(data, lps, strict=True)]
    out_plain = plain.forward_backward(linear, "cross_entropy").result()
    for out in (out_handle, out_fn):
        assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-6)
        assert out.metrics["loss:sum"] == pytest.approx(ref, rel=1e-5)
        assert out.metrics["surrogate_loss:sum"] == out_plain.metrics["loss:sum"]
    assert out_handle.metrics["custom/squared:sum"] == pytest.approx(want, rel=1e-6)
    for c in (by_handle, by_fn, plain):
        c.optim_step(adam).result()
    after = [logprobs_of(c.forward(probe, "cross_entropy").result()) for c in (by_handle, by_fn, plain)]
    assert_same(after[0], after[2])
    assert_same(after[1], after[2])


# -- the RL losses ----------------------------------------------------------------------------------------------------


LOSSES = {"importance_sampling": None, "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
          "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, "dro": {"beta": 0.05},
          "gspo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}}


def rl_data(reference) -> list[tuple]:
    """(datum, t, s, A, mask) per datum: variable lengths, prompt positions with A = 0 and s = 0, sampler
    logprobs off the trainer's by up to ±0.4 so ratios leave the clip range."""
    rng = np.random.default_rng(31)
    out = []
    for length in (4, 9, 13):
        seq = rng.integers(0, 50, size=length + 1)
        prompt = int(rng.integers(1, length - 1))
        targets = seq[1:].astype(np.int64)
        d0 = tinker.Datum(model_input=tinker.ModelInput.from_ints(seq[:-1].tolist()),
                          loss_fn_inputs={"target_tokens": tinker.TensorData(data=targets.tolist(), dtype="int64",
                                                                             shape=[length])})
        t = ref_t(reference, d0).double()
        sampled = np.arange(length) >= prompt
        s = np.where(sampled, t.numpy() + rng.uniform(-0.4, 0.4, length), 0.0).astype(np.float32)
        adv = np.where(sampled, rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5), 0.0).astype(np.float32)
        mask = sampled.astype(np.float32)
        inputs = {"target_tokens": targets.tolist(), "logprobs": s.tolist(), "advantages": adv.tolist(),
                  "sequence_ratio_mask": mask.tolist()}
        out.append((d0, t, torch.tensor(s, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64),
                    torch.tensor(mask, dtype=torch.float64), inputs))
    return out


def reference_rl(loss: str, config: dict | None, t, s, a, mask) -> torch.Tensor:
    """docs/rl.md's per-token definitions, per datum, plainly (float64)."""
    r = torch.exp(torch.clamp(t - s, -20, 20))
    if loss == "importance_sampling":
        return -r * a
    if loss == "dro":
        return -(t * a - 0.5 * config["beta"] * (t - s) ** 2)
    lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
    if loss == "ppo":
        return -torch.minimum(r * a, torch.clamp(r, lo, hi) * a)
    if loss == "cispo":
        return -torch.clamp(r, lo, hi) * t * a
    r_seq = torch.exp((torch.clamp(t - s, -20, 20) * mask).sum() / mask.sum()).expand_as(t)
    return -torch.minimum(r_seq * a, torch.clamp(r_seq, lo, hi) * a)


def test_loss_fn_custom_is_refused_with_the_client_side_way(fleet: Fleet):
    """loss_fn="custom" names a loss uploaded to the server; this fleet runs custom losses on the client (its
    client/config says custom_loss_server_side false): one user error naming forward_backward_custom."""
    sc = service(fleet)
    tc = sc.create_lora_training_client(NAME, rank=4, seed=23).result(timeout=120)
    with pytest.raises(Exception, match="forward_backward_custom"):
        tc.forward_backward(batch(2), "custom").result(timeout=120)
    # The refused position was filled: a new client of the same key trains at once.
    other = sc.create_lora_training_client(NAME, rank=4, seed=23).result(timeout=120)
    assert other.forward_backward(batch(2), "cross_entropy").result(timeout=120).metrics["loss:sum"] > 0


@pytest.mark.parametrize("loss", list(LOSSES))
def test_rl_losses_match_plain_torch(fleet: Fleet, reference, loss: str):
    sc = service(fleet)
    tc = sc.create_lora_training_client(NAME, rank=4, seed=41).result(timeout=120)  # fresh adapter: the base model
    rows = rl_data(reference)
    keys_for = ["target_tokens", "logprobs", "advantages"] + (["sequence_ratio_mask"] if loss == "gspo" else [])
    data = [tinker.Datum(model_input=d0.model_input, loss_fn_inputs={
        k: tinker.TensorData(data=inputs[k], dtype="int64" if k == "target_tokens" else "float32",
                             shape=[len(inputs[k])]) for k in keys_for}) for d0, _t, _s, _a, _m, inputs in rows]
    out = tc.forward_backward(data, loss, LOSSES[loss]).result(timeout=120)
    want = [reference_rl(loss, LOSSES[loss], t, s, a, m) for _d, t, s, a, m, _i in rows]
    assert out.metrics["loss:sum"] == pytest.approx(float(sum(w.sum() for w in want)), abs=ATOL)
    for got, w, (_d, t, *_rest) in zip(out.loss_fn_outputs, want, rows, strict=True):
        np.testing.assert_allclose(got["elementwise_loss"].to_numpy(), w.numpy(), atol=ATOL)
        np.testing.assert_allclose(got["logprobs"].to_numpy(), t.numpy(), atol=ATOL)
    if loss in ("ppo", "gspo"):  # clipping was exercised
        assert out.metrics["clip_fraction:mean"] > 0
