"""The typed recovery records (tinkerq/records.py): what a worker writes, every reader reads back the same; an
absent or damaged record reads as none."""

from __future__ import annotations

from tinkerq.records import JournalEntry, SessionHome, SnapshotRecord


def test_records_round_trip_and_refuse_what_they_cannot_read():
    home = SessionHome("a" * 32, "base", "w1", {"rank": 8, "seed": 3})
    assert SessionHome.loads(home.dumps()) == home
    moved = home.moved_to("w2")
    assert (moved.worker, moved.adopted_from, moved.lora) == ("w2", "w1", home.lora)
    assert SessionHome.loads(moved.dumps()) == moved
    for bad in (None, b"", b"not json", b"[1, 2]", b'{"model_id": 3, "worker": "w", "base_model": "b"}'):
        assert SessionHome.loads(bad) is None

    record = SnapshotRecord("/ckpt/x/state/.auto", 12, 1.5e9, "w1")
    assert SnapshotRecord.loads(record.dumps()) == record
    assert SnapshotRecord.loads(b'{"seq_id": 3}') is None and SnapshotRecord.loads(None) is None

    entry = JournalEntry(7, "forward_backward", b"\x01\x02", ("ok", b"body", {"compute_s": 0.1}))
    assert JournalEntry.loads(entry.dumps()) == entry
    error = JournalEntry(8, "optim_step", None, ("error", {"type": "NonFiniteError"}, {}))
    assert JournalEntry.loads(error.dumps()) == error
