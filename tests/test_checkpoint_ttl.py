"""Checkpoints with ttl_seconds expire (refused and deleted when named, swept by workers); overwrite=False never
replaces a checkpoint."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from tinkerq import errors, types
from tinkerq.validation import MAX_CHECKPOINT_TTL_S, validate_ttl_seconds
from tinkerq.worker import checkpoints

pytestmark = pytest.mark.timeout(120)
MODEL_ID = "c" * 32
T0 = 1_800_000_000.0


@pytest.fixture
def clock(monkeypatch):
    """The checkpoints' clock, set by the test: ``clock[0]`` is now."""
    now = [T0]
    monkeypatch.setattr(checkpoints, "now", lambda: now[0])
    return now


def _state(root: Path, name: str, expires_at: float | None, model_id: str = MODEL_ID) -> Path:
    final = checkpoints.state_path(str(root), model_id, name)
    meta = {"format": checkpoints.STATE_FORMAT, **({"expires_at": expires_at} if expires_at is not None else {})}
    return checkpoints.write_atomically(final, lambda d: (d / checkpoints.STATE_FILE).write_text(json.dumps(meta)))


def _weights(root: Path, name: str, expires_at: float | None, model_id: str = MODEL_ID) -> Path:
    final = checkpoints.weights_path(str(root), model_id, name)

    def fill(d: Path) -> None:
        (d / "config.json").write_text("{}")
        checkpoints.write_weights_marker(d, "tiny", expires_at=expires_at)

    return checkpoints.write_atomically(final, fill)


def test_ttl_seconds_validation():
    for good in (None, 1, 3600, MAX_CHECKPOINT_TTL_S):
        validate_ttl_seconds(good)
    for bad in (0, -5, True, False, 1.5, "60", MAX_CHECKPOINT_TTL_S + 1):
        with pytest.raises(errors.ValidationError, match="ttl_seconds"):
            validate_ttl_seconds(bad)


def test_markers_record_expiry_and_expired_checkpoints_are_refused_and_deleted(tmp_path, clock):
    state = _state(tmp_path, "s", T0 + 1)
    weights = _weights(tmp_path, "w", T0 + 1)
    forever = _state(tmp_path, "forever", None)
    assert checkpoints.expiry(state) == checkpoints.expiry(weights) == T0 + 1
    assert json.loads((weights / checkpoints.WEIGHTS_FILE).read_text())["expires_at"] == T0 + 1
    assert checkpoints.expiry(forever) is None
    assert checkpoints.resolve_state_path(str(state), str(tmp_path)) == state  # not yet
    assert checkpoints.resolve_weights_path(str(weights), str(tmp_path)) == weights

    clock[0] = T0 + 1  # expires_at is the first moment it is gone
    for resolve, path in ((checkpoints.resolve_state_path, state), (checkpoints.resolve_weights_path, weights)):
        with pytest.raises(errors.ValidationError, match="expired at") as info:
            resolve(str(path), str(tmp_path))
        assert info.value.category == "user" and str(path) in info.value.message
        assert not path.exists()  # deleted on the way
        with pytest.raises(errors.ValidationError, match="does not exist"):
            resolve(str(path), str(tmp_path))
    clock[0] = T0 + 10**9
    assert checkpoints.resolve_state_path(str(forever), str(tmp_path)) == forever
    assert [p.name for p in (tmp_path / MODEL_ID / "state").iterdir()] == ["forever"]  # nothing left aside


def test_overwrite_false_refuses_an_existing_name_and_writes_nothing(tmp_path, clock):
    old = _state(tmp_path, "keep", None)
    (old / "payload").write_text("old")
    filled = []
    with pytest.raises(errors.ValidationError) as info:
        checkpoints.write_atomically(old, lambda d: filled.append(d), overwrite=False)
    assert "'keep'" in info.value.message and "pass overwrite=True or choose another name" in info.value.message
    assert not filled and (old / "payload").read_text() == "old"
    assert sorted(p.name for p in old.parent.iterdir()) == ["keep"]  # no temporary directory left

    def late_rival(d: Path) -> None:  # another worker saves the same name while this one fills
        (d / "payload").write_text("mine")
        _state(tmp_path, "raced", None)

    with pytest.raises(errors.ValidationError, match="already exists"):
        checkpoints.write_atomically(checkpoints.state_path(str(tmp_path), MODEL_ID, "raced"), late_rival,
                                     overwrite=False)
    assert not (old.parent / "raced" / "payload").exists()

    # overwrite=True replaces; an expired checkpoint's name is free even without it.
    checkpoints.write_atomically(old, lambda d: (d / "payload").write_text("new"))
    assert (old / "payload").read_text() == "new"
    expired = _state(tmp_path, "expired", T0 - 1)
    checkpoints.write_atomically(expired, lambda d: (d / "payload").write_text("fresh"), overwrite=False)
    assert (expired / "payload").read_text() == "fresh"


def test_sweep_deletes_only_expired_checkpoints_inside_and_follows_no_link(tmp_path, clock):
    root = tmp_path / "ckpt"
    gone = [_state(root, "old", T0 - 5), _weights(root, "old-w", T0), _weights(root, "x", T0 - 1, model_id="d" * 32)]
    kept = [_state(root, "young", T0 + 5), _weights(root, "forever", None), _state(root, "forever", None)]
    hidden = _state(root, "tmp", T0 - 5)  # a name starting with '.': where saves are built, left alone
    os.rename(hidden, hidden.with_name(".in-progress"))
    hidden = hidden.with_name(".in-progress")
    outside = _state(tmp_path / "elsewhere", "victim", T0 - 5)  # an expired checkpoint outside the directory
    os.symlink(outside.parent.parent, root / ("e" * 32))  # a planted link to it: never followed
    os.symlink(outside, root / MODEL_ID / "state" / "link")
    (root / "snapshots").mkdir()
    (root / "snapshots" / "f.safetensors").write_bytes(b"x")

    deleted = checkpoints.remove_expired(str(root))
    assert sorted(deleted) == sorted(gone)
    assert not any(p.exists() for p in gone)
    assert all(p.is_dir() for p in [*kept, hidden, outside]) and (root / "snapshots" / "f.safetensors").exists()
    assert checkpoints.remove_expired(str(root), at=T0 + 4) == []
    assert checkpoints.remove_expired(str(root), at=T0 + 5) == [kept[0]]
    assert checkpoints.remove_expired(str(tmp_path / "missing")) == []


def test_a_checkpoint_saved_again_meanwhile_is_put_back_not_deleted(tmp_path, clock, monkeypatch):
    path = _state(tmp_path, "s", T0 - 1)
    judged = iter([T0 - 1, T0 + 3600])  # expired when looked at, a new save once renamed aside
    monkeypatch.setattr(checkpoints, "expiry", lambda directory: next(judged))
    assert checkpoints.remove_expired(str(tmp_path)) == []
    assert path.is_dir() and [p.name for p in path.parent.iterdir()] == ["s"]


def test_sessions_write_expiry_and_refuse_overwrite_before_gathering(model_dir, tmp_path):
    from tests.test_checkpoints import _full_session, _lora_session

    for session in (_full_session(model_dir), _lora_session(model_dir)):
        state = session.save_state(str(tmp_path), "s", base_model="tiny", seq_id=1, expires_at=T0)
        assert checkpoints.expiry(Path(state)) == T0
        kwargs = {"merged": True} if hasattr(session, "config") else {}
        weights = Path(session.save_weights(str(tmp_path), "w", base_model="tiny", expires_at=T0, **kwargs))
        assert checkpoints.expiry(weights) == T0
        if kwargs:
            assert checkpoints.expiry(weights / "merged") == T0  # loadable by its own path: expires too
        def gather():
            raise AssertionError("gathered the state of a save that is refused")

        session.engine.gather_state = gather  # type: ignore[method-assign]
        with pytest.raises(errors.ValidationError, match="pass overwrite=True or choose another name"):
            session.save_state(str(tmp_path), "s", base_model="tiny", seq_id=2, overwrite=False)
        tmp_path = tmp_path / "next"


# -- through a worker -------------------------------------------------------------------------------------------


def test_worker_ttl_overwrite_and_sweep(training_client, checkpoint_dir):
    from tests.test_checkpoints import client_of
    from tests.test_sampling import post_sample
    from tinkerq.wire import messages

    tc = client_of(training_client)

    def call(op, body):
        return tc._submit(op, body, lambda b: b, argsrepr="test")

    started = time.time()
    weights = call("save_weights_for_sampler", {"name": "ttl-w", "merged": False, "ttl_seconds": 1}).result(60)
    state = call("save_state", {"name": "ttl-s", "ttl_seconds": 1, "overwrite": False}).result(60)
    plain = call("save_state", {"name": "ttl-keep"}).result(60)
    assert "expires_at" not in plain
    for reply in (weights, state):
        assert started + 1 <= reply["expires_at"] <= time.time() + 1
    err = call("save_state", {"name": "ttl-s", "overwrite": False}).exception(60)
    assert isinstance(err, errors.ValidationError) and "pass overwrite=True or choose another name" in err.message
    for body, words in (({"name": "x", "ttl_seconds": 0}, "ttl_seconds"), ({"name": "x", "ttl_seconds": True},
                        "ttl_seconds"), ({"name": "x", "overwrite": "no"}, "overwrite")):
        err = call("save_state", body).exception(60)
        assert isinstance(err, errors.ValidationError) and words in err.message, body

    time.sleep(max(0.0, max(weights["expires_at"], state["expires_at"]) - time.time()) + 0.2)
    err = tc.load_state(state["path"]).exception(60)
    assert isinstance(err, errors.ValidationError) and "expired" in err.message
    assert not Path(state["path"]).exists()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    body = messages.encode_sample_request({"path": weights["path"]}, prompt, 1, types.SamplingParams(max_tokens=1))
    err = post_sample(tc.service, tc.info.worker, body).exception(60)
    assert isinstance(err, errors.UserError) and "expired" in err.message, err
    tc.load_state(plain["path"]).result(60)  # no ttl: kept

    swept = call("save_state", {"name": "ttl-swept", "ttl_seconds": 1}).result(60)
    time.sleep(max(0.0, swept["expires_at"] - time.time()) + 0.2)
    call("save_weights_for_sampler", {"name": "after", "merged": False}).result(60)  # sweeps in the background
    deadline = time.monotonic() + 30
    while Path(swept["path"]).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(swept["path"]).exists() and Path(plain["path"]).is_dir()
    assert np.isfinite(tc.optim_step(types.AdamParams()).result(60).metrics["grad_norm:mean"])
