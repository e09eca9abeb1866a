"""Checkpoints across a tenant's runs, publishing, expiry, copies and the audit log, through the official SDK 0.38
(``RestClient``, ``ServiceClient``, ``AdminClient``; sync and async spellings) and its ``tinker`` command, against a
real worker, gateway and Redis.

Checked independently: listings against the paths the SDK's saves returned; a published checkpoint read by
another tenant against what its owner's own clients compute from it (and not the base model's numbers); expiry
against the marker file on disk and the directory's disappearance after the workers' sweep; copies against the
source's files, byte for byte (and the same inodes: no bytes duplicated); the audit log against the calls made.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
import uuid
import warnings
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
import redis
import requests

from tests.helpers import make_batch
from tests.sdk_fleet import Fleet, sdk_fleet
from tests.test_gateway import ADAM, NAME, sdk_batch
from tinkerq import keys
from tinkerq.settings import Settings
from tinkerq.tenants import ApiKeys

tinker = pytest.importorskip("tinker")

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore:DEPRECATED. ServiceClient.create_rest_client:FutureWarning")]
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def fleet(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[Fleet]:
    os.environ["TINKER_TELEMETRY"] = "0"
    with sdk_fleet(model_dir, redis_url, checkpoint_dir, tmp_path_factory.mktemp("sdk-checkpoints")) as made:
        yield made


def service(fleet: Fleet, who: str, **kwargs) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=fleet.url, api_key=fleet.keys[who], **kwargs)


def rest(fleet: Fleet, who: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=fleet.url, api_key=fleet.keys[who])


def directory_of(fleet: Fleet, path: str) -> Path:
    """Where the worker wrote the checkpoint (the gateway's record of it, read from Redis)."""
    raw = redis.Redis.from_url(fleet.redis_url).get(keys.gateway_record("checkpoint", path))
    assert raw is not None, path
    return Path(json.loads(raw)["directory"])


def marker(directory: Path) -> dict:
    for name in ("tinkerq_state.json", "tinkerq_weights.json"):
        if (directory / name).is_file():
            return json.loads((directory / name).read_text())
    raise AssertionError(f"no marker in {directory}")


def files(directory: Path) -> dict[str, tuple[str, int]]:
    """Every file below ``directory`` but the marker: (sha256, inode)."""
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_ino)
            for p in sorted(directory.rglob("*")) if p.is_file() and not p.name.startswith("tinkerq_")}


def prompt_logprobs(sampler) -> list[float]:
    return sampler.compute_logprobs(tinker.ModelInput.from_ints(PROMPT)).result()[1:]


@pytest.fixture(scope="module")
def trained(fleet: Fleet) -> dict:
    """Alice's run trained two steps, with a state and a sampler checkpoint, and what they compute."""
    sc = service(fleet, "alice")
    tc = sc.create_lora_training_client(NAME, rank=4, seed=7).result(timeout=120)
    batch = sdk_batch(make_batch(np.random.default_rng(8), 3, max_len=12))
    for _ in range(2):
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(tinker.AdamParams(**ADAM)).result()
    state = tc.save_state("two-steps").result(timeout=120).path
    sampler_path = tc.save_weights_for_sampler("two-steps-sampler").result(timeout=120).path
    forward = tc.forward(batch, "cross_entropy").result()
    return {"sc": sc, "tc": tc, "batch": batch, "state": state, "sampler": sampler_path,
            "forward": [o["logprobs"].to_numpy() for o in forward.loss_fn_outputs],
            "logprobs": prompt_logprobs(sc.create_sampling_client(model_path=sampler_path).result(timeout=120)),
            "base": prompt_logprobs(sc.create_sampling_client(base_model=NAME).result(timeout=120))}


def test_list_user_checkpoints(fleet: Fleet, trained: dict):
    sc = trained["sc"]
    other = sc.create_lora_training_client(NAME, rank=4).result(timeout=120)
    later = [other.save_state(f"s{i}").result(timeout=120).path for i in range(2)]
    later.append(other.save_weights_for_sampler("w").result(timeout=120).path)
    expected = [*reversed(later), trained["sampler"], trained["state"]]  # newest first
    alice = rest(fleet, "alice")
    listed = alice.list_user_checkpoints().result()
    assert [c.tinker_path for c in listed.checkpoints][:5] == expected
    assert listed.cursor.total_count == len(listed.checkpoints) >= 5
    page = alice.list_user_checkpoints(limit=2, offset=1).result()
    assert [c.tinker_path for c in page.checkpoints] == expected[1:3]
    assert (page.cursor.offset, page.cursor.limit, page.cursor.total_count) == (1, 2, listed.cursor.total_count)
    by_path = {c.tinker_path: c for c in listed.checkpoints}
    assert by_path[trained["state"]].checkpoint_type == "training"
    assert by_path[later[-1]].checkpoint_type == "sampler" and by_path[later[-1]].size_bytes > 0
    assert asyncio.run(_listed_async(alice)) == [c.tinker_path for c in listed.checkpoints]

    # The tinker command without --run-id pages through the same list (batches of --limit).
    done = fleet.cli("alice", "--format", "json", "checkpoint", "list", "--limit", "0")
    assert done.returncode == 0, done.stderr
    assert [c["tinker_path"] for c in json.loads(done.stdout)["checkpoints"]] == \
        [c.tinker_path for c in listed.checkpoints]
    # Another tenant sees none of them.
    assert not {c.tinker_path for c in rest(fleet, "bob").list_user_checkpoints().result().checkpoints} & set(expected)


async def _listed_async(client: tinker.RestClient) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        deprecated = await client.list_user_checkpoints_async()
    awaited = await client.list_user_checkpoints()
    assert [c.tinker_path for c in deprecated.checkpoints] == [c.tinker_path for c in awaited.checkpoints]
    return [c.tinker_path for c in awaited.checkpoints]


def test_publish_and_unpublish_across_tenants(fleet: Fleet, trained: dict):
    alice, bob_rest, bob = rest(fleet, "alice"), rest(fleet, "bob"), service(fleet, "bob")
    state, sampler = trained["state"], trained["sampler"]
    # Private: bob cannot read either, nor publish them.
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=sampler).result(timeout=60)
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_weights_info_by_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.publish_checkpoint_from_tinker_path(state).result()

    alice.publish_checkpoint_from_tinker_path(sampler).result()
    asyncio.run(_publish_async(alice, state))
    # Already public: 409, Tinker's answer (over raw HTTP: the SDK retries a 409 for 5 minutes before it raises).
    assert publish_http(fleet, "alice", state, "POST").status_code == 409
    listed = {c.tinker_path: c for c in alice.list_checkpoints(trained["tc"].model_id).result().checkpoints}
    assert listed[state].public and listed[sampler].public

    # Published: bob reads both by path and computes what alice's clients computed from them.
    theirs = prompt_logprobs(bob.create_sampling_client(model_path=sampler).result(timeout=120))
    np.testing.assert_allclose(theirs, trained["logprobs"], rtol=0, atol=1e-6)
    assert not np.allclose(theirs, trained["base"], atol=1e-4)  # the trained weights, not the base model's
    info = bob_rest.get_weights_info_by_tinker_path(state).result()
    assert info.base_model == NAME and info.is_lora and info.lora_rank == 4
    loaded = bob.create_training_client_from_state(state).result(timeout=120)
    forward = loaded.forward(trained["batch"], "cross_entropy").result()
    for got, want in zip(forward.loss_fn_outputs, trained["forward"], strict=True):
        np.testing.assert_allclose(got["logprobs"].to_numpy(), want, rtol=0, atol=1e-6)
    # ...but still cannot change them.
    for call in (lambda: bob_rest.unpublish_checkpoint_from_tinker_path(state).result(),
                 lambda: bob_rest.delete_checkpoint_from_tinker_path(state).result(),
                 lambda: bob_rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result()):
        with pytest.raises(tinker.NotFoundError):
            call()

    # Unpublished (SDK and command): nobody else reads them; a second unpublish is a conflict.
    alice.unpublish_checkpoint_from_tinker_path(sampler).result()
    done = fleet.cli("alice", "checkpoint", "unpublish", state)
    assert done.returncode == 0, done.stdout + done.stderr
    assert publish_http(fleet, "alice", state, "DELETE").status_code == 409
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=sampler).result(timeout=60)
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(state).result(timeout=60)
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_weights_info_by_tinker_path(state).result()
    # The owner still reads them; the command publishes again.
    assert alice.get_weights_info_by_tinker_path(state).result().base_model == NAME
    done = fleet.cli("alice", "checkpoint", "publish", sampler)
    assert done.returncode == 0, done.stdout + done.stderr
    np.testing.assert_allclose(prompt_logprobs(bob.create_sampling_client(model_path=sampler).result(timeout=120)),
                               theirs, rtol=0, atol=1e-6)
    alice.unpublish_checkpoint_from_tinker_path(sampler).result()


def publish_http(fleet: Fleet, who: str, path: str, method: str) -> requests.Response:
    run, segment, name = path[len("tinker://"):].split("/")
    return requests.request(method, f"{fleet.url}/api/v1/training_runs/{run}/checkpoints/{segment}/{name}/publish",
                            headers={"X-API-Key": fleet.keys[who]}, timeout=30)


async def _publish_async(client: tinker.RestClient, path: str) -> None:
    await client.publish_checkpoint_from_tinker_path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        await client.unpublish_checkpoint_from_tinker_path_async(path)
        await client.publish_checkpoint_from_tinker_path_async(path)


def test_checkpoint_ttl_set_and_swept(fleet: Fleet, trained: dict):
    sc, alice = trained["sc"], rest(fleet, "alice")
    tc = sc.create_lora_training_client(NAME, rank=4).result(timeout=120)
    short = tc.save_weights_for_sampler("short-lived").result(timeout=120).path
    kept = tc.save_state("kept", ttl_seconds=7200).result(timeout=120).path
    short_dir, kept_dir = directory_of(fleet, short), directory_of(fleet, kept)
    assert "expires_at" not in marker(short_dir) and "expires_at" in marker(kept_dir)

    # Out of range, or another tenant's: refused.
    with pytest.raises(tinker.BadRequestError):
        alice.set_checkpoint_ttl_from_tinker_path(short, 0).result()
    with pytest.raises(tinker.NotFoundError):
        rest(fleet, "bob").set_checkpoint_ttl_from_tinker_path(short, 60).result()

    # The command removes an expiry: the marker and the listing say never.
    done = fleet.cli("alice", "checkpoint", "set-ttl", kept, "--remove")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "expires_at" not in marker(kept_dir)
    listed = {c.tinker_path: c for c in alice.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[kept].expires_at is None

    # A short ttl: the marker and the listing say when; after it, the listing has it no more, the worker's sweep
    # (after its next save) deletes the directory, and loading it is refused.
    before = time.time()
    alice.set_checkpoint_ttl_from_tinker_path(short, 2).result()
    expires = marker(short_dir)["expires_at"]
    assert before + 2 <= expires <= time.time() + 2
    listed = {c.tinker_path: c for c in alice.list_checkpoints(tc.model_id).result().checkpoints}
    assert abs(listed[short].expires_at.timestamp() - expires) < 1e-3
    time.sleep(max(0.0, expires - time.time()) + 0.5)
    assert short not in {c.tinker_path for c in alice.list_user_checkpoints(limit=1000).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        sc.create_sampling_client(model_path=short).result(timeout=60)
    tc.save_state("after-expiry").result(timeout=120)  # a save: the worker sweeps expired checkpoints
    deadline = time.monotonic() + 30
    while short_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not short_dir.exists() and kept_dir.exists()

    # The async spellings.
    async def spelled() -> None:
        await alice.set_checkpoint_ttl_from_tinker_path(kept, 7200)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            await alice.set_checkpoint_ttl_from_tinker_path_async(kept, 3600)
    now = time.time()
    asyncio.run(spelled())
    assert now + 3600 <= marker(kept_dir)["expires_at"] <= time.time() + 3600


def test_copy_weights(fleet: Fleet, trained: dict):
    project = f"archive-{uuid.uuid4().hex[:6]}"
    sc = service(fleet, "alice", project_id=project)
    source = trained["sampler"]
    copied = sc.copy_weights(source).result(timeout=60)
    assert copied != source and copied.endswith("/sampler_weights/two-steps-sampler")
    source_dir, copy_dir = directory_of(fleet, source), directory_of(fleet, copied)
    assert copy_dir != source_dir and files(copy_dir) == files(source_dir)  # same bytes, same inodes
    assert "expires_at" not in marker(copy_dir)
    np.testing.assert_allclose(prompt_logprobs(sc.create_sampling_client(model_path=copied).result(timeout=120)),
                               trained["logprobs"], rtol=0, atol=1e-6)
    # The copy is a run of its own, in a new session of the destination project, that cannot be trained on.
    alice = rest(fleet, "alice")
    run = alice.get_training_run_by_tinker_path(copied).result()
    assert run.base_model == NAME and run.is_lora and run.lora_rank == 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = alice.search_sessions(tinker.types.SessionSearchRequest(project_ids=[project])).result().sessions
    summaries = {s.session_id: s for s in found}  # the copy's session, and sc's own (its sampling client's)
    assert summaries[run.training_run_id.split(":")[0]].checkpoints_count == 1

    # RestClient.copy_weights of a state, with a ttl; the async spelling.
    state_copy = alice.copy_weights(trained["state"], project, ttl_seconds=7200).result(timeout=60)
    assert files(directory_of(fleet, state_copy)) == files(directory_of(fleet, trained["state"]))
    assert time.time() + 7100 < marker(directory_of(fleet, state_copy))["expires_at"] <= time.time() + 7200
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        third = asyncio.run(alice.copy_weights_async(trained["state"], project))
    loaded = service(fleet, "alice").create_training_client_from_state(third).result(timeout=120)
    for got, want in zip(loaded.forward(trained["batch"], "cross_entropy").result().loss_fn_outputs,
                         trained["forward"], strict=True):
        np.testing.assert_allclose(got["logprobs"].to_numpy(), want, rtol=0, atol=1e-6)
    alice.delete_checkpoint_from_tinker_path(state_copy).result()  # a copy is deleted as any checkpoint
    assert state_copy not in {c.tinker_path for c in alice.list_user_checkpoints(limit=1000).result().checkpoints}

    # Another tenant: a private checkpoint is not there; a published one is copied into bob's own runs.
    bob = rest(fleet, "bob")
    with pytest.raises(tinker.NotFoundError):
        bob.copy_weights(source, "bobs").result(timeout=60)
    alice.publish_checkpoint_from_tinker_path(source).result()
    bobs = bob.copy_weights(source, "bobs").result(timeout=60)
    alice.unpublish_checkpoint_from_tinker_path(source).result()
    assert bob.get_training_run_by_tinker_path(bobs).result().model_owner == fleet.tenants["bob"]
    with pytest.raises(tinker.NotFoundError):
        alice.get_weights_info_by_tinker_path(bobs).result()
    with pytest.raises(ValueError):  # the SDK's own check: a destination project is required
        tinker.RestClient(base_url=fleet.url, api_key=fleet.keys["bob"]).copy_weights(source)


def test_copy_outlives_its_source_and_retries_once(fleet: Fleet, trained: dict):
    """The copy's files are its own links: the source expiring and swept leaves the copy whole. A resend with the
    SDK's idempotency key answers the first copy."""
    alice = rest(fleet, "alice")
    source = trained["tc"].save_weights_for_sampler("to-expire").result(timeout=120).path
    copy_path = alice.copy_weights(source, "keep").result(timeout=60)
    alice.set_checkpoint_ttl_from_tinker_path(source, 1).result()
    source_dir = directory_of(fleet, source)
    time.sleep(1.5)
    trained["tc"].save_state("sweep-now").result(timeout=120)  # the worker sweeps after a save
    deadline = time.monotonic() + 30
    while source_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not source_dir.exists()
    sampler = service(fleet, "alice").create_sampling_client(model_path=copy_path).result(timeout=120)
    np.testing.assert_allclose(prompt_logprobs(sampler), trained["logprobs"], rtol=0, atol=1e-6)

    body = {"source_path": trained["sampler"], "destination_project_id": "keep"}
    headers = {"X-API-Key": fleet.keys["alice"], "X-Idempotency-Key": uuid.uuid4().hex}
    first, again = (requests.post(f"{fleet.url}/api/v1/copy_weights", json=body, headers=headers, timeout=30)
                    for _ in range(2))
    assert first.status_code == again.status_code == 200
    assert first.json()["tinker_path"] == again.json()["tinker_path"]


def test_audit_log(fleet: Fleet, trained: dict):
    admin = tinker.AdminClient(base_url=fleet.url, api_key=fleet.keys["alice"])
    entries = admin.get_audit_log().result().entries
    events = [e.event for e in entries]
    assert events[0] == "api_key_create"
    assert [e.timestamp for e in entries] == sorted(e.timestamp for e in entries)
    for_state = [e.event for e in entries if e.event_details.get("tinker_path") == trained["state"]]
    assert for_state[0] == "checkpoint_create" and {"checkpoint_publish", "checkpoint_unpublish"} <= set(for_state)
    reads = [e for e in entries if e.event == "checkpoint_read" and e.event_details["tinker_path"] == trained["state"]]
    assert reads and all(e.event_details["actor"] == fleet.tenants["bob"] for e in reads)  # bob, while public
    assert {"checkpoint_ttl_set", "checkpoint_copy", "checkpoint_delete"} <= set(events)
    checkpoints = admin.get_audit_log(event_type="checkpoints").result().entries
    assert checkpoints and all(e.event.startswith("checkpoint_") for e in checkpoints)
    assert checkpoints[0].tinker_path == checkpoints[0].event_details["tinker_path"]
    keys_only = admin.get_audit_log(event_type="organizations").result().entries
    assert [e.event for e in keys_only] == ["api_key_create"]
    today = datetime.now(timezone.utc).date()
    assert len(admin.get_audit_log(day=today).result().entries) == len(entries)
    assert admin.get_audit_log(day=today - timedelta(days=1)).result().entries == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert len(rest(fleet, "alice").get_audit_log().result().entries) == len(entries)  # the deprecated spellings

        async def spelled_async() -> list[int]:
            return [len((await admin.get_audit_log()).entries), len((await admin.get_audit_log_async()).entries),
                    len((await rest(fleet, "alice").get_audit_log_async()).entries)]
        assert asyncio.run(spelled_async()) == [len(entries)] * 3

    # Bob's log has his own events only: none about alice's checkpoints but his reads' answers to him.
    theirs = tinker.AdminClient(base_url=fleet.url, api_key=fleet.keys["bob"]).get_audit_log().result().entries
    assert theirs[0].event == "api_key_create"
    assert all(e.event_details.get("actor") == fleet.tenants["bob"] for e in theirs)
    assert not any(e.event_details.get("tinker_path") in (trained["state"], trained["sampler"]) for e in theirs)

    # Key events: a tenant's key revoked and made again (tinkerq keys revoke / create) is in its log, in order.
    name = f"carol-{uuid.uuid4().hex[:6]}"
    api_keys = ApiKeys.open(Settings(broker_url=fleet.redis_url))
    api_keys.create(name)
    assert api_keys.revoke(name)
    key = api_keys.create(name)
    api_keys.close()
    log = tinker.AdminClient(base_url=fleet.url, api_key=key).get_audit_log(event_type="organizations").result()
    assert [e.event for e in log.entries] == ["api_key_create", "api_key_revoke", "api_key_create"]
    assert all(key not in json.dumps(e.event_details) for e in log.entries)  # never the key itself
