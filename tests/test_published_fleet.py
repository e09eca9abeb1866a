"""Every published checkpoint layout (recipes/published.py: per-expert bf16 shards, dense tied bf16, gpt-oss MXFP4,
DeepSeek-V3 block FP8, Kimi-K2 INT4) served by a real `tinkerq worker` process and driven by the official tinker SDK
through `tinkerq gateway`, as a user points a trainer at a maker's repository:

- a fresh LoRA session's forward equals plain transformers on the float model the checkpoint means (every stored
  weight dequantized by the format's definition, recipes.published.reference_model);
- two forward_backward + optim_step rounds train (the loss falls on the trained batch);
- save_state, then a new client from that state: its forward is the saved session's, bitwise;
- the sampling client of the saved weights samples, and its tokens' logprobs are the session's own forward.

The MXFP4 and INT4 layouts run a second time with `--quantized-base keep` (the base held as stored): the same
checks, and the kept base's logprobs equal the dequantized reference too.

Under scripts/test (CI) the worker and the gateway run on the plain install it builds, `pip install -e
'.[worker,gateway]'` without the dev extras (.venv-plain, fixture plain_install_python): a run-time dependency only
the dev extras bring fails here; the SDK, the client, runs in the test's own environment.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import start_named_worker
from tests.helpers import make_batch
from tests.test_gateway import sdk_batch, start_gateway
from tinkerq import types
from tinkerq.recipes.published import LAYOUTS, build_published, reference_model

pytestmark = pytest.mark.timeout(240)
tinker = pytest.importorskip("tinker")

CASES = [(layout, "dequantize") for layout in LAYOUTS] + [("gpt_oss-mxfp4", "keep"), ("kimi_k2-int4", "keep")]


@pytest.fixture(scope="module")
def api_key(redis_url):
    from tinkerq.settings import Settings
    from tinkerq.tenants import ApiKeys

    keys = ApiKeys.open(Settings(broker_url=redis_url))
    yield keys.create("published")
    keys.close()


@pytest.fixture(scope="module")
def gateway_url(redis_url, plain_install_python, tmp_path_factory):
    proc, url = start_gateway(redis_url, tmp_path_factory.mktemp("logs") / "gateway.log", python=plain_install_python)
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published")
    return {name: build_published(name, root / name, seed=1) for name in LAYOUTS}


@pytest.fixture(params=CASES, ids=[f"{layout}-{held}" for layout, held in CASES])
def served(request, checkpoints, redis_url, checkpoint_dir, plain_install_python, tmp_path):
    layout, held = request.param
    name = f"published/{layout}/{held}"
    log = tmp_path / "worker.log"
    proc = start_named_worker(checkpoints[layout], redis_url, name, log,
                              env={"TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir)},
                              extra=["--dtype", "float32", "--quantized-base", held], python=plain_install_python)
    yield layout, held, name, log
    proc.terminate()
    proc.wait(30)


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def _logprobs(out) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data, dtype=np.float64) for o in out.loss_fn_outputs]


def test_published_checkpoint_through_a_worker_and_the_sdk(served, checkpoints, gateway_url, api_key, monkeypatch):
    layout, held, name, log = served
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    rng = np.random.default_rng(7)
    vocab = int(reference_model(checkpoints[layout]).config.vocab_size)
    probe = [_datum([int(t) for t in rng.integers(3, vocab, n)]) for n in (9, 14, 5)]  # variable lengths
    train = make_batch(rng, 3, max_len=16)

    # The float model the checkpoint means, in plain transformers: each probe's target logprobs.
    reference = reference_model(checkpoints[layout])
    want = []
    with torch.no_grad():
        for d in probe:
            ids = torch.tensor([d.model_input.to_ints()])
            lp = torch.log_softmax(reference(ids).logits.float()[0], -1)
            targets = torch.tensor(d.loss_fn_inputs["target_tokens"].to_numpy())
            want.append(lp.gather(-1, targets[:, None])[:, 0].double().numpy())

    with tinker.ServiceClient(base_url=gateway_url, api_key=api_key) as sdk:
        lora = sdk.create_lora_training_client(base_model=name, rank=4, seed=3).result()
        # A fresh adapter (B = 0) leaves the base as it is: the worker's base is the checkpoint's float model.
        for got, ref in zip(_logprobs(lora.forward(sdk_batch(probe), "cross_entropy").result(timeout=120)), want,
                            strict=True):
            np.testing.assert_allclose(got, ref, atol=1e-4)

        adam = tinker.AdamParams(learning_rate=2e-2)
        losses = []
        for _ in range(3):
            fb = lora.forward_backward(sdk_batch(train), "cross_entropy")
            step = lora.optim_step(adam)
            losses.append(fb.result(timeout=120).metrics["loss:sum"])
            assert step.result(timeout=120).metrics["grad_norm:mean"] > 0
        assert losses[-1] < losses[0], losses

        trained = _logprobs(lora.forward(sdk_batch(probe), "cross_entropy").result(timeout=120))
        assert max(float(np.abs(a - b).max()) for a, b in zip(trained, want, strict=True)) > 1e-4  # it trained

        # save_state and a new client from it: the saved session's logprobs, bitwise.
        saved = lora.save_state(f"published-{layout}-{held}", ttl_seconds=3600).result(timeout=120).path
        reloaded = sdk.create_training_client_from_state(saved).result(timeout=120)
        again = _logprobs(reloaded.forward(sdk_batch(probe), "cross_entropy").result(timeout=120))
        for a, b in zip(again, trained, strict=True):
            np.testing.assert_array_equal(a, b)

        # The sampler of the saved weights: its sampled tokens' logprobs are the session's forward.
        sampler = lora.save_weights_and_get_sampling_client().result(timeout=120)
        prompt = probe[1].model_input.to_ints()[:6]
        params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
        seq = sampler.sample(tinker.ModelInput.from_ints(prompt), 1, params).result(timeout=120).sequences[0]
        assert len(seq.tokens) >= 1
        tokens = prompt + list(seq.tokens)
        session = _logprobs(lora.forward(sdk_batch([_datum(tokens)]), "cross_entropy").result(timeout=120))[0]
        np.testing.assert_allclose(seq.logprobs, session[len(prompt) - 1:], atol=1e-4)
    if held == "keep":
        assert "kept as stored" in log.read_text()
