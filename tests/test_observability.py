"""Observability of adoptable sessions: per-session Prometheus gauges, the `inspect stats` block Flower shows,
and the sessions `tinkerq fleet status` lists (docs/reliability.md)."""

from __future__ import annotations

import time
import urllib.request
import uuid

import numpy as np
import pytest

from tests.conftest import start_named_worker
from tests.helpers import make_batch
from tests.test_adoption import EVERY as ADOPTION_EVERY
from tests.test_adoption import Fleet
from tinkerq import keys, types
from tinkerq.connection import Connection
from tinkerq.launcher.fleet import session_lines
from tinkerq.launcher.processes import free_port, wait_for
from tinkerq.producer import ServiceClient
from tinkerq.records import SessionHome, SnapshotRecord
from tinkerq.settings import Settings
from tinkerq.store import MemoryStore

pytestmark = pytest.mark.timeout(300)
ADAM = types.AdamParams(learning_rate=1e-2)
EVERY = 2  # TINKERQ_AUTO_SNAPSHOT_STEPS in this worker


def _samples(url: str, name: str) -> dict[str, float]:
    """model_id -> value of the per-session gauge ``name``."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('model_id="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def _journal_gauge(url: str, model_id: str, want: float) -> dict[str, float]:
    """The per-session journal gauge once it counts ``want`` entries for ``model_id`` (or what it says after 10 s).
    The worker counts an entry once its write returns, a moment after the answer written with it can reach the
    client: so a gauge read right after a reply may still be one behind."""
    deadline = time.monotonic() + 10
    while (got := _samples(url, "tinkerq_session_journal_entries")) != {model_id: want} and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def _tinkerq_stats(conn: Connection, worker_pid: int) -> dict:
    stats = conn.app.control.inspect(timeout=5.0).stats() or {}
    blocks = [s["tinkerq"] for s in stats.values() if s.get("pid") == worker_pid and "tinkerq" in s]
    assert blocks, stats
    return blocks[0]


def test_fleet_status_says_which_sessions_are_parked():
    """A session released idle is in no worker's memory: `tinkerq fleet status` says where it is parked, since when
    and after how long idle; a live one is shown as before."""
    store = MemoryStore()
    live = SessionHome("a" * 32, "base", "w1")
    parked = SessionHome("b" * 32, "base", "w2").parked_by(1000.0, 42.0, 7)
    for home in (live, parked):
        store.set(keys.session_home(home.model_id), home.dumps(), 60.0)
    store.set(keys.auto_snapshot(parked.model_id), SnapshotRecord("/x", 7, 1000.0, "w2").dumps(), 60.0)
    lines = dict((line[:12], line) for line in session_lines(store, now=1030.0))
    assert lines["a" * 12] == f"{'a' * 12}  on w1  no snapshot yet  journal 0"
    assert lines["b" * 12] == (f"{'b' * 12}  parked on w2 30 s ago (released after 42 s idle; back on its next "
                               f"request)  snapshot 30 s ago  journal 0")


def test_per_session_gauges_inspect_stats_and_fleet_status(model_dir, redis_url, tmp_path):
    name = f"observe-{uuid.uuid4().hex[:8]}"
    port = free_port()
    proc = start_named_worker(model_dir, redis_url, name, tmp_path / "worker.log", env={
        "TINKERQ_CHECKPOINT_DIR": str(tmp_path / "checkpoints"), "TINKERQ_AUTO_SNAPSHOT_STEPS": str(EVERY)},
        extra=["--metrics-port", str(port)])
    url = f"http://127.0.0.1:{port}/metrics"
    sc = ServiceClient(broker_url=redis_url)
    conn = Connection.open(Settings(broker_url=redis_url))
    try:
        tc = sc.create_training_client(name).result(timeout=120)
        model_id = tc.model_id
        batch = make_batch(np.random.default_rng(3), 2, max_len=16)
        tc.forward_backward(batch, "cross_entropy").result(timeout=120)
        # No automatic snapshot yet: a journal gauge, no snapshot-age sample.
        assert _journal_gauge(url, model_id, 1.0) == {model_id: 1.0}
        assert model_id not in _samples(url, "tinkerq_session_snapshot_age_seconds")
        assert _tinkerq_stats(conn, proc.pid)["sessions"][0]["snapshot_age_s"] is None
        assert any("no snapshot yet" in line for line in session_lines(conn.store) if line.startswith(model_id[:12]))

        tc.optim_step(ADAM).result(timeout=120)  # step 1
        tc.forward_backward(batch, "cross_entropy").result(timeout=120)
        asked = time.time()
        tc.optim_step(ADAM).result(timeout=120)  # step 2: the snapshot; the journal is cut to that request
        for _ in range(2):
            tc.forward_backward(batch, "cross_entropy").result(timeout=120)
        # The snapshot's own request + the two applied since.
        want = 1 + 2
        assert conn.store.length(keys.journal(model_id)) == want
        assert _journal_gauge(url, model_id, want) == {model_id: want}
        first = _samples(url, "tinkerq_session_snapshot_age_seconds")[model_id]
        # The age of the snapshot step 2 took: no older than that request (causality, not a speed bound) ...
        assert 0 <= first <= time.time() - asked + 1e-3
        time.sleep(1.2)
        later = _samples(url, "tinkerq_session_snapshot_age_seconds")[model_id]
        assert later >= first + 1.0  # ... and counted in seconds (what the sleep guarantees)
        assert "tinkerq_adoptions_total 0.0" in urllib.request.urlopen(url, timeout=10).read().decode()

        block = _tinkerq_stats(conn, proc.pid)  # what Flower's worker page shows under Stats
        assert block["adoptions"] == 0
        (session,) = [s for s in block["sessions"] if s["model_id"] == model_id]
        assert session["journal_entries"] == want and session["adopted"] is False
        assert 0 <= session["snapshot_age_s"] <= time.time() - asked + 1e-3

        (line,) = [line for line in session_lines(conn.store) if line.startswith(model_id[:12])]
        assert f"journal {want}" in line and "snapshot" in line and "s ago" in line and "adopted" not in line
        tc.close()
        wait_for(lambda: model_id not in _samples(url, "tinkerq_session_journal_entries"), 30, "the closed session")
    finally:
        conn.close()
        sc.close()
        proc.terminate()
        proc.wait(30)


def test_an_adopted_session_is_shown_as_adopted(model_dir, redis_url, tmp_path):
    """After its worker is SIGKILLed, the adopter counts the adoption and shows the session as adopted, with the
    age of the snapshot it was re-made from; `fleet status` names the lost worker."""
    fleet = Fleet(model_dir, redis_url, tmp_path)
    ports = []
    sc = ServiceClient(broker_url=redis_url)
    conn = Connection.open(Settings(broker_url=redis_url))
    try:
        for _ in range(2):  # one at a time: free_port() may give the same port twice while it is unused
            ports.append(free_port())
            fleet.start(extra=["--metrics-port", str(ports[-1])])
        tc = sc.create_training_client(fleet.name).result(timeout=120)
        batch = make_batch(np.random.default_rng(4), 2, max_len=16)
        asked = time.time()
        for _ in range(ADOPTION_EVERY):  # the last optim_step takes the snapshot; its own entry stays journaled
            tc.forward_backward(batch, "cross_entropy").result(timeout=120)
            tc.optim_step(ADAM).result(timeout=120)
        tc.forward_backward(batch, "cross_entropy").result(timeout=120)
        lost = fleet.holder(tc.model_id)
        fleet.kill(lost)
        adopter = fleet.wait_adopted(tc.model_id, lost)
        index = next(i for i, p in enumerate(fleet.procs) if p.pid == int(adopter.rsplit("-", 2)[1]))
        url = f"http://127.0.0.1:{ports[index]}/metrics"
        assert "tinkerq_adoptions_total 1.0" in urllib.request.urlopen(url, timeout=10).read().decode()
        assert _samples(url, "tinkerq_session_journal_entries") == {tc.model_id: 2.0}
        # The snapshot it was re-made from: no older than the requests that made it (causality, not speed).
        assert 0 <= _samples(url, "tinkerq_session_snapshot_age_seconds")[tc.model_id] <= time.time() - asked + 1e-3

        block = _tinkerq_stats(conn, fleet.procs[index].pid)
        assert block["adoptions"] == 1 and block["worker"] == adopter
        (session,) = block["sessions"]
        assert session["model_id"] == tc.model_id and session["adopted"] is True
        assert session["journal_entries"] == 2 and session["snapshot_age_s"] is not None

        (line,) = [line for line in session_lines(conn.store) if line.startswith(tc.model_id[:12])]
        assert f"on {adopter}" in line and f"adopted from {lost}" in line and "journal 2" in line
        tc.close()
    finally:
        conn.close()
        sc.close()
        fleet.stop()
