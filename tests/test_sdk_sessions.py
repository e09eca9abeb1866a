"""Sessions through the official SDK 0.38 and its ``tinker`` command, against a real worker, gateway and Redis:
``RestClient.get_session``, ``list_sessions``, ``search_sessions``, ``assign_session_project`` and
``export_session_trace`` (``tinker session export-trace``), sync and async spellings.

Checked independently: session contents against the ids the SDK's own clients report; listing and search order
against the order the test made the sessions in; the trace against the requests the test made (which operations,
seq_ids, the tokens it sent and the SDK's own result metrics, timings within the test's own clock readings). Another
tenant gets 404 for every session call and finds none of the first tenant's sessions.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.helpers import make_batch
from tests.sdk_fleet import Fleet, sdk_fleet
from tests.test_gateway import ADAM, NAME, sdk_batch

tinker = pytest.importorskip("tinker")
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent  # noqa: E402
from tinker import types as ttypes  # noqa: E402

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore:DEPRECATED. ServiceClient.create_rest_client:FutureWarning")]
FINISHES = ("success", "errored", "interrupted")


@pytest.fixture(scope="module")
def fleet(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[Fleet]:
    os.environ["TINKER_TELEMETRY"] = "0"
    with sdk_fleet(model_dir, redis_url, checkpoint_dir, tmp_path_factory.mktemp("sdk-sessions")) as made:
        yield made


def client(fleet: Fleet, who: str, **kwargs) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=fleet.url, api_key=fleet.keys[who], **kwargs)


def session_of(model_id: str) -> str:
    return model_id.split(":", 1)[0]


def sampler_id(sampler) -> str:
    """The sampler's id, from its public handle."""
    return json.loads(base64.urlsafe_b64decode(sampler.get_sampler_handle()))["sampling_session_id"]


def test_get_list_search_and_assign_sessions(fleet: Fleet):
    tag = uuid.uuid4().hex[:8]
    made = []  # (session id, its training run ids, its sampler ids), oldest first
    for i in range(3):
        sc = client(fleet, "alice", user_metadata={"tag": tag, "i": str(i)}, display_name=f"nightly {tag} run{i}")
        tc = sc.create_lora_training_client(NAME, rank=4, seed=i).result(timeout=120)
        runs, samplers = [tc.model_id], []
        if i == 1:  # a second run, and a sampler on the session's base model
            runs.append(sc.create_lora_training_client(NAME, rank=4).result(timeout=120).model_id)
            samplers.append(sampler_id(sc.create_sampling_client(base_model=NAME).result(timeout=120)))
        made.append((session_of(tc.model_id), runs, samplers))
        sc.close(FINISHES[i], detail=f"run {i}").result()
        time.sleep(0.01)
    rest = client(fleet, "alice").create_rest_client()

    for session_id, runs, samplers in made:
        got = rest.get_session(session_id).result()
        assert got.training_run_ids == runs and got.sampler_ids == samplers
        assert got.user_metadata["tag"] == tag and got.display_name.startswith(f"nightly {tag}")

    # list_sessions: newest first, paged by limit / offset.
    newest_first = [s for s, _, _ in reversed(made)]
    assert rest.list_sessions(limit=3).result().sessions == newest_first
    assert rest.list_sessions(limit=1, offset=1).result().sessions == newest_first[1:2]

    # search_sessions: by display name words, metadata, status; paged by cursor in the same order.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # search_sessions is marked experimental
        request = ttypes.SessionSearchRequest(display_name=f"{tag} NIGHTLY", limit=1)
        pages, page = [], rest.search_sessions(request).result()
        while True:
            pages += [s.session_id for s in page.sessions]
            if page.next_cursor is None:
                break
            page = rest.search_sessions(request.model_copy(update={"cursor": page.next_cursor})).result()
        assert pages == newest_first
        one = rest.search_sessions(ttypes.SessionSearchRequest(user_metadata={"tag": tag, "i": "1"})).result()
        assert [s.session_id for s in one.sessions] == [made[1][0]]
        summary = one.sessions[0]
        assert summary.owner == fleet.tenants["alice"] and summary.checkpoints_count == 0
        assert summary.status.type == "client_finished" and summary.status.reason.type == "errored"
        assert summary.status.detail == "run 1"
        active = ttypes.SessionSearchRequest(display_name=tag, statuses=[ttypes.ActiveSessionStatusQuery()])
        assert rest.search_sessions(active).result().sessions == []
        ended = ttypes.SessionSearchRequest(display_name=tag, statuses=[
            ttypes.ClientFinishedSessionStatusQuery(reasons=["success", "interrupted"])])
        assert [s.session_id for s in rest.search_sessions(ended).result().sessions] == [made[2][0], made[0][0]]

        # assign_session_project: the session moves; search by project finds it and only it.
        project = f"proj-{tag}"
        rest.assign_session_project(made[2][0], project).result()
        in_project = rest.search_sessions(ttypes.SessionSearchRequest(project_ids=[project])).result()
        assert [(s.session_id, s.project_id) for s in in_project.sessions] == [(made[2][0], project)]
        # ...with its training runs: list_training_runs(project_id=...) lists those only.
        in_project_runs = rest.list_training_runs(project_id=project).result()
        assert [r.training_run_id for r in in_project_runs.training_runs] == made[2][1]

        # Another tenant: 404 for each call on alice's sessions, and none of them in its listings or searches.
        bob = tinker.RestClient(base_url=fleet.url, api_key=fleet.keys["bob"])  # constructed directly
        for call in (lambda: bob.get_session(made[0][0]).result(),
                     lambda: bob.assign_session_project(made[0][0], "mine").result()):
            with pytest.raises(tinker.NotFoundError):
                call()
        assert not set(bob.list_sessions(limit=1000).result().sessions) & {s for s, _, _ in made}
        assert bob.search_sessions(ttypes.SessionSearchRequest(display_name=tag)).result().sessions == []
        everyone = ttypes.SessionSearchRequest(display_name=tag, owner=ttypes.AccessibleSearchOwner())
        assert bob.search_sessions(everyone).result().sessions == []

    # The async spellings: awaiting the futures, and the deprecated *_async methods.
    async def spelled_async() -> None:
        got = await rest.get_session(made[1][0])
        assert got.training_run_ids == made[1][1]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            assert (await rest.list_sessions_async(limit=3)).sessions == newest_first
            assert (await rest.get_session_async(made[0][0])).sampler_ids == []
            await rest.assign_session_project_async(made[0][0], f"other-{tag}")
    asyncio.run(spelled_async())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moved = rest.search_sessions(ttypes.SessionSearchRequest(project_ids=[f"other-{tag}"])).result()
    assert [s.session_id for s in moved.sessions] == [made[0][0]]


def _slices(raw: bytes) -> tuple[dict[int, str], list[dict]]:
    """The tracks and slices of a Perfetto trace, read back with Perfetto's own protos."""
    trace = Trace.FromString(raw)
    tracks = {p.track_descriptor.uuid: p.track_descriptor.name for p in trace.packet if p.HasField("track_descriptor")}
    open_slices: dict[int, dict] = {}
    done = []
    for p in trace.packet:
        if not p.HasField("track_event"):
            continue
        if p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN:
            args = {}
            for a in p.track_event.debug_annotations:
                kind = a.WhichOneof("value")
                args[a.name] = getattr(a, kind)
            open_slices[p.track_event.track_uuid] = {"track": tracks[p.track_event.track_uuid],
                                                     "name": p.track_event.name, "start": p.timestamp / 1e9,
                                                     "args": args}
        else:
            s = open_slices.pop(p.track_event.track_uuid)
            s["end"] = p.timestamp / 1e9
            done.append(s)
    assert not open_slices
    return tracks, done


def test_export_session_trace(fleet: Fleet, tmp_path: Path):
    sc = client(fleet, "alice")
    t0 = time.time()
    tc = sc.create_lora_training_client(NAME, rank=4, seed=3).result(timeout=120)
    batch = make_batch(np.random.default_rng(4), 3, max_len=12)
    sent_tokens = sum(d.model_input.length for d in batch)
    windows, results = [], []
    for _ in range(2):
        started = time.time()
        results.append(tc.forward_backward(sdk_batch(batch), "cross_entropy").result())
        windows.append((started, time.time()))
        optim = tc.optim_step(tinker.AdamParams(**ADAM)).result()
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=120)
    prompt = tinker.ModelInput.from_ints([1, 2, 3, 4])
    params = tinker.SamplingParams(max_tokens=5, seed=1)
    sampled = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    t1 = time.time()
    session_id = session_of(tc.model_id)
    rest = sc.create_rest_client()

    url = rest.export_session_trace(session_id).result()
    assert fleet.keys["alice"] not in url
    got = requests.get(url, timeout=30)  # no API key: the signed URL is the permission
    assert got.status_code == 200
    tracks, slices = _slices(got.content)
    assert tc.model_id in tracks.values() and sampler_id(sampler) in tracks.values()
    training = [s for s in slices if s["track"] == tc.model_id]
    assert [s["name"] for s in training] == ["create", "forward_backward", "optim_step", "forward_backward",
                                             "optim_step", "create_sampler"]
    numbered = [s["args"]["seq_id"] for s in training[1:]]
    assert numbered == sorted(numbered) and len(set(numbered)) == 5
    for s, result, (started, ended) in zip([s for s in training if s["name"] == "forward_backward"], results,
                                           windows, strict=True):
        assert started - 0.01 <= s["start"] <= s["end"] <= ended + 0.01  # the test's own clock brackets it
        assert s["args"]["usage.training_tokens"] == sent_tokens
        assert s["args"]["metrics.loss:sum"] == pytest.approx(result.metrics["loss:sum"], rel=1e-6)
    last_optim = [s for s in training if s["name"] == "optim_step"][-1]
    for name, value in optim.metrics.items():
        assert last_optim["args"][f"metrics.{name}"] == pytest.approx(value)
    samples = [s for s in slices if s["track"] == sampler_id(sampler)]
    assert [s["name"] for s in samples] == ["sample"]
    assert samples[0]["args"]["usage.sampled_tokens"] == sum(len(s.tokens) for s in sampled.sequences)
    assert samples[0]["args"]["usage.prefill_tokens"] + samples[0]["args"].get("usage.cached_prefill_tokens", 0) \
        == prompt.length
    assert all(t0 - 0.01 <= s["start"] <= s["end"] <= t1 + 0.01 and s["args"]["answer_bytes"] > 0 for s in slices)

    # The tinker command: downloads the same trace, or prints the URL.
    out = tmp_path / "trace.pftrace"
    done = fleet.cli("alice", "--format", "json", "session", "export-trace", session_id, "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["destination"] == str(out)
    assert _slices(out.read_bytes())[1] == slices
    done = fleet.cli("alice", "session", "export-trace", session_id, "--url-only")
    assert done.returncode == 0 and requests.get(done.stdout.strip(), timeout=30).content == got.content

    # The async spellings answer a URL to the same trace.
    async def spelled_async() -> list[str]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return [await rest.export_session_trace(session_id), await rest.export_session_trace_async(session_id)]
    for other in asyncio.run(spelled_async()):
        assert _slices(requests.get(other, timeout=30).content)[1] == slices

    # A URL altered, or another tenant's session: refused.
    token = url.rsplit("/", 1)[1]
    assert requests.get(url.replace(token, token[:-2] + ("AA" if token[-2:] != "AA" else "BB")),
                        timeout=30).status_code == 403
    with pytest.raises(tinker.NotFoundError):
        client(fleet, "bob").create_rest_client().export_session_trace(session_id).result()
    done = fleet.cli("bob", "session", "export-trace", session_id, "--url-only")
    assert done.returncode != 0 and "not found" in (done.stdout + done.stderr).lower()
    sc.close("success").result()


def test_session_updates_never_undo_each_other(redis_url: str):
    """Heartbeats, finishes and project assignments rewrite one session record from many gateways at once: each is
    an atomic update (Records.update), so none undoes another. Two threads bump two fields 300 times each."""
    import threading

    import redis as redis_lib

    from tinkerq.gateway.records import Records
    from tinkerq.store import RedisStore

    records = Records(RedisStore(redis_lib.Redis.from_url(redis_url)))
    ident = f"race-{uuid.uuid4().hex}"
    records.put("session", ident, {"tenant": "t", "created": time.time(), "finished": False, "a": 0, "b": 0})

    def bump(field: str) -> None:
        for _ in range(300):
            assert records.update("session", ident, "t", lambda r: r.update({field: r[field] + 1})) is not None

    threads = [threading.Thread(target=bump, args=(field,)) for field in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = records.get("session", ident, "t")
    assert (final["a"], final["b"]) == (300, 300)
    assert records.update("session", ident, "another tenant", lambda r: r.update(a=0)) is None
    assert records.get("session", ident, "t")["a"] == 300
