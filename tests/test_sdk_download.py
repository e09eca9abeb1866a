"""``save_weights_external``, ``get_external_weights_urls`` and ``tinker checkpoint download``: the official SDK 0.38
and its ``tinker`` command against a real `tinkerq gateway`, worker and Redis.

Checked independently: the downloaded archive is byte for byte the directory the worker wrote; PEFT (not tinkerq)
loads it over the plain transformers base and gives the session's logprobs; tinker-cookbook's ``build_hf_model``
merges it to the same logprobs (when its venv is built: scripts/cookbook-venv). The URLs carry no API key, and a
URL that expired, was altered, or was signed with another secret is refused; another tenant gets 404.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import jwt
import numpy as np
import pytest
import redis
import requests
import torch

from tests.conftest import start_named_worker
from tests.helpers import load_reference, make_batch, reference_logprobs, run_tinker_cli
from tests.test_gateway import ADAM, NAME, sdk_batch
from tinkerq import keys
from tinkerq.launcher.processes import free_port, gateway_command, gateway_up, start_process, wait_for
from tinkerq.settings import Settings
from tinkerq.tenants import ApiKeys

tinker = pytest.importorskip("tinker")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parent.parent
COOKBOOK_PYTHON = ROOT / ".venv-cookbook-061" / "bin" / "python"


@pytest.fixture(scope="module")
def fleet(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[dict]:
    """A worker serving the tiny Llama as NAME and a gateway reading the same checkpoint directory; two tenants."""
    logs = tmp_path_factory.mktemp("download-logs")
    env = {"TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir)}
    worker = start_named_worker(model_dir, redis_url, NAME, logs / "worker.log", env=env)
    gateways, urls = [], []
    for i in range(2):  # a second gateway of the same fleet serves the first one's URLs
        port = free_port()
        gateways.append(start_process(gateway_command(redis_url, port), logs / f"gateway-{i}.log",
                                      {**env, "TINKERQ_GATEWAY_POLL_S": "2"}))
        urls.append(f"http://127.0.0.1:{port}")
        wait_for(lambda: gateway_up(urls[-1]), 60, "tinkerq gateway", gateways[-1], logs / f"gateway-{i}.log")
    url = urls[0]
    api_keys = ApiKeys.open(Settings(broker_url=redis_url))
    made = {t: api_keys.create(f"{t}-{uuid.uuid4().hex[:6]}") for t in ("alice", "bob")}
    api_keys.close()
    yield {"url": url, "other_url": urls[1], "keys": made, "redis": redis_url}
    for proc in (*gateways, worker):
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def exported(fleet, tmp_path_factory) -> dict:
    """A LoRA run trained one step, exported with save_weights_external; its logprobs at that point."""
    os.environ["TINKER_TELEMETRY"] = "0"
    sc = tinker.ServiceClient(base_url=fleet["url"], api_key=fleet["keys"]["alice"])
    tc = sc.create_lora_training_client(NAME, rank=4, seed=5).result(timeout=120)
    batch = make_batch(np.random.default_rng(11), 3, max_len=14)
    tc.forward_backward(sdk_batch(batch), "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(**ADAM)).result()
    saved = tc.save_weights_external("final", ttl_seconds=7200).result(timeout=120)
    # The next request of the run is answered at once: save_weights_external took its sequence number.
    started = time.monotonic()
    out = tc.forward(sdk_batch(batch), "cross_entropy").result(timeout=60)
    assert time.monotonic() - started < 30
    record = json.loads(redis.Redis.from_url(fleet["redis"]).get(keys.gateway_record("checkpoint", saved.path)))
    return {"path": saved.path, "model_id": tc.model_id, "batch": batch, "directory": Path(record["directory"]),
            "logprobs": [o["logprobs"].to_numpy() for o in out.loss_fn_outputs], "tc": tc, "sc": sc}


def _cli(fleet, key: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_tinker_cli(list(args), base_url=fleet["url"], api_key=key, timeout=300, env={"HOME": str(cwd)})


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _peft_logprobs(model_dir: Path, adapter: Path, batch) -> list[np.ndarray]:
    model = peft.PeftModel.from_pretrained(load_reference(model_dir), str(adapter))
    model.eval()
    with torch.no_grad():
        return [reference_logprobs(model, d).numpy() for d in batch]


def test_save_weights_external_answers_tinkers_path_and_the_archive(exported):
    assert exported["path"] == f"tinker://{exported['model_id']}/external_weights/final"
    files = _files(exported["directory"])
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(files)
    config = json.loads(files["adapter_config.json"])
    assert config["r"] == 4 and config["lora_alpha"] == 32 and config["base_model_name_or_path"] == NAME


def test_the_deprecated_async_spellings(fleet, exported):
    tc = exported["tc"]
    rest = tinker.RestClient(base_url=fleet["url"], api_key=fleet["keys"]["alice"])

    async def both():
        with pytest.warns(FutureWarning, match="save_weights_external_async"):
            future = await tc.save_weights_external_async("async-spelling")
        path = (await future).path
        with pytest.warns(FutureWarning, match="get_external_weights_urls_async"):
            return path, await rest.get_external_weights_urls_async(path)

    path, answer = asyncio.run(both())
    assert path == f"tinker://{exported['model_id']}/external_weights/async-spelling"
    directory = Path(json.loads(redis.Redis.from_url(fleet["redis"]).get(
        keys.gateway_record("checkpoint", path)))["directory"])
    assert set(answer.urls) == set(_files(directory))
    assert requests.get(answer.urls["adapter_config.json"], timeout=60).content == \
        (directory / "adapter_config.json").read_bytes()


def test_a_refused_export_fills_its_position(fleet, exported):
    """age encryption is refused (400, saying so); the run's next request is still answered at once, as before."""
    tc = exported["tc"]
    with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
        tc.save_weights_external("encrypted", age_encryption_recipients=["age1" + "q" * 58]).result(timeout=60)
    started = time.monotonic()
    out = tc.forward(sdk_batch(exported["batch"]), "cross_entropy").result(timeout=60)
    assert time.monotonic() - started < 30
    for got, want in zip(out.loss_fn_outputs, exported["logprobs"], strict=True):
        np.testing.assert_array_equal(got["logprobs"].to_numpy(), want)


def test_tinker_checkpoint_download_gets_the_saved_files_and_the_sessions_logprobs(fleet, exported, model_dir,
                                                                                     tmp_path):
    done = _cli(fleet, fleet["keys"]["alice"], "--format", "json", "checkpoint", "download", exported["path"],
                "--output", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    target = tmp_path / "out" / exported["path"].replace("tinker://", "").replace("/", "_")
    downloaded = _files(target)
    assert downloaded == _files(exported["directory"])  # every file, byte for byte
    report = json.loads(done.stdout)
    assert report["destination"] == str(target)
    for got, want in zip(_peft_logprobs(model_dir, target, exported["batch"]), exported["logprobs"], strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_urls_carry_no_key_and_expire(fleet, exported):
    rest = tinker.RestClient(base_url=fleet["url"], api_key=fleet["keys"]["alice"])
    answer = rest.get_external_weights_urls(exported["path"]).result()
    remaining = answer.expires.timestamp() - time.time()
    assert 3000 < remaining <= 3600  # an hour, as the CLI expects (it re-signs 5 minutes before)
    assert set(answer.urls) == set(_files(exported["directory"]))
    name = "adapter_model.safetensors"
    url = answer.urls[name]
    assert fleet["keys"]["alice"] not in url
    fetched = requests.get(url, timeout=60)  # no X-API-Key
    assert fetched.status_code == 200 and fetched.content == (exported["directory"] / name).read_bytes()
    elsewhere = requests.get(url.replace(fleet["url"], fleet["other_url"]), timeout=60)  # any gateway of the fleet
    assert elsewhere.status_code == 200 and elsewhere.content == fetched.content

    token = urlsplit(url).path.split("/")[-2]
    base = url[:url.index(token)]
    # Altered: one character of the signature, or the file the token names.
    tampered = token[:-3] + ("A" if token[-3] != "A" else "B") + token[-2:]
    assert requests.get(f"{base}{tampered}/{name}", timeout=60).status_code == 403
    assert requests.get(f"{base}{token}/adapter_config.json", timeout=60).status_code == 403
    # Claims rewritten to another checkpoint and signed with a guessed secret; then a correct one, expired.
    claims = jwt.decode(token, options={"verify_signature": False})
    forged = jwt.encode({**claims, "path": exported["path"].replace("final", "other")}, b"x" * 64, algorithm="HS256")
    assert requests.get(f"{base}{forged}/{name}", timeout=60).status_code == 403
    secret = redis.Redis.from_url(fleet["redis"]).get(keys.gateway_signing_secret())
    expired = jwt.encode({**claims, "exp": int(time.time()) - 5}, secret, algorithm="HS256")
    refused = requests.get(f"{base}{expired}/{name}", timeout=60)
    assert refused.status_code == 403 and "expired" in refused.json()["detail"]
    fresh = jwt.encode({**claims, "exp": int(time.time()) + 60}, secret, algorithm="HS256")
    assert requests.get(f"{base}{fresh}/{name}", timeout=60).status_code == 200  # the same claims, in time
    # A token for another purpose (the SDK's exchanged credential, part of the same fleet) is no download.
    other = jwt.encode({**claims, "aud": "tinker-api"}, secret, algorithm="HS256")
    assert requests.get(f"{base}{other}/{name}", timeout=60).status_code == 403


def test_another_tenant_gets_nothing(fleet, exported, tmp_path):
    bob = tinker.RestClient(base_url=fleet["url"], api_key=fleet["keys"]["bob"])
    with pytest.raises(tinker.NotFoundError):
        bob.get_external_weights_urls(exported["path"]).result()
    done = _cli(fleet, fleet["keys"]["bob"], "checkpoint", "download", exported["path"], "--output",
                str(tmp_path / "bob"), cwd=tmp_path)
    assert done.returncode != 0 and "not found" in (done.stderr + done.stdout).lower()
    assert not any((tmp_path / "bob").rglob("*.safetensors"))


def test_a_published_export_is_downloadable_by_others_until_unpublished(fleet, exported):
    tc = exported["tc"]
    path = tc.save_weights_external("shared").result(timeout=120).path
    directory = Path(json.loads(redis.Redis.from_url(fleet["redis"]).get(
        keys.gateway_record("checkpoint", path)))["directory"])
    alice = tinker.RestClient(base_url=fleet["url"], api_key=fleet["keys"]["alice"])
    bob = tinker.RestClient(base_url=fleet["url"], api_key=fleet["keys"]["bob"])
    with pytest.raises(tinker.NotFoundError):
        bob.get_external_weights_urls(path).result()
    alice.publish_checkpoint_from_tinker_path(path).result()
    url = bob.get_external_weights_urls(path).result().urls["adapter_model.safetensors"]
    got = requests.get(url, timeout=60)
    assert got.status_code == 200 and got.content == (directory / "adapter_model.safetensors").read_bytes()
    alice.unpublish_checkpoint_from_tinker_path(path).result()
    assert requests.get(url, timeout=60).status_code == 404  # bob's URL ends with the publication
    with pytest.raises(tinker.NotFoundError):
        bob.get_external_weights_urls(path).result()


def test_links_in_an_archive_are_never_followed(fleet, exported, tmp_path):
    """A symbolic link planted in an export (beside its files, or in place of one) is refused, never served."""
    tc = exported["tc"]
    path = tc.save_weights_external("planted").result(timeout=120).path
    directory = Path(json.loads(redis.Redis.from_url(fleet["redis"]).get(
        keys.gateway_record("checkpoint", path)))["directory"])
    rest = tinker.RestClient(base_url=fleet["url"], api_key=fleet["keys"]["alice"])
    urls = rest.get_external_weights_urls(path).result().urls
    outside = tmp_path / "secret.txt"
    outside.write_text("not a checkpoint file")
    (directory / "extra.txt").symlink_to(outside)
    with pytest.raises(tinker.NotFoundError, match="symbolic link"):
        rest.get_external_weights_urls(path).result()
    (directory / "extra.txt").unlink()
    (directory / "adapter_config.json").unlink()
    (directory / "adapter_config.json").symlink_to(outside)
    refused = requests.get(urls["adapter_config.json"], timeout=60)  # a URL signed before the link was planted
    assert refused.status_code == 404 and b"not a checkpoint file" not in refused.content


def test_a_deleted_checkpoints_urls_stop_working(fleet, exported):
    tc = exported["tc"]
    path = tc.save_weights_external("short-lived").result(timeout=120).path
    rest = tinker.RestClient(base_url=fleet["url"], api_key=fleet["keys"]["alice"])
    url = rest.get_external_weights_urls(path).result().urls["adapter_config.json"]
    assert requests.get(url, timeout=60).status_code == 200
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert requests.get(url, timeout=60).status_code == 404
    # Only external weights get download URLs (the SDK checks it too; raw HTTP here).
    sampler = tc.save_weights_for_sampler("smp").result(timeout=120).path
    run_id, checkpoint_id = sampler[len("tinker://"):].split("/", 1)
    refused = requests.get(f"{fleet['url']}/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/"
                           f"external_weights_urls", headers={"X-API-Key": fleet["keys"]["alice"]}, timeout=60)
    assert refused.status_code == 400 and "external_weights" in refused.json()["detail"]


def test_tinker_checkpoint_download_of_a_training_checkpoint(fleet, exported, model_dir, tmp_path):
    """A tinker://.../weights/... path: the CLI opens a run from the state, exports it through
    save_weights_external (ttl 1 h, renewed with set_checkpoint_ttl), downloads and deletes the export."""
    from safetensors.torch import load_file

    tc = exported["tc"]
    state = tc.save_state("for-download").result(timeout=120).path
    at_save = tc.forward(sdk_batch(exported["batch"]), "cross_entropy").result(timeout=60)
    done = _cli(fleet, fleet["keys"]["alice"], "--format", "json", "checkpoint", "download", state, "--output",
                str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    target = tmp_path / "out" / state.replace("tinker://", "").replace("/", "_")
    record = json.loads(redis.Redis.from_url(fleet["redis"]).get(keys.gateway_record("checkpoint", state)))
    got = load_file(str(target / "adapter_model.safetensors"))
    want = load_file(str(Path(record["directory"]) / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    for lp, out in zip(_peft_logprobs(model_dir, target, exported["batch"]), at_save.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(lp, out["logprobs"].to_numpy(), atol=2e-5)
    # The temporary export is gone from the tenant's checkpoints (the CLI deleted it).
    rest = tinker.RestClient(base_url=fleet["url"], api_key=fleet["keys"]["alice"])
    runs = rest.list_training_runs(limit=100).result().training_runs
    exports = [c.tinker_path for r in runs for c in rest.list_checkpoints(r.training_run_id).result().checkpoints
               if c.checkpoint_type == "external" and c.tinker_path.endswith("/external_weights/download")]
    assert exports == []


@pytest.mark.skipif(not COOKBOOK_PYTHON.exists(), reason="tinker-cookbook's venv is not built (scripts/cookbook-venv)")
def test_the_cookbook_merges_the_download_to_the_sessions_logprobs(fleet, exported, model_dir, tmp_path):
    done = _cli(fleet, fleet["keys"]["alice"], "checkpoint", "download", exported["path"], "--output",
                str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    adapter = tmp_path / "out" / exported["path"].replace("tinker://", "").replace("/", "_")
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([{"name": "llama", "base": str(model_dir), "adapter": str(adapter),
                                 "merged": str(tmp_path / "merged"), "peft": None}]))
    merged = subprocess.run([str(COOKBOOK_PYTHON), str(ROOT / "tests" / "cookbook_weights_driver.py"), str(jobs)],
                            capture_output=True, text=True, timeout=500,
                            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert json.loads(merged.stdout.splitlines()[-1])["merged"] == "ok"
    model = load_reference(tmp_path / "merged")
    with torch.no_grad():
        for d, want in zip(exported["batch"], exported["logprobs"], strict=True):
            np.testing.assert_allclose(reference_logprobs(model, d).numpy(), want, atol=2e-5)
