"""No call can leave a hole in a training run's sequence (gateway/positions.py).

The SDK numbers a training client's requests and the worker applies a run's requests in that order. Here the
worker's gap timeout is 600 s, so a position nobody fills would hold the run's next request far past the 60 s
these tests wait for it. In the middle of a pipelined SDK run, hostile and mistaken requests take the SDK's next
numbers (reserved through the SDK's own turn-taking, as one of its calls would): every POST route the gateway has
with a body it cannot take, routes and methods it does not have (``save_weights_external`` wedged runs so before it
was served), bodies it cannot read, and a numbered body sent to a route that takes no position. The run's next
steps answer, with the same numbers, bitwise, as a twin run that saw none of it. Another tenant sending a number of
this run fills nothing: the run's own request with that number is applied.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.conftest import start_named_worker
from tests.helpers import make_batch
from tests.test_gateway import fb_proto, sdk_batch, start_gateway
from tinkerq import types
from tinkerq.settings import Settings
from tinkerq.tenants import ApiKeys

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.timeout(300)
NAME = "sequence/tiny"
WAIT_S = 60  # far below the worker's gap timeout (600 s): a hole makes the next result time out


@pytest.fixture(scope="module")
def worker(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[subprocess.Popen]:
    proc = start_named_worker(model_dir, redis_url, NAME, tmp_path_factory.mktemp("logs") / "worker.log", env={
        "TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir), "TINKERQ_GAP_TIMEOUT_S": "600"})
    yield proc
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def gateway(redis_url: str, worker, tmp_path_factory) -> Iterator[str]:
    proc, url = start_gateway(redis_url, tmp_path_factory.mktemp("logs") / "gateway.log")
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def keys(redis_url: str) -> Iterator[dict[str, str]]:
    api = ApiKeys.open(Settings(broker_url=redis_url))
    made = {t: api.create(f"{t}-{uuid.uuid4().hex[:6]}") for t in ("owner", "other")}
    yield made
    api.close()


def _in_turn(tc, send) -> tuple[int, requests.Response]:
    """Take the training client's next number and its turn, as one of its own calls would, and ``send(seq_id)``."""
    request_id = tc._get_request_id()

    async def turn() -> requests.Response:
        async with tc._take_turn(request_id):
            return await asyncio.to_thread(send, request_id + 1)

    return request_id + 1, tc.holder.run_coroutine_threadsafe(turn()).result(WAIT_S)


def _hostile(url: str, key: str, model_id: str) -> list[tuple[str, object]]:
    """(what, send(seq_id) -> response): each answered without taking its number."""
    bad_datum = make_batch(np.random.default_rng(0), 1, max_len=6)
    # weights of the wrong length: refused before the request is posted
    bad_datum[0].loss_fn_inputs["weights"] = types.TensorData.from_numpy(np.ones(2, dtype=np.float32))
    json_h = {"X-API-Key": key}
    proto_h = {"X-API-Key": key, "Content-Type": "application/x-protobuf"}

    def post(path: str, body: dict, method: str = "POST"):
        return lambda n: requests.request(method, f"{url}/api/v1/{path}", json={"model_id": model_id, "seq_id": n,
                                                                                **body}, headers=json_h, timeout=60)

    cases: list[tuple[str, object]] = [
        # The SDK's save_weights_external (`tinker checkpoint download`; it had no route once) with an option refused.
        ("save_weights_external, age encryption (refused)", post("save_weights_external", {
            "path": "x", "age_encryption_recipients": ["age1" + "q" * 58], "type": "save_weights_external"})),
        ("unknown route", post("no_such_route", {"type": "garbage"})),
        ("wrong method", post("optim_step", {"adam_params": {"learning_rate": 1e-3}}, method="PUT")),
        ("malformed adam_params", post("optim_step", {"adam_params": {"learning_rate": "fast"}})),
        ("optimizer_params of a family not served", post("optim_step", {"optimizer_params": {"type": "lion"}})),
        ("Dimuon's optimizer_params on an AdamW run", post("optim_step", {"optimizer_params": {
            "type": "dimuon", "learning_rate": 1e-3}})),
        ("a JSON body to the protobuf route", post("forward_backward", {"forward_backward_input": {}})),
        ("JSON /forward", post("forward", {"forward_input": {}})),
        ("a bad save name", post("save_weights", {"path": "../escape", "type": "save_weights"})),
        ("a bad sampler save name", post("save_weights_for_sampler", {"path": "a/b", "type": "x"})),
        ("load_weights of nothing", post("load_weights", {"path": "tinker://nope/weights/x", "optimizer": False})),
        ("a numbered body to a route that takes no position", post("get_info", {"type": "get_info"})),
        ("telemetry with a number", post("telemetry", {"events": []})),
        ("a datum the decoder refuses", lambda n: requests.post(
            f"{url}/api/v1/forward_backward", data=fb_proto(model_id, n, bad_datum), headers=proto_h, timeout=60)),
        ("a forward_backward whose header is refused", lambda n: requests.post(
            f"{url}/api/v1/forward_backward", data=fb_proto(model_id, n, bad_datum),
            headers={**proto_h, "Content-Type": "text/plain"}, timeout=60)),
    ]
    # And every other route the gateway has, any method, a numbered body it was not made for (left out: a numbered
    # unload_model of one's own run is still an unload, and DELETE auth/apikey/me revokes the key it is sent with).
    from tinkerq.gateway.app import create_app

    listed = {"/api/v1/" + path for path in ("save_weights_external", "optim_step", "forward_backward", "forward",
                                             "save_weights", "save_weights_for_sampler", "load_weights", "get_info",
                                             "telemetry", "unload_model")}
    for route in create_app(lambda: None).routes:  # the factory runs only at start-up: never here
        path = getattr(route, "path", "")
        if not path.startswith("/api/v1/") or path in listed:
            continue
        for method in sorted(getattr(route, "methods", None) or ()):
            if method in ("HEAD", "OPTIONS") or (method, path) == ("DELETE", "/api/v1/auth/apikey/me"):
                continue
            concrete = re.sub(r"\{[^}]+\}", "nothing", path).removeprefix("/api/v1/")
            cases.append((f"route {method} {path}", post(concrete, {"type": "garbage", "path": "tinker://nothing"},
                                                   method=method)))
    return cases


def _step(tc, data, adam) -> tuple[float, list[np.ndarray], float]:
    fb = tc.forward_backward(sdk_batch(data), "cross_entropy")
    step = tc.optim_step(adam)
    out = fb.result(timeout=WAIT_S)
    return (out.metrics["loss:sum"], [np.asarray(o["logprobs"].data) for o in out.loss_fn_outputs],
            step.result(timeout=WAIT_S).metrics["grad_norm:mean"])


def _assert_same(got: tuple[float, list[np.ndarray], float], want: tuple[float, list[np.ndarray], float]) -> None:
    assert got[0] == want[0] and got[2] == want[2]
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_array_equal(a, b)


def test_no_answer_leaves_a_hole_in_a_run(gateway, keys, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    rng = np.random.default_rng(3)
    batches = [make_batch(rng, 3, min_len=3, max_len=14) for _ in range(3)]
    adam = tinker.AdamParams(learning_rate=1e-2)
    with tinker.ServiceClient(base_url=gateway, api_key=keys["owner"]) as sdk:
        run = sdk.create_lora_training_client(base_model=NAME, rank=4, seed=7).result()
        twin = sdk.create_lora_training_client(base_model=NAME, rank=4, seed=7).result()
        for i, data in enumerate(batches):
            _assert_same(_step(run, data, adam), _step(twin, data, adam))
            if i == len(batches) - 1:
                break
            for what, send in _hostile(gateway, keys["owner"], run.model_id):
                seq_id, answer = _in_turn(run, send)
                if what.startswith("route "):  # whatever it answers (a user error, a 404, a 503): no crash, no hole
                    assert answer.status_code != 500, (what, answer.text)
                    continue
                if what.startswith(("a numbered", "telemetry")):
                    assert answer.status_code == 200, (what, answer.text)
                    continue
                assert answer.status_code in (400, 404, 405, 422), (what, answer.status_code, answer.text)
                # The resend of a refused request (the SDK's retry, to any gateway) gets a refusal again, and the
                # position is not filled twice.
                again = send(seq_id)
                assert again.status_code in (400, 404, 405, 422), (what, again.text)

        # Another tenant's request with this run's next number is refused (404: not its run) and fills nothing:
        # the run's own request with that number is applied.
        r = requests.post(f"{gateway}/api/v1/optim_step", headers={"X-API-Key": keys["other"]}, timeout=60,
                          json={"model_id": run.model_id, "seq_id": run._request_id_counter + 1,
                                "adam_params": {"learning_rate": 1.0}})
        assert r.status_code == 404, r.text
        data = make_batch(rng, 2, max_len=10)
        _assert_same(_step(run, data, adam), _step(twin, data, adam))
