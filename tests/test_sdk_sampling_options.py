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
def sdk_sampler(gateway_url: str, api_key: str) -> Iterator:
    import os

    os.environ["TINKER_TELEMETRY"] = "0"
    with tinker.ServiceClient(base_url=gateway_url, api_key=api_key) as sdk:
        yield sdk.create_sampling_client(base_model=NAME).result()


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
