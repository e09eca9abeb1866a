"""The store's generic primitives give the same answers on Redis and in memory (each test runs on both: the
``store`` fixture), and a transaction sees no other writer's change between its reads and its writes."""

from __future__ import annotations

import math
import threading
import time
import uuid

from tinkerq.store import (
    Delete,
    Expire,
    HashDelete,
    HashIncr,
    HashPut,
    KeyValueStore,
    Publish,
    Push,
    Put,
    Reply,
    Transaction,
    ZAdd,
    ZRemove,
    ZRemoveBelow,
)


def _key(what: str) -> str:
    return f"test:store:{what}:{uuid.uuid4().hex[:8]}"


def test_write_many_applies_every_kind_of_write_in_order(store: KeyValueStore):
    s, lst, h, z, inbox, reply = (_key(w) for w in ("s", "l", "h", "z", "inbox", "reply"))
    store.write_many([
        Put(s, b"one"), Put(s, b"two", ttl_s=60),  # the later write wins
        Push(lst, b"a"), Push(lst, b"b"), Push(lst, b"c", max_len=2),
        HashPut(h, {"x": "1", "y": b"2"}), HashIncr(h, "x", 4), HashDelete(h, ["y"]),
        ZAdd(z, "m", 5.0), ZAdd(z, "m", 3.0, only_greater=True), ZAdd(z, "n", 1.0), ZAdd(z, "o", 9.0),
        ZRemove(z, ["o"]), ZRemoveBelow(z, 2.0),
        Reply(reply, b"answer", inbox, b"item", ttl_s=60),
    ])
    assert store.get(s) == b"two"
    assert store.pop(lst, 1) == b"b" and store.pop(lst, 1) == b"c" and store.pop(lst, 0.05) is None  # FIFO, trimmed
    assert store.hash_items(h) == {"x": b"5"}
    assert store.zset_range(z, -math.inf, math.inf) == [("m", 5.0)]  # not lowered, n dropped below 2, o removed
    assert store.zset_score(z, "m") == 5.0 and store.zset_score(z, "n") is None
    assert store.get(reply) == b"answer" and store.pop(inbox, 1) == b"item"
    store.write_many([Delete(s), Delete(h), Expire(reply, 0.05)])
    time.sleep(0.1)
    assert store.get_many([s, reply]) == [None, None] and store.hash_items(h) == {}
    assert store.exists_many([s, z]) == [False, True]


def test_hash_reads(store: KeyValueStore):
    a, b = _key("a"), _key("b")
    store.write_many([HashPut(a, {"f": "1", "g": "2"}), HashPut(b, {"g": "3"})])
    assert store.hash_fields([a, b], ["f", "g"]) == [[b"1", b"2"], [None, b"3"]]
    assert store.hash_items_many([a, b, _key("none")]) == [{"f": b"1", "g": b"2"}, {"g": b"3"}, {}]


def test_a_transaction_reads_then_writes_and_sees_no_write_of_its_own(store: KeyValueStore):
    key, h = _key("k"), _key("h")
    store.set(key, b"1", None)

    def bump(t: Transaction) -> tuple[bytes | None, bytes | None]:
        before = t.get(key)
        t.write(Put(key, str(int(before or b"0") + 1).encode()), HashPut(h, {"n": "1"}))
        return before, t.get(key)  # writes apply at the end

    assert store.transaction(bump, [key], what="bumping") == (b"1", b"1")
    assert store.get(key) == b"2"
    seen = store.transaction(lambda t: (t.exists(h), t.hash_get(h, ["n", "m"]), t.hash_size(h), t.zset_size(h + "z"),
                                        t.get_many([key, h + "none"]), t.zset_range(h + "z", 0, 1)), what="reading")
    assert seen == (True, [b"1", None], 1, 0, [b"2", None], [])


def test_concurrent_transactions_never_lose_an_update(store: KeyValueStore):
    """Read, add one, write, from 8 threads at once: every increment lands (a write between a transaction's read
    and its commit makes it run again)."""
    key = _key("counter")

    def add_one(t: Transaction) -> None:
        t.write(Put(key, str(int(t.get(key) or b"0") + 1).encode()))

    def worker() -> None:
        for _ in range(25):
            store.transaction(add_one, [key], what="adding")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert store.get(key) == b"200"


def test_a_transaction_that_raises_writes_nothing(store: KeyValueStore):
    key = _key("k")

    def fail(t: Transaction) -> None:
        t.write(Put(key, b"x"))
        raise ValueError("refused")

    try:
        store.transaction(fail, [key], what="failing")
    except ValueError:
        pass
    else:
        raise AssertionError("the transaction's error was swallowed")
    assert store.get(key) is None


def test_heartbeats_are_aged_by_the_stores_clock(store: KeyValueStore):
    zset = _key("beats")
    store.beat(zset, "w1")
    time.sleep(0.2)
    store.beat(zset, "w2")
    ages = store.ages(zset)
    assert ages["w1"] >= 0.2 and 0 <= ages["w2"] < ages["w1"]
    store.forget(zset, "w1")
    assert list(store.ages(zset)) == ["w2"]


def test_published_messages_reach_subscribers(store: KeyValueStore):
    channel = _key("channel")
    subscription = store.subscribe(channel)
    try:
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:  # Redis: the subscription registers asynchronously
            store.publish(channel, "hello")
            got = subscription.get(0.2)
        assert got == b"hello"
    finally:
        subscription.close()


def test_a_publish_write_reaches_subscribers_after_the_writes_before_it(store: KeyValueStore):
    channel, key = _key("channel"), _key("announced")
    subscription = store.subscribe(channel)
    try:
        deadline = time.monotonic() + 10
        got, n = None, 0
        while got is None and time.monotonic() < deadline:  # Redis: the subscription registers asynchronously
            n += 1
            store.write_many([Put(key, str(n).encode(), ttl_s=60), Publish(channel, str(n).encode())])
            got = subscription.get(0.2)
        assert got is not None
        assert int(store.get(key) or b"0") >= int(got)  # the value it announces was written before it
    finally:
        subscription.close()


def test_claim_after_applies_its_writes_and_gives_the_key_to_the_first_claimant(store: KeyValueStore):
    claim, first, second = _key("claim"), _key("first"), _key("second")
    assert store.claim_after([Put(first, b"1", ttl_s=60)], claim, b"alice", 60) is None  # claimed here
    assert store.get(claim) == b"alice" and store.get(first) == b"1"
    # A later claimant learns who holds the key; its writes are applied all the same (the caller undoes them).
    assert store.claim_after([Put(second, b"2", ttl_s=60)], claim, b"bob", 60) == b"alice"
    assert store.get(claim) == b"alice" and store.get(second) == b"2"
    assert store.claim_after([], _key("bare"), b"carol", 60) is None  # no writes: a plain first-come claim
    expiring = _key("expiring")
    assert store.claim_after([], expiring, b"dave", 0.05) is None
    time.sleep(0.1)
    assert store.claim_after([], expiring, b"erin", 60) is None and store.get(expiring) == b"erin"  # freed


def test_concurrent_claims_have_one_winner_and_every_loser_names_it(store: KeyValueStore):
    claim = _key("contested")
    results: list[bytes | None] = []
    lock = threading.Lock()

    def claimant(i: int) -> None:
        got = store.claim_after([], claim, f"c{i}".encode(), 60)
        with lock:
            results.append(got)

    threads = [threading.Thread(target=claimant, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winner = store.get(claim)
    assert results.count(None) == 1 and all(r == winner for r in results if r is not None), (results, winner)
