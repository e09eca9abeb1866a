"""Every model family through a real worker process (one per family, its tiny model loaded with from_pretrained):
a full session's forward_backward (the producer library) against the HF forward, and, driven by the official
tinker SDK through `tinkerq gateway`, a rank-4 LoRA session's forward_backward, optim_step, sampling client
(8 sampled tokens whose logprobs equal the session's own forward, and prompt logprobs through
compute_logprobs), and the merged export of the adapter, which gives the session's logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from tests.conftest import start_named_worker
from tests.helpers import make_batch, reference_logprobs
from tests.test_gateway import sdk_batch, start_gateway
from tinkerq import types
from tinkerq.errors import ValidationError
from tinkerq.recipes.families import FAMILIES, TEXT_OF_VISION_LANGUAGE, build_family

pytestmark = pytest.mark.timeout(180)
tinker = pytest.importorskip("tinker")


@pytest.fixture(scope="module")
def api_key(redis_url):
    from tinkerq.settings import Settings
    from tinkerq.tenants import ApiKeys

    keys = ApiKeys.open(Settings(broker_url=redis_url))
    yield keys.create("families")
    keys.close()


@pytest.fixture(scope="module")
def gateway_url(redis_url, tmp_path_factory):
    proc, url = start_gateway(redis_url, tmp_path_factory.mktemp("logs") / "gateway.log")
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def families_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.fixture(params=list(FAMILIES))
def family_worker(request, families_dir, redis_url, checkpoint_dir, tmp_path):
    family = request.param
    model_dir = build_family(family, families_dir / family)
    name = f"tiny/{family}"
    proc = start_named_worker(model_dir, redis_url, name, tmp_path / "worker.log",
                              env={"TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir)})
    yield family, name, model_dir
    proc.terminate()
    proc.wait(30)


def test_family_full_lora_and_sampling_through_a_worker(family_worker, redis_url, gateway_url, api_key, monkeypatch):
    from tinkerq.producer import ServiceClient

    family, name, model_dir = family_worker
    # transformers' own class for the checkpoint (a vision-language one for some, fed text only here)
    auto = AutoModelForImageTextToText if family in TEXT_OF_VISION_LANGUAGE else AutoModelForCausalLM
    hf = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(4)
    service = ServiceClient(broker_url=redis_url)
    try:
        # A rank no target of the tiny model allows: one user error naming the fix, and the worker keeps serving.
        with pytest.raises(ValidationError, match=r"LoRA rank 64 is larger than .* use rank <= "):
            service.create_lora_training_client(name, rank=64).result(timeout=60)
        full = service.create_training_client(name)
        data = make_batch(rng, 3, max_len=20)
        out = full.forward_backward(data, "cross_entropy").result(timeout=120)
        with torch.no_grad():
            for d, o in zip(data, out.loss_fn_outputs, strict=True):
                np.testing.assert_allclose(o["logprobs"].to_numpy(), reference_logprobs(hf, d).numpy(), atol=1e-5)
        full.close()
    finally:
        service.close()

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker.ServiceClient(base_url=gateway_url, api_key=api_key) as sdk:  # closed: no heartbeat outlives it
        lora = sdk.create_lora_training_client(base_model=name, rank=4, seed=3).result()
        adam = tinker.AdamParams(learning_rate=1e-2)
        for _ in range(2):
            fb = lora.forward_backward(sdk_batch(make_batch(rng, 2, max_len=20)), "cross_entropy")
            step = lora.optim_step(adam)
            assert fb.result(timeout=120).metrics["loss:sum"] > 0
            assert step.result(timeout=120).metrics["grad_norm:mean"] > 0
        sampler = lora.save_weights_and_get_sampling_client().result()
        prompt = [5, 9, 2, 7, 11, 4]
        params = tinker.SamplingParams(max_tokens=8, temperature=1.0, seed=5)
        seq = sampler.sample(tinker.ModelInput.from_ints(prompt), 1, params).result(timeout=120).sequences[0]
        assert len(seq.tokens) >= 1
        # The sampled tokens' logprobs are the session's own forward of prompt + completion.
        tokens = prompt + list(seq.tokens)
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        forward = lora.forward(sdk_batch([datum]), "cross_entropy").result(timeout=120)
        session_lp = np.asarray(forward.loss_fn_outputs[0]["logprobs"].data)
        np.testing.assert_allclose(seq.logprobs, session_lp[len(prompt) - 1:], atol=1e-4)
        prompt_lp = sampler.compute_logprobs(tinker.ModelInput.from_ints(tokens)).result(timeout=120)
        np.testing.assert_allclose(np.asarray(prompt_lp[1:], dtype=np.float64), session_lp, atol=1e-4)
