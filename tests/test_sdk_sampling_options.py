"""Tinker's sampling options, served with the SDK's semantics: the official SDK 0.38 through a real `tinkerq gateway`,
a real worker process and Redis, and the producer library against the same worker. Every number is checked against
a plain transformers forward of the same tokens (float32, no cache, full logits).

The worker serves a tiny Llama whose EOS id is a token its greedy continuation of ``PROMPT`` reaches after a few
tokens, so ``stop=None`` (the implicit EOS) and ``stop=[]`` (nothing stops it, not even EOS) give different lengths.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import start_named_worker
from tests.helpers import build_tiny_llama, load_reference
from tests.test_gateway import start_gateway
from tinkerq import types

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.timeout(300)
NAME = "tiny/sampling-options"
PROMPT = [5, 9, 2, 7, 11, 4, 30, 12]
MAX_TOKENS = 12


def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a plain forward of the whole sequence so far (no cache)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory) -> tuple[Path, int, list[int]]:
    """The tiny model with its EOS set to the first token of its greedy continuation of PROMPT that is new after the
    first: (directory, eos id, the continuation to MAX_TOKENS)."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("models") / "eos-llama", seed=3)
    continuation = greedy(load_reference(model_dir), PROMPT, MAX_TOKENS)
    cut = next((i for i in range(1, MAX_TOKENS // 2) if continuation[i] not in continuation[:i]), None)
    assert cut is not None, f"the greedy continuation {continuation} repeats one token; pick another seed"
    eos = continuation[cut]
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        config = json.loads(path.read_text())
        config["eos_token_id"] = eos
        path.write_text(json.dumps(config))
    return model_dir, eos, continuation


@pytest.fixture(scope="module")
def worker(eos_model, redis_url: str, tmp_path_factory) -> Iterator[subprocess.Popen]:
    proc = start_named_worker(eos_model[0], redis_url, NAME, tmp_path_factory.mktemp("logs") / "worker.log")
    yield proc
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def gateway_url(redis_url: str, worker, tmp_path_factory) -> Iterator[str]:
    proc, url = start_gateway(redis_url, tmp_path_factory.mktemp("logs") / "gateway.log")
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def api_key(redis_url: str) -> Iterator[str]:
    from tinkerq.settings import Settings
    from tinkerq.tenants import ApiKeys

    keys = ApiKeys.open(Settings(broker_url=redis_url))
    yield keys.create("sampling-options")
    keys.close()


@pytest.fixture(scope="module")
def sdk(gateway_url: str, api_key: str) -> Iterator:
    import os

    os.environ["TINKER_TELEMETRY"] = "0"
    with tinker.ServiceClient(base_url=gateway_url, api_key=api_key) as client:
        yield client


@pytest.fixture(scope="module")
def sdk_sampler(sdk) -> Iterator:
    return sdk.create_sampling_client(base_model=NAME).result()


@pytest.fixture(scope="module")
def library_sampler(redis_url: str, worker) -> Iterator:
    from tinkerq.producer import ServiceClient

    service = ServiceClient(broker_url=redis_url)
    yield service.create_sampling_client(base_model=NAME).result()
    service.close()


@pytest.fixture(scope="module")
def reference(eos_model) -> torch.nn.Module:
    return load_reference(eos_model[0])


# -- stop=[] ---------------------------------------------------------------------------------------------------


def test_stop_none_stops_at_eos_and_an_empty_list_runs_to_max_tokens(eos_model, sdk_sampler, library_sampler):
    _, eos, continuation = eos_model
    at_eos = continuation[:continuation.index(eos) + 1]
    assert len(at_eos) < MAX_TOKENS
    for stop, tokens, reason in ((None, at_eos, "stop"), ([], continuation, "length")):
        sdk_seq = sdk_sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, stop=stop)).result(timeout=120).sequences[0]
        assert (list(sdk_seq.tokens), sdk_seq.stop_reason) == (tokens, reason), f"SDK, stop={stop!r}"
        seq = library_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, stop=stop)).result(timeout=120).sequences[0]
        assert (seq.tokens, seq.stop_reason) == (tokens, reason), f"producer, stop={stop!r}"
    # With stop=[] the EOS token itself is sampled and decoding goes on past it.
    assert eos in continuation[:-1]


# -- top-k logprobs ----------------------------------------------------------------------------------------------


def log_softmax_rows(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V): row i is log p(. | tokens[:i + 1]), from one plain forward (float32, full logits)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def check_topk(rows: list, expected: torch.Tensor, k: int, where: str) -> None:
    """``rows``: per position, k (id, logprob) pairs (the SDK's list form); ``expected``: the positions' log p."""
    assert len(rows) == expected.shape[0], where
    for i, (row, lsm) in enumerate(zip(rows, expected, strict=True)):
        values, ids = lsm.topk(k)
        assert [t for t, _ in row] == ids.tolist(), f"{where}, position {i}"
        np.testing.assert_allclose([lp for _, lp in row], values.numpy(), atol=1e-4, err_msg=f"{where}, position {i}")


TOPK = dict(topk_prompt_logprobs=5, topk_sample_logprobs=3)


def test_topk_prompt_and_sample_logprobs_match_a_plain_forward(reference, sdk_sampler, library_sampler):
    params = dict(max_tokens=6, temperature=1.0, seed=11, stop=[])
    sdk_out = sdk_sampler.sample(tinker.ModelInput.from_ints(PROMPT), 2, tinker.SamplingParams(**params),
                                 include_prompt_logprobs=True, **TOPK).result(timeout=120)
    lib_out = library_sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(**params),
                                     include_prompt_logprobs=True, **TOPK).result(timeout=120)
    prompt_lsm = log_softmax_rows(reference, PROMPT)[:-1]  # row i predicts PROMPT[i + 1]
    for name, topk_prompt, sequences in (
            ("SDK", sdk_out.topk_prompt_logprobs, [(s.tokens, s.topk_logprobs) for s in sdk_out.sequences]),
            ("producer", lib_out.topk_prompt_logprobs.to_lists(),
             [(s.tokens, s.topk_logprobs.to_lists()) for s in lib_out.sequences])):
        assert topk_prompt[0] is None, name  # nothing predicts the first prompt token
        check_topk(topk_prompt[1:], prompt_lsm, 5, f"{name} topk_prompt_logprobs")
        for j, (tokens, topk) in enumerate(sequences):
            assert len(tokens) == params["max_tokens"]
            full = log_softmax_rows(reference, PROMPT + list(tokens))
            check_topk(topk, full[len(PROMPT) - 1:-1], 3, f"{name} sequence {j} topk_logprobs")
    # The same numbers the plain prompt logprobs are: the top-1 bounds them from above.
    for i, lp in enumerate(sdk_out.prompt_logprobs[1:]):
        assert lp <= sdk_out.topk_prompt_logprobs[i + 1][0][1] + 1e-6


def test_prompt_logprobs_last_n_also_cuts_the_top_k_rows(reference, sdk_sampler):
    out = sdk_sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(max_tokens=1),
                             include_prompt_logprobs=True, prompt_logprobs_last_n=3,
                             topk_prompt_logprobs=4).result(timeout=120)
    cut = len(PROMPT) - 3
    assert out.topk_prompt_logprobs[:cut] == [None] * cut
    check_topk(out.topk_prompt_logprobs[cut:], log_softmax_rows(reference, PROMPT)[cut - 1:-1], 4, "last_n")


# -- target_prompt_logprobs and prompt_alt_tokens_k -----------------------------------------------------------------


def test_target_prompt_logprobs_dense_and_sparse_match_a_plain_forward(reference, sdk_sampler, library_sampler):
    lsm = log_softmax_rows(reference, PROMPT)[:-1]  # row i scores prompt position i + 1
    rng = np.random.default_rng(2)
    ids = rng.integers(0, lsm.shape[1], size=(len(PROMPT) - 1, 3))
    ids[0, :] = -1  # a row that asks nothing
    ids[2, 1] = -1
    ids[:, 0] = PROMPT[1:]  # the prompt's own tokens: the plain prompt logprobs
    ids[0, 0] = -1
    expected = np.where(ids >= 0, lsm.gather(-1, torch.from_numpy(ids).clamp(min=0)).numpy(), 0.0)
    params = tinker.SamplingParams(max_tokens=1)
    dense = sdk_sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, params, include_prompt_logprobs=True,
                               target_prompt_logprobs=tinker.TensorData.from_torch(torch.from_numpy(ids)),
                               ).result(timeout=120)
    got = dense.target_prompt_logprobs
    assert got.sparse_crow_indices is None and list(got.shape) == list(ids.shape)
    np.testing.assert_allclose(got.to_numpy(), expected, atol=1e-4)
    np.testing.assert_allclose(got.to_numpy()[1:, 0], dense.prompt_logprobs[2:], atol=1e-5)

    # A few cells of a wide tensor: the SDK sends it as CSR, and the answer keeps the request's indices.
    few = np.full((len(PROMPT) - 1, 20), -1, dtype=np.int64)
    for row, col, token in ((1, 3, 17), (1, 19, 4), (4, 0, PROMPT[5]), (6, 7, 60)):
        few[row, col] = token
    request = tinker.TensorData.from_torch_sparse(torch.from_numpy(few), pad_value=-1)
    assert request.sparse_crow_indices is not None
    sparse = sdk_sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, params, target_prompt_logprobs=request,
                                ).result(timeout=120).target_prompt_logprobs
    assert (sparse.sparse_crow_indices, sparse.sparse_col_indices) == (request.sparse_crow_indices,
                                                                       request.sparse_col_indices)
    expected_few = np.where(few >= 0, lsm.gather(-1, torch.from_numpy(few).clamp(min=0)).numpy(), 0.0)
    np.testing.assert_allclose(sparse.to_torch().to_dense().numpy(), expected_few, atol=1e-4)

    lib = library_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1),
                                 target_prompt_logprobs=ids).result(timeout=120)
    np.testing.assert_allclose(lib.target_prompt_logprobs.to_numpy(), expected, atol=1e-4)


def test_prompt_alt_tokens_are_draws_from_the_model_with_their_logprobs(reference, sdk_sampler, library_sampler):
    lsm = log_softmax_rows(reference, PROMPT)[:-1]
    k = 3000
    out = sdk_sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(
        max_tokens=1, temperature=1.0, seed=8), prompt_alt_tokens_k=k).result(timeout=120).prompt_alt_tokens
    tokens, logprobs = out.tokens.to_torch(), out.logprobs.to_torch()
    assert tuple(tokens.shape) == tuple(logprobs.shape) == (len(PROMPT) - 1, k)
    # Each draw's logprob is the model's log p of that token there (temperature 1).
    np.testing.assert_allclose(logprobs.numpy(), lsm.gather(-1, tokens).numpy(), atol=1e-4)
    # The draws follow the model's distribution: empirical frequencies within 4 standard errors of p.
    probs = lsm.exp()
    for i in range(tokens.shape[0]):
        freq = torch.bincount(tokens[i], minlength=probs.shape[1]).double() / k
        bound = 4 * (probs[i].double() * (1 - probs[i].double()) / k).sqrt() + 1e-3
        assert bool(((freq - probs[i]).abs() <= bound).all()), f"position {i + 1}"
    # At temperature 0 every draw is the most likely token; a seed gives the same draws on the producer's path.
    greedy_alt = library_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(
        max_tokens=1, temperature=0.0), prompt_alt_tokens_k=2).result(timeout=120).prompt_alt_tokens
    assert (greedy_alt.tokens.to_numpy() == lsm.argmax(-1, keepdim=True).expand(-1, 2).numpy()).all()
    again = library_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(
        max_tokens=1, temperature=1.0, seed=8), prompt_alt_tokens_k=k).result(timeout=120).prompt_alt_tokens
    assert (again.tokens.to_numpy() == tokens.numpy()).all()


def test_malformed_options_are_final_400s_that_say_what_to_fix(sdk_sampler):
    prompt = tinker.ModelInput.from_ints(PROMPT)
    wrong_rows = torch.zeros((len(PROMPT), 1), dtype=torch.int64)
    with pytest.raises(tinker.BadRequestError, match=r"exactly len\(prompt\) - 1 = 7"):
        sdk_sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=1),
                           target_prompt_logprobs=tinker.TensorData.from_torch(wrong_rows)).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="names no token id"):
        sdk_sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=1), target_prompt_logprobs=tinker.TensorData
                           .from_torch(torch.full((len(PROMPT) - 1, 2), -1, dtype=torch.int64))).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs must be an integer from 0"):
        sdk_sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=1), topk_prompt_logprobs=5000).result(timeout=60)


# -- what SDK 0.38 names without defining: refused, saying so ----------------------------------------------------


def test_stable_reinforce_and_stability_info_are_refused_as_undefined_by_the_sdk(sdk, reference, redis_url):
    from tinkerq import errors
    from tinkerq.producer import ServiceClient

    undefined = "the tinker SDK \\(0.38\\)"
    tc = sdk.create_lora_training_client(base_model=NAME, rank=4, seed=1).result()
    tokens = [*PROMPT, 3, 8]
    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tinker.TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]),
        "logprobs": tinker.TensorData(data=[-1.0] * (len(tokens) - 1), dtype="float32", shape=[len(tokens) - 1]),
        "advantages": tinker.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32", shape=[len(tokens) - 1]),
        "weights": tinker.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32", shape=[len(tokens) - 1])})
    with pytest.raises(tinker.BadRequestError, match=f"stable_reinforce' is not served: {undefined} names it"):
        tc.forward_backward([datum], "stable_reinforce").result(timeout=60)
    # The refused position was filled: the run's next request answers, with the base model's numbers (a new
    # LoRA adapter changes nothing) from a plain forward. (Dimuon is served: tests/test_sdk_dimuon.py.)
    out = tc.forward([datum], "cross_entropy").result(timeout=120)
    expected = log_softmax_rows(reference, tokens[:-1]).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), expected.numpy(), atol=1e-4)
    stable = sdk.create_sampling_client(base_model=NAME, record_stability_info=True).result()
    with pytest.raises(tinker.BadRequestError, match=f"record_stability_info is not served: {undefined} does not"):
        stable.sample(tinker.ModelInput.from_ints(PROMPT), 1, tinker.SamplingParams(max_tokens=2)).result(timeout=60)
    # The producer says the same.
    service = ServiceClient(broker_url=redis_url)
    try:
        with pytest.raises(errors.UserError, match=f"record_stability_info is not served: {undefined}"):
            service.create_sampling_client(base_model=NAME, record_stability_info=True)
    finally:
        service.close()
