"""The rest of the SDK 0.38 REST surface, walked through its clients (``RestClient``, ``AdminClient``; sync and
async spellings) and its ``tinker`` command, against a real worker, gateway and Redis: runs and checkpoints
described, samplers looked up, telemetry, billing usage, checkpoint storage and deletion.

Checked independently: every description against what this module created (run ids, checkpoint paths and names,
the base model, the LoRA rank, the caller's tenant); sizes against the checkpoint directories' bytes on disk; the
billing usage against the tokens this module sent (training tokens: every datum of its forward_backward and
forward calls; prefill and sampled tokens: its one sample's prompt and answer; checkpoints: its saves, as
docs/gateway.md and tests/test_usage.py define them); storage against the live checkpoints' count and bytes on
disk; deletions against the listings and the disk, where the directories are gone.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.helpers import make_batch
from tests.sdk_fleet import Fleet, sdk_fleet
from tests.test_gateway import ADAM, NAME, sdk_batch
from tinkerq import keys
from tinkerq.settings import Settings
from tinkerq.tenants import ApiKeys

tinker = pytest.importorskip("tinker")

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore::FutureWarning")]  # the deprecated spellings are called on purpose
PROMPT = [3, 1, 4, 1, 5, 9, 2]
DOOMED = ("del-sync", "del-async", "del-path-async", "del-cli")  # one checkpoint for each way of deleting


@pytest.fixture(scope="module")
def fleet(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[Fleet]:
    os.environ["TINKER_TELEMETRY"] = "0"
    with sdk_fleet(model_dir, redis_url, checkpoint_dir, tmp_path_factory.mktemp("sdk-walk-rest")) as made:
        yield made


def rest(fleet: Fleet, who: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=fleet.url, api_key=fleet.keys[who])


def admin(fleet: Fleet, who: str) -> tinker.AdminClient:
    return tinker.AdminClient(base_url=fleet.url, api_key=fleet.keys[who])


def directory_of(fleet: Fleet, path: str) -> Path:
    """Where the worker wrote the checkpoint (the gateway's record of it, read from Redis)."""
    raw = redis.Redis.from_url(fleet.redis_url).get(keys.gateway_record("checkpoint", path))
    assert raw is not None, path
    return Path(json.loads(raw)["directory"])


def bytes_on_disk(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


def hour(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(t))


@pytest.fixture(scope="module")
def walk(fleet: Fleet) -> dict:
    """Alice's LoRA run (rank 4): trained, sampled once, and saved: a state, a sampler and one checkpoint per way
    of deleting. What it sent and made, for the tests to check against."""
    started = time.time()
    sc = tinker.ServiceClient(base_url=fleet.url, api_key=fleet.keys["alice"])
    tc = sc.create_lora_training_client(NAME, rank=4, seed=3).result(timeout=120)
    batches = [sdk_batch(make_batch(np.random.default_rng(seed), 3, max_len=12)) for seed in (21, 22)]
    for batch in batches:
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(tinker.AdamParams(**ADAM)).result()
    tc.forward(batches[0], "cross_entropy").result()
    training_tokens = sum(d.model_input.length for b in [*batches, batches[0]] for d in b)
    state = tc.save_state("walk-state").result(timeout=120).path
    sampler_path = tc.save_weights_for_sampler("walk-sampler").result(timeout=120).path
    doomed = {name: tc.save_state(name).result(timeout=120).path for name in DOOMED}
    sampler = sc.create_sampling_client(model_path=sampler_path).result(timeout=120)
    sampled = sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1,
                             tinker.SamplingParams(max_tokens=5, temperature=1.0, seed=4)).result(timeout=120)
    return {"tc": tc, "run": tc.model_id, "state": state, "sampler_path": sampler_path, "doomed": doomed,
            "sampler": sampler, "started": started, "training_tokens": training_tokens,
            "sampled_tokens": len(sampled.sequences[0].tokens), "saves": 2 + len(DOOMED)}


def test_version_and_models(fleet: Fleet):
    done = fleet.cli("alice", "version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"tinker {version('tinker')}" == f"tinker {tinker.__version__}"

    done = fleet.cli("alice", "-f", "json", "model", "list")
    assert done.returncode == 0, done.stderr
    models = {m["model_name"]: m for m in json.loads(done.stdout)["models"]}
    assert NAME in models  # the name the worker serves
    done = fleet.cli("alice", "-f", "json", "model", "list", NAME.split("/")[-1].upper())  # substring, any case
    assert done.returncode == 0, done.stderr
    assert NAME in [m["model_name"] for m in json.loads(done.stdout)["models"]]
    done = fleet.cli("alice", "-f", "json", "model", "list", "no-such-model-xyz")  # the command's own refusal
    assert done.returncode != 0 and "No model name contains 'no-such-model-xyz'" in done.stderr


def check_run(run, fleet: Fleet, walk: dict) -> None:
    assert run.training_run_id == walk["run"] and run.base_model == NAME
    assert run.is_lora and run.lora_rank == 4 and run.model_owner == fleet.tenants["alice"]


def test_runs_described(fleet: Fleet, walk: dict):
    alice = rest(fleet, "alice")
    check_run(alice.get_training_run(walk["run"]).result(), fleet, walk)

    async def spelled() -> list:
        return [await alice.get_training_run_async(walk["run"]),
                await alice.get_training_run_by_tinker_path_async(walk["state"]),
                await alice.get_training_run_by_tinker_path_async(walk["sampler_path"]),
                await alice.list_training_runs_async(limit=100)]
    *runs, listed = asyncio.run(spelled())
    for run in runs:
        check_run(run, fleet, walk)
    assert runs[0].last_sampler_checkpoint.tinker_path == walk["sampler_path"]
    assert runs[0].last_checkpoint.tinker_path == walk["doomed"][DOOMED[-1]]  # the newest save_state
    assert walk["run"] in [r.training_run_id for r in listed.training_runs]
    assert listed.cursor.total_count == len(listed.training_runs)  # alice's runs: this module's only
    with pytest.raises(tinker.NotFoundError):  # not bob's
        rest(fleet, "bob").get_training_run(walk["run"]).result()
    assert walk["run"] not in [r.training_run_id for r in rest(fleet, "bob").list_training_runs().result()
                               .training_runs]

    done = fleet.cli("alice", "-f", "json", "run", "info", walk["run"])
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert (info["training_run_id"], info["base_model"], info["lora_rank"], info["model_owner"]) == \
        (walk["run"], NAME, 4, fleet.tenants["alice"])
    assert info["last_sampler_checkpoint"]["tinker_path"] == walk["sampler_path"]
    done = fleet.cli("alice", "-f", "json", "run", "list", "--limit", "0")
    assert done.returncode == 0, done.stderr
    assert [r["training_run_id"] for r in json.loads(done.stdout)["runs"]] == \
        [r.training_run_id for r in listed.training_runs]


def test_checkpoints_described(fleet: Fleet, walk: dict):
    alice = rest(fleet, "alice")
    listed = asyncio.run(alice.list_checkpoints_async(walk["run"])).checkpoints
    made = {walk["state"], walk["sampler_path"], *walk["doomed"].values()}
    assert {c.tinker_path for c in listed} == made
    for c in listed:
        assert c.tinker_path == f"tinker://{walk['run']}/{c.checkpoint_id}"
        assert c.size_bytes == bytes_on_disk(directory_of(fleet, c.tinker_path)) > 0
    by_path = {c.tinker_path: c for c in listed}
    assert by_path[walk["state"]].checkpoint_id == "weights/walk-state"
    assert by_path[walk["sampler_path"]].checkpoint_type == "sampler"

    done = fleet.cli("alice", "-f", "json", "checkpoint", "info", walk["sampler_path"])
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert (info["checkpoint_id"], info["tinker_path"], info["is_lora"], info["lora_rank"]) == \
        ("sampler_weights/walk-sampler", walk["sampler_path"], True, 4)
    assert info["size_bytes"] == bytes_on_disk(directory_of(fleet, walk["sampler_path"]))
    done = fleet.cli("bob", "-f", "json", "checkpoint", "info", walk["sampler_path"])  # not bob's
    assert done.returncode != 0


def sampler_id(sampler) -> str:
    """The sampler's id, from its public handle."""
    return json.loads(base64.urlsafe_b64decode(sampler.get_sampler_handle()))["sampling_session_id"]


def test_sampler_looked_up(fleet: Fleet, walk: dict):
    alice, sid = rest(fleet, "alice"), sampler_id(walk["sampler"])
    got = alice.get_sampler(sid).result()
    assert (got.sampler_id, got.base_model, got.model_path) == (sid, NAME, walk["sampler_path"])
    again = asyncio.run(alice.get_sampler_async(sid))
    assert (again.sampler_id, again.base_model, again.model_path) == (sid, NAME, walk["sampler_path"])
    with pytest.raises(tinker.NotFoundError):
        rest(fleet, "bob").get_sampler(sid).result()


def test_telemetry_follows_the_environment(fleet: Fleet, monkeypatch):
    # TINKER_TELEMETRY=0 (the fleet's): no telemetry object.
    assert rest(fleet, "alice").get_telemetry() is None and admin(fleet, "alice").get_telemetry() is None
    # =1: one, session-less (a REST client makes no session), shared by the clients of one key (the SDK keeps one
    # holder per key: a key of its own here, as alice's holder was made with telemetry off).
    monkeypatch.setenv("TINKER_TELEMETRY", "1")
    api_keys = ApiKeys.open(Settings(broker_url=fleet.redis_url))
    key = api_keys.create(f"tele-{uuid.uuid4().hex[:6]}")
    api_keys.close()
    on_rest = tinker.RestClient(base_url=fleet.url, api_key=key)
    telemetry = on_rest.get_telemetry()
    assert type(telemetry).__name__ == "Telemetry"
    assert tinker.AdminClient(base_url=fleet.url, api_key=key).get_telemetry() is telemetry
    try:
        assert telemetry.log_exception_sync(ValueError("a reported error"))  # queued for the telemetry route
        assert on_rest.list_sessions().result().sessions == []  # no session was made for it
    finally:
        telemetry.stop()  # its flush task, before the fleet goes


def usage_totals(response) -> dict[str, int]:
    totals = {"training": 0, "prefill": 0, "cached": 0, "sampled": 0, "checkpoints": 0}
    for e in response.data:
        info = e.event_info
        if info.type == "training":
            totals["training"] += info.token_count
        elif info.type == "sampling_prefill":
            totals["cached" if info.cached else "prefill"] += info.token_count
        elif info.type == "sampling_sample":
            totals["sampled"] += info.token_count
        elif info.type == "checkpoint":
            totals["checkpoints"] += info.count
    return totals


def test_billing_usage(fleet: Fleet, walk: dict):
    start, end = hour(walk["started"]), hour(time.time() + 3600)
    want = {"training": walk["training_tokens"], "prefill": len(PROMPT), "cached": 0,
            "sampled": walk["sampled_tokens"], "checkpoints": walk["saves"]}
    got = asyncio.run(admin(fleet, "alice").get_billing_usage_async(start, end))
    assert usage_totals(got) == want
    assert {e.user_name for e in got.data} == {fleet.tenants["alice"]}
    alice = rest(fleet, "alice")
    as_datetimes = [datetime.fromisoformat(t.replace("Z", "+00:00")).astimezone(timezone.utc) for t in (start, end)]
    assert usage_totals(alice.get_billing_usage(*as_datetimes).result()) == want
    assert usage_totals(asyncio.run(alice.get_billing_usage_async(start, end))) == want
    assert usage_totals(admin(fleet, "bob").get_billing_usage(start, end).result())["training"] == 0  # alice's only

    done = fleet.cli("alice", "-f", "json", "billing", "usage", start, end)
    assert done.returncode == 0, done.stderr
    assert usage_totals(tinker.types.BillingUsageResponse.model_validate(json.loads(done.stdout))) == want


def storage(response) -> tuple[int, int]:
    assert len(response.data) <= 1
    return (0, 0) if not response.data else (response.data[0].checkpoint_count, response.data[0].size_bytes)


def storage_everywhere(fleet: Fleet) -> list[tuple[int, int]]:
    """Alice's checkpoint storage through each spelling: AdminClient sync and async, RestClient's deprecated
    ones, and the tinker command."""
    a, r = admin(fleet, "alice"), rest(fleet, "alice")

    async def spelled() -> list:
        return [await a.get_current_checkpoint_storage_usage_async(),
                await r.get_current_checkpoint_storage_usage_async()]
    found = [storage(a.get_current_checkpoint_storage_usage().result()),
             storage(r.get_current_checkpoint_storage_usage().result()),
             *(storage(s) for s in asyncio.run(spelled()))]
    done = fleet.cli("alice", "-f", "json", "billing", "checkpoint-storage")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["data"]
    found.append((rows[0]["checkpoint_count"], rows[0]["size_bytes"]) if rows else (0, 0))
    return found


def test_storage_and_deletion(fleet: Fleet, walk: dict):
    alice = rest(fleet, "alice")
    live = {c.tinker_path for c in alice.list_user_checkpoints(limit=1000).result().checkpoints}
    assert live == {walk["state"], walk["sampler_path"], *walk["doomed"].values()}  # alice's: this module's only
    directories = {p: directory_of(fleet, p) for p in live}
    assert storage_everywhere(fleet) == [(len(live), sum(bytes_on_disk(d) for d in directories.values()))] * 5

    def delete(name: str) -> None:
        path = walk["doomed"][name]
        run_id, checkpoint_id = path[len("tinker://"):].split("/", 1)
        if name == "del-sync":
            alice.delete_checkpoint(run_id, checkpoint_id).result()
        elif name == "del-async":
            asyncio.run(alice.delete_checkpoint_async(run_id, checkpoint_id))
        elif name == "del-path-async":
            asyncio.run(alice.delete_checkpoint_from_tinker_path_async(path))
        else:
            done = fleet.cli("alice", "checkpoint", "delete", "--yes", path)
            assert done.returncode == 0, done.stdout + done.stderr

    with pytest.raises(tinker.NotFoundError):  # another tenant cannot
        rest(fleet, "bob").delete_checkpoint_from_tinker_path(walk["doomed"]["del-sync"]).result()
    for name in DOOMED:
        path = walk["doomed"][name]
        delete(name)
        live.discard(path)
        assert not directories[path].exists(), name  # gone from disk
        assert path not in {c.tinker_path for c in alice.list_checkpoints(walk["run"]).result().checkpoints}
        assert {c.tinker_path for c in alice.list_user_checkpoints(limit=1000).result().checkpoints} == live
    assert all(directories[p].is_dir() for p in live)  # the others stay
    with pytest.raises(tinker.NotFoundError):  # a deleted checkpoint cannot be loaded, nor deleted twice
        tinker.ServiceClient(base_url=fleet.url, api_key=fleet.keys["alice"]).create_training_client_from_state(
            walk["doomed"]["del-sync"]).result(timeout=60)
    with pytest.raises(tinker.NotFoundError):
        alice.delete_checkpoint_from_tinker_path(walk["doomed"]["del-sync"]).result()
    assert storage_everywhere(fleet) == [(len(live), sum(bytes_on_disk(directories[p]) for p in live))] * 5
