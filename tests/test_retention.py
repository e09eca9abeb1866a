"""Checkpoint retention per session (worker/checkpoints/retention.py): a save with keep_newest=N keeps the session's N
newest checkpoints of its kind and names the ones it deleted; every save's reply gives its size in bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_checkpoints import client_of
from tinkerq import errors

pytestmark = pytest.mark.timeout(120)


def _dirs(parent: Path) -> set[str]:
    return {p.name for p in parent.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "state"}


def _size(directory: str) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def test_keep_newest_prunes_the_sessions_older_checkpoints_of_that_kind(service, training_client, checkpoint_dir):
    tc = client_of(training_client)
    other = client_of(service.create_training_client(tc.info.base_model))

    def save(client, op, name, **fields):
        body = {"name": name, **fields} if op == "save_state" else {"name": name, "merged": False, **fields}
        return client.submit(op, body)

    try:
        states = checkpoint_dir / tc.model_id / "state"
        kept_elsewhere = save(other, "save_state", "mine").result(60)["path"]
        replies = [save(tc, "save_state", f"s{i}", keep_newest=2).result(60) for i in range(4)]
        assert [r["pruned"] for r in replies] == [[], [], ["s0"], ["s1"]]
        assert _dirs(states) == {"s2", "s3"}
        for reply in replies[2:]:
            assert reply["bytes"] == _size(reply["path"]) > 0
        assert Path(kept_elsewhere).is_dir()  # another session's checkpoints are not this one's to prune

        # Sampler weights are pruned among themselves; the states stay.
        weights = [save(tc, "save_weights_for_sampler", f"w{i}", keep_newest=1).result(60) for i in range(3)]
        assert [r["pruned"] for r in weights] == [[], ["w0"], ["w1"]]
        assert _dirs(checkpoint_dir / tc.model_id) == {"w2"} and _dirs(states) == {"s2", "s3"}
        assert weights[-1]["bytes"] == _size(weights[-1]["path"]) > 0
        plain = save(tc, "save_state", "plain").result(60)  # without keep_newest: nothing pruned
        assert plain["pruned"] == [] and plain["bytes"] == _size(plain["path"])

        # A bad keep_newest is the caller's error: nothing saved, nothing deleted, and the worker goes on.
        before = sorted(os.listdir(states))
        for bad in (0, -1, True, "2", 1.5):
            err = save(tc, "save_state", "bad", keep_newest=bad).exception(60)
            assert isinstance(err, errors.ValidationError) and "keep_newest" in err.message, (bad, err)
        assert sorted(os.listdir(states)) == before
        assert save(tc, "save_state", "s4", keep_newest=1).result(60)["pruned"] == ["plain", "s3", "s2"]
    finally:
        other.close()
