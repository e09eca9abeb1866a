"""The gateway's records on the store's primitives (gateway/records.py), on Redis and in memory alike (the ``store``
fixture): a tenant sees only its own records, concurrent updates of one record never undo each other, a run's top
sequence id only grows."""

from __future__ import annotations

import threading
import uuid

import pytest

from tinkerq import keys
from tinkerq.gateway.records import Records, top_raised
from tinkerq.store import KeyValueStore


def test_records_belong_to_their_tenant(store: KeyValueStore):
    records, ident = Records(store), uuid.uuid4().hex
    records.put("session", ident, {"tenant": "alice", "n": 1})
    assert records.get("session", ident, "alice") == {"tenant": "alice", "n": 1}
    assert records.get("session", ident, "bob") is None
    assert records.update("session", ident, "bob", lambda r: r.update(n=2)) is None  # not bob's: unchanged
    assert [i for i, _ in records.scan_items("session", "alice", ident[:8])] == [ident]
    assert records.scan("session", "bob", ident[:8]) == []


def test_concurrent_updates_of_one_record_all_land(store: KeyValueStore):
    records, ident = Records(store), uuid.uuid4().hex
    records.put("session", ident, {"tenant": "alice", "beats": 0})

    def beat() -> None:
        for _ in range(20):
            records.update("session", ident, "alice", lambda r: r.update(beats=r["beats"] + 1))

    threads = [threading.Thread(target=beat) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert records.get("session", ident, "alice") == {"tenant": "alice", "beats": 120}


def test_an_update_that_raises_writes_nothing(store: KeyValueStore):
    records, ident = Records(store), uuid.uuid4().hex
    records.put("session", ident, {"tenant": "alice", "finished": True})

    def refuse(record: dict) -> None:
        record["finished"] = False
        raise LookupError("finished")

    with pytest.raises(LookupError):
        records.update("session", ident, "alice", refuse)
    assert records.get("session", ident, "alice") == {"tenant": "alice", "finished": True}


def test_a_runs_top_only_grows_and_is_forgotten_with_it(store: KeyValueStore):
    records, run = Records(store), uuid.uuid4().hex
    assert records.top(run) == 0 and records.last_request(run) is None
    records.raise_top(run, 5)
    records.raise_top(run, 3)  # a late, lower one
    assert records.top(run) == 5 and records.last_request(run) is not None
    records.forget_run(run)
    assert records.top(run) == 0 and records.last_request(run) is None


def test_the_first_claim_wins(store: KeyValueStore):
    records, what = Records(store), f"seq:{uuid.uuid4().hex}:1"
    assert records.claim(what, "first") is None
    assert records.claim(what, "second") == "first" and records.get_claim(what) == "first"


def test_a_claim_writes_what_it_is_given_first_in_the_same_step(store: KeyValueStore):
    """A future's record is written with the claim on its seq_id (Futures.record_claimed): whoever wins, a claim
    never names a record that was not written."""
    records, run, what = Records(store), uuid.uuid4().hex, f"seq:{uuid.uuid4().hex}:1"
    record = {"tenant": "t1", "kind": "ForwardBackward", "job": {"type": "ordered"}}
    after = [*top_raised(run, 7), Records.written("future", "r1", record, ttl_s=60)]
    assert records.claim(what, "ForwardBackward|r1", after=after) is None
    assert records.get("future", "r1", "t1") == record and records.get("future", "r1", "t2") is None
    assert records.top(run) == 7
    assert records.claim(what, "ForwardBackward|r2", after=[Records.written("future", "r2", record)]) \
        == "ForwardBackward|r1"
    got, other = records.get_with("future", "r2", "t1", keys.gateway_claim(what))
    assert got == record and other == b"ForwardBackward|r1"  # (the loser discards its record: Futures.discard)
