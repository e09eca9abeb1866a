"""The official tinker SDK (0.38.0), unmodified, against a real `tinkerq gateway`, worker and Redis.

The worker serves the tiny test model under a cookbook name (``meta-llama/Llama-3.2-1B``); two tenants
have API keys. Raw HTTP (requests) checks what the SDK never sends: resends, out-of-order chunks,
malformed bodies, other tenants' ids.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import requests
import torch

from tests.conftest import start_named_worker
from tests.helpers import load_reference, make_batch, reference_logprobs
from tinkerq import keys, types
from tinkerq.launcher.processes import free_port, gateway_command, gateway_up, start_process, wait_for
from tinkerq.settings import Settings
from tinkerq.tenants import ApiKeys

tinker = pytest.importorskip("tinker")
from tinker.proto import tinker_public_pb2  # noqa: E402

pytestmark = pytest.mark.timeout(300)
NAME = "meta-llama/Llama-3.2-1B"
POLL_S = 2  # the gateway's long-poll in these tests (25 s in production)
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}


@pytest.fixture(scope="module")
def named_worker(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[subprocess.Popen]:
    log = tmp_path_factory.mktemp("logs") / "gateway-worker.log"
    proc = start_named_worker(model_dir, redis_url, NAME, log, env={
        "TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir), "TINKERQ_GAP_TIMEOUT_S": "3"})
    yield proc
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def api_keys(redis_url: str) -> Iterator[dict[str, str]]:
    keys = ApiKeys.open(Settings(broker_url=redis_url))
    made = {}
    for tenant in ("alice", "bob"):
        name = f"{tenant}-{uuid.uuid4().hex[:6]}"
        made[tenant] = keys.create(name)
    yield made
    keys.close()


def start_gateway(redis_url: str, log: Path, python: str | None = None) -> tuple[subprocess.Popen, str]:
    """A gateway on a free port (``python``: another interpreter to run it on), answering when this returns."""
    port = free_port()
    cmd = gateway_command(redis_url, port)
    proc = start_process([python or cmd[0], *cmd[1:]], log, {"TINKERQ_GATEWAY_POLL_S": str(POLL_S)})
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: gateway_up(url), 60, "tinkerq gateway", proc, log)
    return proc, url


@pytest.fixture(scope="module")
def gateway_url(redis_url: str, named_worker, tmp_path_factory) -> Iterator[str]:
    proc, url = start_gateway(redis_url, tmp_path_factory.mktemp("logs") / "gateway.log")
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture
def sdk(gateway_url: str, api_keys, monkeypatch) -> Iterator:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    sc = tinker.ServiceClient(base_url=gateway_url, api_key=api_keys["alice"])
    yield sc


def sdk_batch(data: list[types.Datum]) -> list:
    return [tinker.Datum(model_input=tinker.ModelInput.from_ints(d.model_input.to_ints()),
                         loss_fn_inputs={k: tinker.TensorData(data=v.to_numpy().tolist(), dtype=_dtype(v),
                                                              shape=list(v.shape))
                                         for k, v in d.loss_fn_inputs.items()})
            for d in data]


def _dtype(t: types.TensorData) -> str:
    return "int64" if t.to_numpy().dtype.kind in "iu" else "float32"


def post(url: str, path: str, key: str, body: dict | bytes, *, proto: bool = False) -> requests.Response:
    headers = {"X-API-Key": key}
    if proto:
        headers["Content-Type"] = "application/x-protobuf"
        return requests.post(f"{url}/api/v1/{path}", data=body, headers=headers, timeout=60)
    return requests.post(f"{url}/api/v1/{path}", json=body, headers=headers, timeout=60)


def fb_proto(model_id: str, seq_id: int, data: list[types.Datum], *, forward_only: bool = False) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=sdk_batch(data), loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def result(url: str, key: str, request_id: str, timeout: float = 120) -> requests.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = post(url, "retrieve_future", key, {"request_id": request_id, "allow_metadata_only": False})
        if r.status_code != 408 or time.monotonic() > deadline:
            return r


def library_loss_after_one_step(redis_url: str, seed: int, chunks: list[list[types.Datum]]) -> float:
    """The producer library's answer: a rank-4 LoRA run that accumulates ``chunks`` once each, takes one step,
    then computes the forward loss of ``chunks[0]``."""
    from tinkerq.producer import ServiceClient

    ours = ServiceClient(broker_url=redis_url)
    try:
        mine = ours.create_lora_training_client(NAME, rank=4, seed=seed).result(timeout=120)
        for chunk in chunks:
            mine.forward_backward(chunk, "cross_entropy")
        mine.optim_step(types.AdamParams(**ADAM)).result(timeout=120)
        loss = mine.forward(chunks[0], "cross_entropy").result(timeout=120).metrics["loss:sum"]
        mine.close()
        return loss
    finally:
        ours.close()


# -- the SDK, end to end ---------------------------------------------------------------------------------------


def test_sdk_lora_training_matches_the_producer_library_and_pytorch(sdk, model_dir, redis_url, gateway_url, api_keys):
    """The same LoRA run through the SDK + gateway and through the producer library: equal numbers."""
    from tinkerq.producer import ServiceClient

    caps = tinker.RestClient(base_url=gateway_url, api_key=api_keys["alice"]).get_server_capabilities().result()
    assert NAME in [m.model_name for m in caps.supported_models]
    rng = np.random.default_rng(5)
    batches = [make_batch(rng, 3, max_len=20) for _ in range(2)]
    tc = sdk.create_lora_training_client(NAME, rank=4, seed=11).result(timeout=120)
    info = tc.get_info()
    assert info.model_data.model_name == NAME and info.is_lora and info.lora_rank == 4
    assert tc.model_id.endswith(":train:0")

    ours = ServiceClient(broker_url=redis_url)
    try:
        mine = ours.create_lora_training_client(NAME, rank=4, seed=11)
        for batch in batches:
            a = tc.forward_backward(sdk_batch(batch), "cross_entropy").result()
            b = mine.forward_backward(batch, "cross_entropy").result(timeout=120)
            assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-6)
            for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
                np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), rtol=1e-6, atol=1e-6)
            tc.optim_step(tinker.AdamParams(**ADAM)).result()
            mine.optim_step(types.AdamParams(**ADAM)).result(timeout=120)
        after_a = tc.forward(sdk_batch(batches[0]), "cross_entropy").result()
        after_b = mine.forward(batches[0], "cross_entropy").result(timeout=120)
        for x, y in zip(after_a.loss_fn_outputs, after_b.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), rtol=1e-6, atol=1e-6)
        mine.close()
    finally:
        ours.close()


def test_sdk_full_cycle_save_load_sample_and_rest(sdk, redis_url, gateway_url, api_keys):
    """Everything a cookbook loop does, through the SDK (whose API makes LoRA models only)."""
    from tinkerq.producer import ServiceClient

    rng = np.random.default_rng(6)
    batch = make_batch(rng, 4, max_len=16)
    tc = sdk.create_lora_training_client(NAME, rank=4, seed=3).result(timeout=120)
    tc.forward_backward(sdk_batch(batch), "cross_entropy").result()
    step = tc.optim_step(tinker.AdamParams(**ADAM)).result()
    assert isinstance(step.metrics, dict)

    state = tc.save_state("ckpt-1", ttl_seconds=3600).result()
    assert state.path == f"tinker://{tc.model_id}/weights/ckpt-1"
    sampler_path = tc.save_weights_for_sampler("smp-1").result().path
    assert sampler_path == f"tinker://{tc.model_id}/sampler_weights/smp-1"
    before = tc.forward(sdk_batch(batch), "cross_entropy").result()

    # Ephemeral snapshot + sampling with sequence ids, logprobs, prompt logprobs.
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=120)
    prompt = tinker.ModelInput.from_ints([1, 2, 3, 4, 5])
    params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=123, stop=None)
    out = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(out.sequences) == 3
    for seq in out.sequences:
        assert seq.sequence_id and seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason in ("stop", "length")
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in out.sequences]  # same seed, same tokens
    logprobs = sampler.compute_logprobs(tinker.ModelInput.from_ints(batch[0].model_input.to_ints())).result()
    assert logprobs[0] is None
    np.testing.assert_allclose(logprobs[1:], before.loss_fn_outputs[0]["logprobs"].to_numpy()[:-1],
                               rtol=1e-4, atol=1e-4)

    # A named sampler checkpoint through create_sampling_client (create_sampling_session + GET samplers).
    by_path = sdk.create_sampling_client(model_path=sampler_path).result(timeout=120)
    assert by_path.get_base_model() == NAME
    assert len(by_path.sample(prompt, 2, params).result().sequences) == 2
    base = sdk.create_sampling_client(base_model=NAME).result(timeout=120)
    assert len(base.sample(prompt, 1, params).result().sequences) == 1

    # The legacy in-run load (TrainingClient.load_state: model_id + seq_id) after more training.
    tc.forward_backward(sdk_batch(batch), "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(**ADAM)).result()
    with pytest.deprecated_call(match="load_state"):  # deliberately the deprecated call (the legacy endpoint)
        tc.load_state(state.path).result()
    back = tc.forward(sdk_batch(batch), "cross_entropy").result()
    for x, y in zip(back.loss_fn_outputs, before.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), rtol=1e-5, atol=1e-5)

    # More training, then resume from the state: weights only, and with the optimizer. Each equals the
    # producer library resuming from the same directory the same way (fresh vs continued AdamW differ).
    tc.forward_backward(sdk_batch(batch), "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(**ADAM)).result()
    directory = json.loads(redis.Redis.from_url(redis_url).get(f"tinkerq:gw:checkpoint:{state.path}"))["directory"]
    ours = ServiceClient(broker_url=redis_url)
    stepped = {}
    try:
        for with_optimizer in (False, True):
            make = (sdk.create_training_client_from_state_with_optimizer if with_optimizer
                    else sdk.create_training_client_from_state)
            resumed = make(state.path).result()
            assert resumed.get_info().is_lora
            got = resumed.forward(sdk_batch(batch), "cross_entropy").result()
            for x, y in zip(got.loss_fn_outputs, before.loss_fn_outputs, strict=True):
                np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), rtol=1e-5, atol=1e-5)
            resumed.forward_backward(sdk_batch(batch), "cross_entropy").result()  # its requests continue in order
            resumed.optim_step(tinker.AdamParams(**ADAM)).result()
            stepped[with_optimizer] = resumed.forward(sdk_batch(batch), "cross_entropy").result()

            mine = (ours.create_training_client_from_state_with_optimizer if with_optimizer
                    else ours.create_training_client_from_state)(directory).result(timeout=120)
            mine.forward_backward(batch, "cross_entropy")
            mine.optim_step(types.AdamParams(**ADAM))
            want = mine.forward(batch, "cross_entropy").result(timeout=120)
            assert stepped[with_optimizer].metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
            mine.close()
    finally:
        ours.close()
    assert stepped[False].metrics["loss:sum"] != pytest.approx(stepped[True].metrics["loss:sum"], rel=1e-6)

    # The REST lookups the cookbook uses.
    rest = tinker.RestClient(base_url=gateway_url, api_key=api_keys["alice"])
    run = rest.get_training_run_by_tinker_path(state.path).result()
    assert run.training_run_id == tc.model_id and run.base_model == NAME and run.is_lora
    ids = {c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert ids == {"weights/ckpt-1", "sampler_weights/smp-1"}
    assert tc.model_id in [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]
    info = rest.get_weights_info_by_tinker_path(state.path).result()
    assert info.base_model == NAME and info.lora_rank == 4
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        sdk.create_sampling_client(model_path=sampler_path).result()


def test_with_service_client_finishes_the_session(gateway_url, api_keys, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker.ServiceClient(base_url=gateway_url, api_key=api_keys["alice"]) as sc:
        tc = sc.create_lora_training_client(NAME, rank=2).result(timeout=120)
        tc.forward(sdk_batch(make_batch(np.random.default_rng(1), 1)), "cross_entropy").result()
        session_id = sc.holder.get_session_id()
        alive = post(gateway_url, "session_heartbeat", api_keys["alice"], {"session_id": session_id})
        assert alive.status_code == 200
    r = post(gateway_url, "session_heartbeat", api_keys["alice"], {"session_id": session_id,
                                                                   "type": "session_heartbeat"})
    assert r.status_code == 410


# -- the protocol's guarantees, over raw HTTP -------------------------------------------------------------------


@pytest.fixture
def raw_model(gateway_url, api_keys) -> tuple[str, str]:
    key = api_keys["alice"]
    session = post(gateway_url, "create_session", key, {"tags": [], "sdk_version": "test"}).json()["session_id"]
    promise = post(gateway_url, "create_model", key, {
        "session_id": session, "model_seq_id": 0, "base_model": NAME,
        "lora_config": {"rank": 4, "seed": 9, "train_mlp": True, "train_attn": True, "train_unembed": True}}).json()
    assert result(gateway_url, key, promise["request_id"]).json()["model_id"] == promise["model_id"]
    return promise["model_id"], session


def test_resends_are_answered_once_and_chunks_run_in_seq_order(gateway_url, api_keys, raw_model, redis_url):
    key, (model_id, _session) = api_keys["alice"], raw_model
    rng = np.random.default_rng(8)
    chunks = [make_batch(rng, 2, max_len=12) for _ in range(3)]
    # Chunks 2 and 3 before chunk 1 (the SDK's order), chunk 3 sent twice: accumulated once each.
    ids = {}
    for seq in (3, 2, 3, 1):
        r = post(gateway_url, "forward_backward", key, fb_proto(model_id, seq, chunks[seq - 1]), proto=True)
        assert r.status_code == 200, r.text
        ids.setdefault(seq, r.json()["request_id"])
        assert r.json()["request_id"] == ids[seq]
    step = post(gateway_url, "optim_step", key, {"model_id": model_id, "seq_id": 4, "adam_params": ADAM,
                                                 "type": "optim_step"}).json()
    assert post(gateway_url, "optim_step", key, {"model_id": model_id, "seq_id": 4, "adam_params": ADAM,
                                                 "type": "optim_step"}).json() == step  # resend: same promise
    for seq in (1, 2, 3):
        r = result(gateway_url, key, ids[seq])
        assert r.headers["content-type"] == "application/x-protobuf"
        out = tinker_public_pb2.ForwardBackwardOutput.FromString(r.content)
        assert out.metrics["loss:sum"] > 0
    assert "metrics" in result(gateway_url, key, step["request_id"]).json()
    # A seq_id reused by another kind of request is refused (400, final), and nothing ran twice: a forward
    # now equals a producer-library run of the same three chunks + one step.
    r = post(gateway_url, "optim_step", key, {"model_id": model_id, "seq_id": 2, "adam_params": ADAM})
    assert r.status_code == 400 and "already used" in r.json()["detail"]
    fwd = post(gateway_url, "forward_backward", key, fb_proto(model_id, 5, chunks[0], forward_only=True), proto=True)
    got = tinker_public_pb2.ForwardBackwardOutput.FromString(result(gateway_url, key, fwd.json()["request_id"]).content)

    assert got.metrics["loss:sum"] == pytest.approx(library_loss_after_one_step(redis_url, 9, chunks), rel=1e-6)


def test_long_poll_waits_then_answers_try_again(gateway_url, api_keys, raw_model):
    key, (model_id, _session) = api_keys["alice"], raw_model
    batch = make_batch(np.random.default_rng(3), 1)
    # seq 2 waits for seq 1, which is never sent: its future stays pending.
    r = post(gateway_url, "forward_backward", key, fb_proto(model_id, 2, batch, forward_only=True), proto=True)
    started = time.monotonic()
    poll = post(gateway_url, "retrieve_future", key, {"request_id": r.json()["request_id"]})
    waited = time.monotonic() - started
    assert poll.status_code == 408 and poll.json()["type"] == "try_again"
    assert waited >= POLL_S * 0.9  # held, not a hot loop
    # After the worker's gap timeout (3 s here) the request fails as a final, categorised error.
    answer = result(gateway_url, key, r.json()["request_id"]).json()
    assert answer["category"] in ("user", "server") and answer["error"]


def test_tenants_cannot_see_each_other(gateway_url, api_keys, raw_model, sdk):
    alice, bob = api_keys["alice"], api_keys["bob"]
    model_id, session = raw_model
    batch = make_batch(np.random.default_rng(4), 1)
    r = post(gateway_url, "forward_backward", alice, fb_proto(model_id, 1, batch, forward_only=True), proto=True)
    request_id = r.json()["request_id"]
    save = post(gateway_url, "save_weights", alice, {"model_id": model_id, "path": "mine", "seq_id": 2})
    path = result(gateway_url, alice, save.json()["request_id"]).json()["path"]
    for endpoint, body in [
        ("get_info", {"model_id": model_id}),
        ("optim_step", {"model_id": model_id, "seq_id": 3, "adam_params": ADAM}),
        ("retrieve_future", {"request_id": request_id}),
        ("session_heartbeat", {"session_id": session}),
        ("create_model", {"session_id": session, "model_seq_id": 5, "base_model": NAME}),
        ("load_weights", {"session_id": session, "model_seq_id": 6, "path": path, "optimizer": True}),
        ("weights_info", {"tinker_path": path}),
    ]:
        r = post(gateway_url, endpoint, bob, body)
        assert r.status_code == 404, (endpoint, r.status_code, r.text)
    r = post(gateway_url, "forward_backward", bob, fb_proto(model_id, 3, batch), proto=True)
    assert r.status_code == 404
    bob_session = post(gateway_url, "create_session", bob, {}).json()["session_id"]
    r = post(gateway_url, "load_weights", bob, {"session_id": bob_session, "model_seq_id": 0, "path": path,
                                               "optimizer": False})
    assert r.status_code == 404
    r = requests.get(f"{gateway_url}/api/v1/training_runs/{model_id}", headers={"X-API-Key": bob}, timeout=30)
    assert r.status_code == 404
    # Alice's own view still works.
    assert result(gateway_url, alice, request_id).status_code == 200


def test_unknown_and_revoked_keys_get_401(gateway_url, redis_url, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=gateway_url, api_key="tml-not-a-key").get_server_capabilities().result()
    keys = ApiKeys.open(Settings(broker_url=redis_url))
    name = f"carol-{uuid.uuid4().hex[:6]}"
    key = keys.create(name)
    try:
        rest = tinker.RestClient(base_url=gateway_url, api_key=key)
        assert rest.get_server_capabilities().result().supported_models
        keys.revoke(name)
        time.sleep(1.5)  # the gateway trusts a key it checked for up to 1 s
        r = post(gateway_url, "create_session", key, {})
        assert r.status_code == 401 and "tinkerq keys create" in r.json()["detail"]
    finally:
        keys.close()


def test_bad_input_gets_final_4xx_with_a_reason(gateway_url, api_keys, raw_model):
    key, (model_id, _session) = api_keys["alice"], raw_model
    cases = [
        (post(gateway_url, "forward_backward", key, b"\xff\x00garbage", proto=True), 400, "protobuf"),
        (requests.post(f"{gateway_url}/api/v1/optim_step", data=b"{not json", timeout=30,
                       headers={"X-API-Key": key, "Content-Type": "application/json"}), 400, "JSON"),
        (post(gateway_url, "no_such_endpoint", key, {}), 404, "endpoint"),
        (post(gateway_url, "get_info", key, {"model_id": "nope:train:0"}), 404, "not found"),
        (post(gateway_url, "load_weights", key, {"model_id": model_id, "seq_id": 1, "optimizer": True,
                                                 "path": "/etc/passwd"}), 400, "tinker://"),
        (post(gateway_url, "save_weights", key, {"model_id": model_id, "seq_id": 2, "path": "../escape"}),
         400, "checkpoint name"),
        (post(gateway_url, "create_model", key, {"session_id": _session, "model_seq_id": 9,
                                                 "base_model": "no/such-model"}), 400, "not served"),
        (post(gateway_url, "create_model", key, {"session_id": _session, "model_seq_id": 10, "base_model": NAME,
                                                 "lora_config": {"rank": 100000}}), 400, "rank"),
        (post(gateway_url, "create_model", key, {"session_id": _session, "model_seq_id": 11, "base_model": NAME,
                                                 "optimizer_config": {"type": "lion"}}), 400, "'lion' is not served"),
    ]
    for response, status, fragment in cases:
        assert response.status_code == status, response.text
        assert fragment in response.json()["detail"], response.json()
    # Out-of-vocabulary token: refused at once; the position is filled, so the next request runs.
    bad = [types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                       loss_fn_inputs={"target_tokens": [3, 10**6], "weights": [1.0, 1.0]})]
    r = post(gateway_url, "forward_backward", key, fb_proto(model_id, 3, bad), proto=True)
    assert r.status_code == 400 and "vocab" in r.json()["detail"].lower()
    ok = post(gateway_url, "forward_backward", key,
              fb_proto(model_id, 4, make_batch(np.random.default_rng(2), 1), forward_only=True), proto=True)
    assert result(gateway_url, key, ok.json()["request_id"], timeout=60).status_code == 200
    big = requests.post(f"{gateway_url}/api/v1/forward_backward", data=b"\0" * (300 * 1024 * 1024 + 1),
                        headers={"X-API-Key": key, "Content-Type": "application/x-protobuf"}, timeout=60)
    assert big.status_code == 413


def test_reference_logprobs_match_the_gateway(sdk, model_dir):
    """The SDK's forward equals plain PyTorch on the served weights (fresh LoRA = the base model)."""
    ref = load_reference(model_dir)
    batch = make_batch(np.random.default_rng(12), 3, max_len=24)
    tc = sdk.create_lora_training_client(NAME, rank=2, seed=0).result(timeout=120)
    out = tc.forward(sdk_batch(batch), "cross_entropy").result()
    with torch.no_grad():
        for d, o in zip(batch, out.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(o["logprobs"].to_numpy(), reference_logprobs(ref, d).numpy(),
                                       rtol=1e-4, atol=1e-4)


def test_a_restarted_gateway_drives_the_same_runs_and_applies_nothing_twice(redis_url, named_worker, api_keys,
                                                                           tmp_path):
    """Runs and samplers are recorded in Redis; the worker sessions outlive the gateway process."""
    key = api_keys["alice"]
    first, url = start_gateway(redis_url, tmp_path / "gw1.log")
    rng = np.random.default_rng(17)
    chunks = [make_batch(rng, 2, max_len=12) for _ in range(2)]
    try:
        session = post(url, "create_session", key, {}).json()["session_id"]
        promise = post(url, "create_model", key, {"session_id": session, "model_seq_id": 0, "base_model": NAME,
                                                  "lora_config": {"rank": 4, "seed": 5}}).json()
        model_id = result(url, key, promise["request_id"]).json()["model_id"]
        r = post(url, "forward_backward", key, fb_proto(model_id, 1, chunks[0]), proto=True)
        assert result(url, key, r.json()["request_id"]).status_code == 200
    finally:
        first.terminate()
        first.wait(30)
    second, url = start_gateway(redis_url, tmp_path / "gw2.log")
    try:
        # The resend of seq 1 (its answer was lost with the old gateway) is answered, not applied again.
        for seq, chunk in ((1, chunks[0]), (2, chunks[1])):
            r = post(url, "forward_backward", key, fb_proto(model_id, seq, chunk), proto=True)
            assert r.status_code == 200, r.text
            assert result(url, key, r.json()["request_id"]).status_code == 200
        step = post(url, "optim_step", key, {"model_id": model_id, "seq_id": 3, "adam_params": ADAM})
        assert "metrics" in result(url, key, step.json()["request_id"]).json()
        fwd = post(url, "forward_backward", key, fb_proto(model_id, 4, chunks[0], forward_only=True), proto=True)
        got = tinker_public_pb2.ForwardBackwardOutput.FromString(result(url, key, fwd.json()["request_id"]).content)
    finally:
        second.terminate()
        second.wait(30)
    assert got.metrics["loss:sum"] == pytest.approx(library_loss_after_one_step(redis_url, 5, chunks), rel=1e-6)


def test_full_fine_tune_and_unload_over_raw_http(gateway_url, api_keys, model_dir, redis_url):
    """create_model without lora_config is a full fine-tune (the protocol allows it; the SDK never sends it)."""
    key = api_keys["alice"]
    session = post(gateway_url, "create_session", key, {}).json()["session_id"]
    promise = post(gateway_url, "create_model", key, {"session_id": session, "model_seq_id": 0, "base_model": NAME,
                                                      "optimizer_config": {"type": "adamw"}}).json()
    model_id = result(gateway_url, key, promise["request_id"]).json()["model_id"]
    info = post(gateway_url, "get_info", key, {"model_id": model_id}).json()
    assert info["is_lora"] is False and info["model_data"]["model_name"] == NAME
    batch = make_batch(np.random.default_rng(30), 2, max_len=12)
    r = post(gateway_url, "forward_backward", key, fb_proto(model_id, 1, batch, forward_only=True), proto=True)
    out = tinker_public_pb2.ForwardBackwardOutput.FromString(result(gateway_url, key, r.json()["request_id"]).content)
    ref = load_reference(model_dir)  # a fresh full copy: the served weights themselves
    with torch.no_grad():
        want = sum(-(reference_logprobs(ref, d).numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum()
                   for d in batch)
    assert out.metrics["loss:sum"] == pytest.approx(float(want), rel=1e-4)
    # The worker session behind the run (its home record goes when the session closes).
    r = redis.Redis.from_url(redis_url)
    session = json.loads(r.get(keys.gateway_record("run", model_id)))["info"]["model_id"]
    assert r.get(keys.session_home(session)) is not None
    unload = post(gateway_url, "unload_model", key, {"model_id": model_id}).json()
    assert result(gateway_url, key, unload["request_id"]).json()["model_id"] == model_id
    # Closed on the worker: the close came after the run's requests (not as a repeat of its request 1).
    assert r.get(keys.session_home(session)) is None
    r.close()
    assert post(gateway_url, "get_info", key, {"model_id": model_id}).status_code == 404
    r = post(gateway_url, "forward_backward", key, fb_proto(model_id, 2, batch), proto=True)
    assert r.status_code == 404


def test_another_tenant_cannot_sample_or_see_a_sampler(gateway_url, api_keys):
    alice, bob = api_keys["alice"], api_keys["bob"]
    session = post(gateway_url, "create_session", alice, {}).json()["session_id"]
    made = post(gateway_url, "create_sampling_session", alice, {"session_id": session, "sampling_session_seq_id": 0,
                                                                "base_model": NAME}).json()
    sampler_id = made["sampling_session_id"]
    sample = {"sampling_session_id": sampler_id, "seq_id": 0, "num_samples": 2,
              "prompt": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]},
              "sampling_params": {"max_tokens": 3, "seed": 1}}
    assert post(gateway_url, "asample", bob, sample).status_code == 404
    r = requests.get(f"{gateway_url}/api/v1/samplers/{sampler_id}", headers={"X-API-Key": bob}, timeout=30)
    assert r.status_code == 404
    promise = post(gateway_url, "asample", alice, sample).json()
    assert len(promise["sample_sequence_ids"]) == 2
    assert post(gateway_url, "asample", alice, sample).json() == promise  # a resend: the same promise
    got = tinker_public_pb2.SampleResponse.FromString(result(gateway_url, alice, promise["request_id"]).content)
    # tokens (int32) and logprobs (float32) as raw bytes: one logprob per sampled token
    assert len(got.sequences) == 2 and all(0 < len(s.tokens) == len(s.logprobs) for s in got.sequences)


def test_a_checkpoint_with_a_ttl_is_gone_after_it(gateway_url, api_keys, raw_model):
    key, (model_id, session) = api_keys["alice"], raw_model
    save = post(gateway_url, "save_weights", key, {"model_id": model_id, "path": "short-lived", "seq_id": 1,
                                                   "ttl_seconds": 1})
    path = result(gateway_url, key, save.json()["request_id"]).json()["path"]
    assert post(gateway_url, "weights_info", key, {"tinker_path": path}).status_code == 200
    time.sleep(1.5)
    assert post(gateway_url, "weights_info", key, {"tinker_path": path}).status_code == 404
    r = post(gateway_url, "load_weights", key, {"session_id": session, "model_seq_id": 7, "path": path,
                                               "optimizer": True})
    assert r.status_code == 404


def test_a_redis_outage_is_a_retryable_503_not_a_crash(tmp_path, api_keys):
    """The gateway's own records live in Redis: while it is away, calls get 503 (the SDK retries those), and the
    gateway serves again once it is back."""
    from tinkerq.launcher.processes import start_redis

    port = free_port()
    server = start_redis(port, tmp_path / "redis")
    url = f"redis://127.0.0.1:{port}/0"
    keys = ApiKeys.open(Settings(broker_url=url))
    key = keys.create("outage")
    keys.close()
    gateway, base = start_gateway(url, tmp_path / "gateway.log")
    try:
        assert post(base, "create_session", key, {}).status_code == 200
        server.terminate()
        server.wait(10)
        r = post(base, "create_session", key, {})
        assert r.status_code == 503 and "unreachable" in r.json()["detail"], r.text
        server = start_redis(port, tmp_path / "redis")
        keys = ApiKeys.open(Settings(broker_url=url))  # this Redis keeps nothing on disk: a new key
        key2 = keys.create("outage-2")
        keys.close()
        wait_for(lambda: post(base, "create_session", key2, {}).status_code == 200, 30, "the gateway after Redis")
        assert gateway.poll() is None
    finally:
        gateway.terminate()
        gateway.wait(30)
        server.terminate()
        server.wait(10)


def test_sdk_trains_lora_on_a_shard_group(sdk, model_dir, redis_url, checkpoint_dir, tmp_path_factory):
    """The official SDK (LoRA only) trains and samples a model served by a 2-shard group: the same numbers as the
    producer library's LoRA session on the unsharded worker."""
    from tests.test_sharding import ShardGroup
    from tinkerq.producer import ServiceClient

    name = f"{NAME}-sharded"
    group = ShardGroup(model_dir, redis_url, tmp_path_factory.mktemp("shard-logs"), checkpoint_dir, name)
    group.start(1)
    group.start(0)
    ours = ServiceClient(broker_url=redis_url)
    try:
        group.wait_serving(ours.connection)
        rng = np.random.default_rng(6)
        batches = [make_batch(rng, 3, max_len=20) for _ in range(2)]
        adam = {**ADAM, "eps": 1e-3}  # (tests/test_sharded_lora.py: AdamW's eps and reordered sums)
        tc = sdk.create_lora_training_client(name, rank=4, seed=11).result(timeout=120)
        mine = ours.create_lora_training_client(NAME, rank=4, seed=11)  # one unsharded worker
        for batch in batches:
            a = tc.forward_backward(sdk_batch(batch), "cross_entropy").result()
            b = mine.forward_backward(batch, "cross_entropy").result(timeout=120)
            assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
            tc.optim_step(tinker.AdamParams(**adam)).result()
            mine.optim_step(types.AdamParams(**adam)).result(timeout=120)
        after_a = tc.forward(sdk_batch(batches[0]), "cross_entropy").result()
        after_b = mine.forward(batches[0], "cross_entropy").result(timeout=120)
        for x, y in zip(after_a.loss_fn_outputs, after_b.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=1e-5)
        sampler = tc.save_weights_and_get_sampling_client().result(timeout=120)
        out = sampler.sample(prompt=tinker.ModelInput.from_ints([1, 2, 3]), num_samples=2,
                             sampling_params=tinker.SamplingParams(max_tokens=5, seed=4)).result()
        assert len(out.sequences) == 2 and all(len(s.tokens) == 5 for s in out.sequences)
        mine.close()
    finally:
        ours.close()
        group.stop()
