"""Redis over TLS (rediss://) and through Sentinel (sentinel://): real redis-servers, real worker processes.

The TLS server speaks only TLS (no plain port), so a worker that answers there used TLS for Celery's
broker, its result backend and tinkerq's own keys alike. The Sentinel setup is a primary, a replica and
a sentinel; the worker and the producer know only the sentinel's address.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import start_worker_process
from tests.helpers import load_reference, make_batch, max_weight_diff, reference_loss, reference_step
from tests.redis_servers import SentinelSetup, TlsRedis, start_sentinel_setup, start_tls_redis
from tinkerq import types
from tinkerq.celery_app import make_celery
from tinkerq.connection import Connection
from tinkerq.errors import BrokerUnavailableError
from tinkerq.launcher.processes import wait_for
from tinkerq.redis_client import SentinelMasterConnection, celery_redis_options, parse_sentinel_url, redis_client
from tinkerq.settings import Settings, SettingsError
from tinkerq.worker.transport.intake import GuardedSentinelChannel

pytestmark = pytest.mark.timeout(180)

TLS_MODEL = "tls-model"
SENTINEL_MODEL = "sentinel-model"


# -- settings and configuration (no servers) -----------------------------------------------------------


def test_sentinel_urls_parse_like_kombu():
    address = parse_sentinel_url("sentinel://:s%40cret@10.0.0.1:26379/2;sentinel://10.0.0.2:26380/2;sentinel://h3")
    assert address.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26380), ("h3", 26379)]
    assert address.password == "s@cret" and address.username is None and address.db == 2
    with pytest.raises(SettingsError, match="sentinel://"):
        parse_sentinel_url("sentinel://10.0.0.1:26379;redis://10.0.0.2:6379")
    with pytest.raises(SettingsError) as info:
        Settings.from_env({}, broker_url="sentinel://:hunter2@10.0.0.1:26379/db")
    assert "not a number" in str(info.value) and "hunter2" not in str(info.value)
    assert Settings.from_env({"TINKERQ_SENTINEL_MASTER": "m1"}, broker_url="sentinel://h:1").sentinel_master == "m1"


def test_tls_settings_are_checked_before_connecting(tmp_path):
    missing = str(tmp_path / "no-such-ca.pem")
    with pytest.raises(SettingsError, match=r"TINKERQ_TLS_CA_FILE=.*no such file"):
        Settings.from_env({"TINKERQ_TLS_CA_FILE": missing}, broker_url="rediss://127.0.0.1:6379/0")
    # The same file is not needed for a plain URL; a client certificate needs its key.
    Settings.from_env({"TINKERQ_TLS_CA_FILE": missing}, broker_url="redis://127.0.0.1:6379/0")
    cert = tmp_path / "client.pem"
    cert.write_text("x")
    with pytest.raises(SettingsError, match="TINKERQ_TLS_KEY_FILE"):
        Settings.from_env({"TINKERQ_TLS_CERT_FILE": str(cert)}, broker_url="rediss://127.0.0.1:6379/0")
    with pytest.raises(SettingsError, match="not supported"):
        Settings.from_env({}, broker_url="amqp://127.0.0.1")


def test_celery_options_merge_into_the_apps_configuration(tmp_path):
    import ssl

    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    s = Settings(broker_url="sentinel://127.0.0.1:26379/0", tls_ca_file=str(ca), sentinel_master="main")
    assert set(celery_redis_options(s)) == {"broker_transport_options"}
    conf = make_celery(s).conf
    # kombu's SentinelChannel and Celery's backends read exactly these keys.
    assert conf.broker_transport_options["master_name"] == "main"
    assert conf.broker_transport_options["visibility_timeout"] == s.visibility_timeout_s  # merged, not replaced
    assert not conf.broker_use_ssl  # Celery default: False
    s = Settings(broker_url="rediss://127.0.0.1:6380/0", tls_ca_file=str(ca))
    conf = make_celery(s).conf
    assert conf.broker_use_ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(ca)}
    assert "master_name" not in conf.broker_transport_options
    assert celery_redis_options(Settings(broker_url="redis://127.0.0.1:6379/0")) == {}


# -- servers and workers ----------------------------------------------------------------------------------


def _start_worker(model_dir: Path, url: str, name: str, log: Path, checkpoint_dir: Path,
                  env: dict[str, str], settings: Settings) -> tuple[subprocess.Popen, Connection]:
    proc = start_worker_process(model_dir, url, log, extra=["--name", name], env={
        "TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir), "TINKERQ_HEARTBEAT_S": "1", **env})
    conn = Connection.open(settings)
    try:
        wait_for(lambda: bool(conn.workers_serving(name)), 90, f"tinkerq worker over {url}", proc, log)
    except Exception:
        _stop_worker(proc)
        conn.close()
        raise
    return proc, conn


def _stop_worker(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory) -> Iterator[TlsRedis]:
    server = start_tls_redis(tmp_path_factory.mktemp("tls-redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tls_settings(tls_redis) -> Settings:
    return Settings(broker_url=tls_redis.url, tls_ca_file=str(tls_redis.files.ca))


@pytest.fixture(scope="module")
def tls_worker(tls_redis, tls_settings, model_dir, checkpoint_dir, tmp_path_factory) -> Iterator[Path]:
    log = tmp_path_factory.mktemp("tls-logs") / "worker.log"
    # The worker gets its CA the way an operator would give it: TINKERQ_TLS_CA_FILE.
    proc, conn = _start_worker(model_dir, tls_redis.url, TLS_MODEL, log, checkpoint_dir,
                               {"TINKERQ_TLS_CA_FILE": str(tls_redis.files.ca)}, tls_settings)
    yield log
    _stop_worker(proc)
    conn.close()


@pytest.fixture(scope="module")
def sentinels(tmp_path_factory) -> Iterator[SentinelSetup]:
    setup = start_sentinel_setup(tmp_path_factory.mktemp("sentinel"))
    yield setup
    setup.stop()


@dataclass
class SentinelWorker:
    proc: subprocess.Popen
    log: Path


@pytest.fixture(scope="module")
def sentinel_worker(sentinels, model_dir, checkpoint_dir, tmp_path_factory) -> Iterator[SentinelWorker]:
    log = tmp_path_factory.mktemp("sentinel-logs") / "worker.log"
    proc, conn = _start_worker(model_dir, sentinels.url, SENTINEL_MODEL, log, checkpoint_dir, {},
                               Settings(broker_url=sentinels.url))
    yield SentinelWorker(proc, log)
    _stop_worker(proc)
    conn.close()


@contextlib.contextmanager
def _explained(sentinels: SentinelSetup, worker: SentinelWorker) -> Iterator[None]:
    """On failure, the report says what each Redis node holds, whose connections it has, and what the
    sentinel and the worker logged: enough to tell a split brain from a worker that stopped beating."""
    try:
        yield
    except BaseException as exc:
        py_spy = os.environ.get("PY_SPY") or shutil.which("py-spy")  # where the worker's threads are, if it hangs
        if py_spy and worker.proc.poll() is None:
            with contextlib.suppress(Exception):
                dump = subprocess.run([py_spy, "dump", "--pid", str(worker.proc.pid)], capture_output=True,
                                      text=True, timeout=30)
                exc.add_note("py-spy dump of the worker:\n" + dump.stdout + dump.stderr)
        with contextlib.suppress(Exception):
            state = sentinels.describe({os.getpid(): "the producer (pytest)", worker.proc.pid: "the worker"})
            exc.add_note(f"worker pid {worker.proc.pid} exit code {worker.proc.poll()}\n{state}")
        with contextlib.suppress(Exception):
            routine = ("received", "succeeded in", " ok in ")
            lines = [line[:400] for line in worker.log.read_text(errors="replace").splitlines()
                     if not any(r in line for r in routine)]
            exc.add_note("worker log (tail, routine lines left out):\n" + "\n".join(lines[-80:]))
        raise


# -- TLS ------------------------------------------------------------------------------------------------


def test_training_over_tls(tls_worker, tls_settings, model_dir):
    from tinkerq.producer import ServiceClient

    rng = np.random.default_rng(60)
    data = make_batch(rng, 4)
    adam = types.AdamParams(learning_rate=1e-2)
    with ServiceClient(settings=tls_settings) as sc:
        tc = sc.create_training_client(TLS_MODEL)
        fb = tc.forward_backward(data)
        opt = tc.optim_step(adam)
        after = tc.forward(data)
        loss0 = fb.result(timeout=60).metrics["loss:sum"]
        opt.result(timeout=60)
        loss1 = after.result(timeout=60).metrics["loss:sum"]
        tc.close()
    ref = load_reference(model_dir)
    with torch.no_grad():
        assert loss0 == pytest.approx(float(reference_loss(ref, data)), rel=1e-5)  # the same numbers as plain
    reference_step(ref, torch.optim.AdamW(ref.parameters()), [data], adam)
    with torch.no_grad():
        assert loss1 == pytest.approx(float(reference_loss(ref, data)), rel=1e-5)
    assert loss1 < loss0


@pytest.mark.timeout(60)  # a hang guard
def test_tls_port_refuses_plain_and_unverified_clients(tls_redis):
    # Plain TCP to the TLS port: the server drops the connection. rediss:// without our CA: the system's
    # CAs do not vouch for the self-signed certificate, so the client refuses the server.
    for settings in (Settings(broker_url=f"redis://127.0.0.1:{tls_redis.port}/0", connect_timeout_s=1),
                     Settings(broker_url=tls_redis.url, connect_timeout_s=1)):
        with pytest.raises(BrokerUnavailableError, match="cannot reach Redis"):
            Connection.open(settings)


# -- Sentinel -------------------------------------------------------------------------------------------


def _steps(tc, batches, adam) -> list:
    futures = []
    for batch in batches:  # pipelined: nothing waits until every request is posted
        futures += [tc.forward_backward(batch), tc.optim_step(adam)]
    return futures


def _reference_weights_diff(model_dir: Path, batches, adam, saved: str) -> float:
    ref = load_reference(model_dir)
    opt = torch.optim.AdamW(ref.parameters())
    for batch in batches:
        reference_step(ref, opt, [batch], adam)
    return max_weight_diff(ref, saved)


def test_a_connection_dropped_by_a_demoted_primary_reconnects_to_the_new_one(sentinels):
    """A demoted primary answers writes with READONLY, and redis-py drops the connection. It used to reconnect
    on its next command to the same node, without asking the sentinels: kombu's restore of unacknowledged
    messages (a WATCH transaction, retried on every WatchError) then spun forever in the worker's consumer
    after a failover, and the worker stopped consuming and beating. Runs before the worker starts: the old
    primary keeps its clients here."""
    key = "tinkerq:test:unacked"
    client = redis_client(Settings(broker_url=sentinels.url))
    attempts: list[int] = []

    def restore(pipe) -> None:  # kombu's QoS.restore_by_tag, in miniature
        attempts.append(1)
        if len(attempts) > 100:
            raise RuntimeError("the transaction keeps failing on the demoted primary")
        pipe.hget(key, "tag")
        pipe.multi()
        pipe.hdel(key, "tag")

    try:
        client.hset(key, "tag", "message")  # a pooled connection to the primary about to be demoted
        new = sentinels.failover(drop_clients=False)
        client.transaction(restore, key)
        # READONLY on the old primary, then done on the new one (without the fix: the old one forever).
        assert len(attempts) == 2
        assert {c.port for c in client.connection_pool._available_connections} == {new}
    finally:
        client.close()
    # The worker's kombu channel (consumer, acknowledgements, restores) connects the same way.
    assert GuardedSentinelChannel.connection_class is SentinelMasterConnection


def test_training_through_sentinel(sentinel_worker, sentinels, model_dir):
    with _explained(sentinels, sentinel_worker):
        _train_through(sentinels, model_dir)


def _train_through(sentinels: SentinelSetup, model_dir: Path) -> None:
    from tinkerq.producer import ServiceClient

    rng = np.random.default_rng(61)
    batches = [make_batch(rng, 2, max_len=20) for _ in range(3)]
    adam = types.AdamParams(learning_rate=5e-3)
    with ServiceClient(broker_url=sentinels.url) as sc:
        assert [m.model_name for m in sc.get_server_capabilities().supported_models] == [SENTINEL_MODEL]
        tc = sc.create_training_client(SENTINEL_MODEL)
        for future in _steps(tc, batches, adam):
            future.result(timeout=60)
        saved = tc.save_weights_for_sampler("through-sentinel").result(timeout=60).path
        tc.close()
    assert _reference_weights_diff(model_dir, batches, adam, saved) < 1e-5


def test_idle_worker_survives_the_demotion_of_its_primary(sentinel_worker, sentinels, model_dir):
    """An idle worker waits in BRPOP/BLMPOP on the primary. Demoting that node (REPLICAOF, as Sentinel does after
    a failover) answers the pop with ``UNBLOCKED ... (master -> replica?)``: that must cost the worker a
    reconnection through the sentinels, not its life (kombu let it escape as an unrecoverable error).

    Who turns the answer into a lost connection depends on redis-py: up to 7 the intake's own read does
    (and logs it); redis-py 8's sentinel connection raises ``ConnectionError`` itself, and Celery's consumer
    logs the lost connection. Either way the consumer must have reconnected, which the log shows."""
    with _explained(sentinels, sentinel_worker):
        sentinels.failover(when_blocked=True)
        assert sentinels.blocked_at_demotion >= 1, "nobody waited in BRPOP on the old primary: nothing was tested"
        _train_through(sentinels, model_dir)
        assert sentinel_worker.proc.poll() is None
        log = sentinel_worker.log.read_text(errors="replace")
        reconnected = r"answered the consumer's (BRPOP|BLMPOP) with UNBLOCKED|consumer: Connection to broker lost"
        assert re.search(reconnected, log), log[-2000:]


def _train_across(disruption: Callable[[], int], sentinels: SentinelSetup, model_dir: Path, seed: int) -> None:
    """Pipelined steps posted before, during and after ``disruption`` (which returns the new primary's port)
    all succeed, in order, exactly once: the final weights equal an uninterrupted run's."""
    from tinkerq.producer import ServiceClient

    rng = np.random.default_rng(seed)
    adam = types.AdamParams(learning_rate=5e-3)
    batches: list[list[types.Datum]] = []
    with ServiceClient(broker_url=sentinels.url) as sc:
        tc = sc.create_training_client(SENTINEL_MODEL)
        old = sentinels.primary_port()

        def post(n: int) -> list:
            new_batches = [make_batch(rng, 2, max_len=20) for _ in range(n)]
            batches.extend(new_batches)
            return _steps(tc, new_batches, adam)

        futures = post(3)
        # The disruption runs while the producer keeps posting (one step every 100 ms), so requests are in
        # flight, and being posted, when the primary changes.
        promoted: list[int] = []
        thread = threading.Thread(target=lambda: promoted.append(disruption()))
        thread.start()
        while thread.is_alive() and len(batches) < 40:
            futures += post(1)
            time.sleep(0.1)
        thread.join(30)
        assert promoted and promoted[0] != old, "sentinel did not promote the replica"
        futures += post(3)
        for future in futures:
            future.result(timeout=60)
        saved = tc.save_weights_for_sampler(f"across-failover-{seed}").result(timeout=60).path
        tc.close()
    assert _reference_weights_diff(model_dir, batches, adam, saved) < 1e-5


def test_failover_mid_run_loses_nothing(sentinel_worker, sentinels, model_dir):
    """SENTINEL FAILOVER: a handover, the old primary still runs (and is demoted to a replica)."""
    with _explained(sentinels, sentinel_worker):
        _train_across(sentinels.failover, sentinels, model_dir, seed=62)


def test_primary_killed_mid_run_loses_nothing(sentinel_worker, sentinels, model_dir):
    """SIGKILL of the primary: an outage of a few seconds (down-after 1 s, then the election) before the
    replica is promoted; requests posted meanwhile must wait for it, not fail."""
    with _explained(sentinels, sentinel_worker):
        _train_across(sentinels.kill_primary, sentinels, model_dir, seed=63)
