"""Authentication as the official SDK 0.38 and its ``tinker`` command do it, against a real `tinkerq gateway`, worker
and Redis: the SDK's token exchange (``pjwt_auth_enabled``, ``POST auth/token``), ``whoami``, ``tinker auth login``
(``GET auth/apikey/me``), and what is refused (401): unknown keys, forged, expired, misused and revoked tokens.

Checked independently: a run trained through exchanged tokens gives the numbers of the same run through a gateway
with the exchange off (plain API keys), and its first forward equals a plain transformers forward of the base; the
fleet's Redis holds no API key and no token in the clear.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import jwt
import numpy as np
import pytest
import redis
import requests
import torch

from tests.conftest import start_named_worker
from tests.helpers import load_reference, make_batch, reference_logprobs, run_tinker_cli
from tests.test_gateway import ADAM, NAME, fb_proto, post, result, sdk_batch
from tinkerq import keys
from tinkerq.launcher.processes import free_port, gateway_command, gateway_up, start_process, wait_for
from tinkerq.settings import Settings
from tinkerq.tenants import ApiKeys

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parent.parent


def _gateway(redis_url: str, log: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = start_process(gateway_command(redis_url, port), log, {"TINKERQ_GATEWAY_POLL_S": "2", **env})
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: gateway_up(url), 60, "tinkerq gateway", proc, log)
    return proc, url


@pytest.fixture(scope="module")
def fleet(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[dict]:
    """A worker; a gateway with the defaults (token exchange on, the SDK on httpx) and one with the token exchange
    off and the SDK on its pyqwest transport; three tenants."""
    logs = tmp_path_factory.mktemp("auth-logs")
    worker = start_named_worker(model_dir, redis_url, NAME, logs / "worker.log",
                                env={"TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir)})
    on, url = _gateway(redis_url, logs / "gateway-on.log", {})
    off, plain_url = _gateway(redis_url, logs / "gateway-off.log", {"TINKERQ_GATEWAY_TOKEN_EXCHANGE": "0",
                                                                       "TINKERQ_GATEWAY_SDK_PYQWEST": "1"})
    api_keys = ApiKeys.open(Settings(broker_url=redis_url))
    names = {t: f"{t}-{uuid.uuid4().hex[:6]}" for t in ("alice", "bob", "carol")}
    made = {t: api_keys.create(name) for t, name in names.items()}
    yield {"url": url, "plain_url": plain_url, "keys": made, "names": names, "redis": redis_url,
           "api_keys": api_keys}
    api_keys.close()
    for proc in (on, off, worker):
        proc.terminate()
        proc.wait(30)


def _train(url: str, key: str, batch) -> tuple[list[np.ndarray], float, list[np.ndarray]]:
    """First forward's logprobs, a step's loss, and the logprobs after it, through the SDK."""
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(NAME, rank=4, seed=9).result(timeout=120)
    first = tc.forward(sdk_batch(batch), "cross_entropy").result(timeout=120)
    step = tc.forward_backward(sdk_batch(batch), "cross_entropy").result(timeout=120)
    tc.optim_step(tinker.AdamParams(**ADAM)).result(timeout=120)
    after = tc.forward(sdk_batch(batch), "cross_entropy").result(timeout=120)
    return ([o["logprobs"].to_numpy() for o in first.loss_fn_outputs], step.metrics["loss:sum"],
            [o["logprobs"].to_numpy() for o in after.loss_fn_outputs])


def _token(url: str, key: str) -> str:
    r = requests.post(f"{url}/api/v1/auth/token", json={}, headers={"X-API-Key": key}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["jwt"]


def _get(url: str, credential: str) -> requests.Response:
    return requests.get(f"{url}/api/v1/training_runs", headers={"X-API-Key": credential}, timeout=30)


def _cli(fleet, home: Path, *args: str, key: str = "", stdin: str = "") -> subprocess.CompletedProcess:
    # No key (""): the command uses the one `tinker auth login` stored under HOME, if any.
    return run_tinker_cli(list(args), base_url=fleet["url"], api_key=key, env={"HOME": str(home)}, input=stdin)


def test_the_sdk_trains_through_exchanged_tokens(fleet, model_dir, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    config = requests.post(f"{fleet['url']}/api/v1/client/config", json={"sdk_version": "0.38.0"},
                           headers={"X-API-Key": fleet["keys"]["alice"]}, timeout=30).json()
    assert config["pjwt_auth_enabled"] is True
    assert config["use_pyqwest_transport"] is False
    plain = requests.post(f"{fleet['plain_url']}/api/v1/client/config", json={"sdk_version": "0.38.0"},
                          headers={"X-API-Key": fleet["keys"]["alice"]}, timeout=30).json()
    assert plain["pjwt_auth_enabled"] is False
    assert plain["use_pyqwest_transport"] is True  # so the SDK's training below runs over both of its transports

    batch = make_batch(np.random.default_rng(4), 3, max_len=12)
    rest = tinker.RestClient(base_url=fleet["url"], api_key=fleet["keys"]["alice"])
    assert rest.whoami().result().user_urn == fleet["names"]["alice"]  # only a token holder can say whoami
    first, loss, after = _train(fleet["url"], fleet["keys"]["alice"], batch)
    base = load_reference(model_dir)  # a fresh LoRA adapter (B = 0) is the base model
    with torch.no_grad():
        for d, got in zip(batch, first, strict=True):
            np.testing.assert_allclose(got, reference_logprobs(base, d).numpy(), atol=1e-4)
    # The same run with plain API keys (the exchange off) gives the same numbers, bitwise.
    plain_first, plain_loss, plain_after = _train(fleet["plain_url"], fleet["keys"]["alice"], batch)
    assert loss == plain_loss
    for x, y in zip([*first, *after], [*plain_first, *plain_after], strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(RuntimeError, match="whoami requires JWT auth"):  # as the SDK says without the exchange
        tinker.RestClient(base_url=fleet["plain_url"], api_key=fleet["keys"]["alice"]).whoami().result()


def test_whoami_reads_the_token(fleet):
    me = tinker.RestClient(base_url=fleet["url"], api_key=fleet["keys"]["bob"]).whoami().result()
    name = fleet["names"]["bob"]
    assert (me.user_urn, me.org_urn, me.email) == (name, f"tml:organization:{name}", None)
    token = _token(fleet["url"], fleet["keys"]["bob"])
    claims = jwt.decode(token, options={"verify_signature": False})
    assert claims["sub"] == name and 0 < claims["exp"] - claims["iat"] <= 900  # short-lived
    assert _get(fleet["plain_url"], token).status_code == 200  # any gateway of the fleet accepts it


def test_tinker_auth_login_and_whoami(fleet, tmp_path):
    bad = _cli(fleet, tmp_path, "auth", "login", stdin="tml-" + "x" * 43 + "\n")
    assert bad.returncode != 0
    assert "Could not validate the API key" in bad.stderr and "unknown or revoked API key" in bad.stderr
    assert not (tmp_path / ".tinker" / "credentials.json").exists()

    done = _cli(fleet, tmp_path, "auth", "login", stdin=fleet["keys"]["carol"] + "\n")
    assert done.returncode == 0, done.stderr
    name = fleet["names"]["carol"]
    assert f"Logged in as {name} ({name})" in done.stdout
    stored = json.loads((tmp_path / ".tinker" / "credentials.json").read_text())
    assert fleet["keys"]["carol"] in json.dumps(stored)  # the CLI keeps the key on the user's machine (its file)
    # Later commands use the stored key (no TINKER_API_KEY), through the token exchange.
    who = _cli(fleet, tmp_path, "--format", "json", "auth", "whoami")
    assert who.returncode == 0, who.stderr
    assert json.loads(who.stdout) == {"user_urn": name, "org_urn": f"tml:organization:{name}", "email": None}
    me = requests.get(f"{fleet['url']}/api/v1/auth/apikey/me", headers={"X-API-Key": fleet["keys"]["carol"]},
                      timeout=30).json()
    assert me["name"] == name and fleet["keys"]["carol"] not in json.dumps(me)
    status = _cli(fleet, tmp_path, "auth", "status")
    assert status.returncode == 0 and "Tinker accessible: yes" in status.stdout, status.stderr
    # Logging out forgets the pasted key here (the key itself stays live, as with Tinker's pasted keys).
    out = _cli(fleet, tmp_path, "auth", "logout")
    assert out.returncode == 0 and "The API key is still active" in out.stdout, out.stderr
    stored_file = tmp_path / ".tinker" / "credentials.json"
    assert not stored_file.exists() or fleet["keys"]["carol"] not in stored_file.read_text()
    assert _cli(fleet, tmp_path, "auth", "whoami").returncode != 0  # no credential left
    assert _get(fleet["url"], fleet["keys"]["carol"]).status_code == 200


def test_refused_credentials_get_401(fleet):
    url, alice = fleet["url"], fleet["keys"]["alice"]
    token = _token(url, alice)
    assert _get(url, token).status_code == 200
    secret = redis.Redis.from_url(fleet["redis"]).get(keys.gateway_signing_secret())
    claims = jwt.decode(token, options={"verify_signature": False})
    cases = {
        "forged": jwt.encode({**claims, "sub": fleet["names"]["bob"]}, b"guessed" * 10, algorithm="HS256"),
        "altered": token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB"),
        "expired": jwt.encode({**claims, "exp": int(time.time()) - 2}, secret, algorithm="HS256"),
        "another purpose": jwt.encode({**claims, "aud": "external-weights-download"}, secret, algorithm="HS256"),
        "no key id": jwt.encode({k: v for k, v in claims.items() if k != "kid"}, secret, algorithm="HS256"),
    }
    for why, bad in cases.items():
        r = _get(url, bad)
        assert r.status_code == 401, why
        assert r.headers["www-authenticate"] == 'Bearer error="invalid_token"', why  # the SDK exchanges again
    unknown = _get(url, "tml-" + "y" * 43)
    assert unknown.status_code == 401 and "www-authenticate" not in unknown.headers
    # The exchange and the key check take API keys only.
    for path, method in (("auth/token", requests.post), ("auth/apikey/me", requests.get)):
        assert method(f"{url}/api/v1/{path}", headers={"X-API-Key": token}, timeout=30).status_code == 401
        assert method(f"{url}/api/v1/{path}", headers={"X-API-Key": "tml-" + "z" * 43},
                      timeout=30).status_code == 401


def test_a_numbered_request_refused_under_a_token_fills_its_position(fleet):
    """The SequenceGuard (gateway/positions.py) knows the caller by its token too: a numbered request to a route the
    gateway lacks, sent with a token, fills its position, and the run's next request is answered at once (the
    worker's gap timeout is 300 s here)."""
    url, token = fleet["url"], _token(fleet["url"], fleet["keys"]["alice"])
    batch = make_batch(np.random.default_rng(2), 2, max_len=10)

    def run_with_hole(credential: str) -> tuple[str, str]:
        """A run whose request 1 went to a route the gateway lacks with ``credential``; its request 2 posted."""
        session = post(url, "create_session", token, {"tags": [], "sdk_version": "test"}).json()["session_id"]
        promise = post(url, "create_model", token, {"session_id": session, "model_seq_id": 0, "base_model": NAME,
                                                     "lora_config": {"rank": 4, "seed": 1}}).json()
        model_id = result(url, token, promise["request_id"]).json()["model_id"]
        assert post(url, "no_such_route", credential, {"model_id": model_id, "seq_id": 1}).status_code == 404
        accepted = post(url, "forward_backward", token, fb_proto(model_id, 2, batch, forward_only=True), proto=True)
        assert accepted.status_code == 200, accepted.text
        return model_id, accepted.json()["request_id"]

    started = time.monotonic()
    _, request_id = run_with_hole(token)
    answer = result(url, token, request_id, timeout=60)
    assert answer.status_code == 200 and time.monotonic() - started < 30
    # The control: a forged token fills nothing, so there the next request waits for the hole (polls say try_again).
    forged = jwt.encode(jwt.decode(token, options={"verify_signature": False}), b"forged" * 11, algorithm="HS256")
    _, request_id = run_with_hole(forged)
    assert result(url, token, request_id, timeout=6).status_code == 408


def test_a_revoked_keys_tokens_end_with_it(fleet):
    name = f"dave-{uuid.uuid4().hex[:6]}"
    key = fleet["api_keys"].create(name)
    token = _token(fleet["url"], key)
    assert _get(fleet["url"], token).status_code == 200
    fleet["api_keys"].revoke(name)
    time.sleep(1.5)  # the gateway trusts a key it checked for 1 s
    assert _get(fleet["url"], token).status_code == 401
    fleet["api_keys"].create(name)  # a new key of the same tenant does not revive the old one's tokens
    time.sleep(1.5)
    assert _get(fleet["url"], token).status_code == 401


def test_logout_of_an_issued_key_revokes_it_and_ends_its_runs(fleet, tmp_path, monkeypatch):
    """`tinker auth logout` of a key the CLI was issued (a GeneratedKey) calls DELETE auth/apikey/me: the key revokes
    itself, its tokens end, its training runs are closed on the workers; a token cannot do it."""
    from tinker.lib.credentials import (
        ApiKeyDetails,
        ApiKeyOrgDetails,
        ApiKeyUserDetails,
        GeneratedKey,
        JsonCredentialStore,
    )

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    name = f"erin-{uuid.uuid4().hex[:6]}"
    key = fleet["api_keys"].create(name)
    tc = tinker.ServiceClient(base_url=fleet["url"], api_key=key).create_lora_training_client(
        NAME, rank=4, seed=2).result(timeout=120)
    token = _token(fleet["url"], key)
    assert requests.delete(f"{fleet['url']}/api/v1/auth/apikey/me", headers={"X-API-Key": token},
                           timeout=30).status_code == 401
    store = JsonCredentialStore(tmp_path / ".tinker" / "credentials.json")
    store.add_key("7", GeneratedKey(key=key, name="issued", details=ApiKeyDetails(
        org_details=ApiKeyOrgDetails(name=name), user_details=ApiKeyUserDetails(email=name))))
    store.set_default("7")
    out = _cli(fleet, tmp_path, "auth", "logout")
    assert out.returncode == 0 and "deleted its API key on the server" in out.stdout, out.stderr
    assert _get(fleet["url"], key).status_code == 401
    assert _get(fleet["url"], token).status_code == 401
    record = json.loads(redis.Redis.from_url(fleet["redis"]).get(keys.gateway_record("run", tc.model_id)))
    assert record["closed"] is True  # its worker session was closed (tinkerq keys revoke does the same)


def test_no_key_or_token_is_kept_in_the_clear(fleet):
    """After all of the above: no value in the fleet's Redis holds an API key or an exchanged token."""
    secrets_seen = [*fleet["keys"].values(), _token(fleet["url"], fleet["keys"]["alice"])]
    r = redis.Redis.from_url(fleet["redis"])
    for name in r.scan_iter(count=1000):
        kind = r.type(name).decode()
        values: list[bytes] = []
        if kind == "string":
            values = [r.get(name) or b""]
        elif kind == "hash":
            values = [k + b"=" + v for k, v in r.hgetall(name).items()]
        elif kind == "list":
            values = r.lrange(name, 0, -1)
        elif kind in ("set", "zset"):
            values = list(r.smembers(name)) if kind == "set" else [m for m, _ in r.zrange(name, 0, -1, withscores=True)]
        blob = name + b"".join(values)
        for secret in secrets_seen:
            assert secret.encode() not in blob, name
