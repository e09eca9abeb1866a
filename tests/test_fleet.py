"""The fleet as operators run it: `tinkerq fleet up/status/down`, two models on one Redis, warm shutdown."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch

from tests.helpers import build_tiny_llama, make_batch
from tinkerq import types
from tinkerq.launcher.processes import (
    ROOT,
    alive,
    flower_up,
    free_port,
    gateway_up,
    port_problem,
    start_redis,
    stop,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)


def _tinkerq(*args: str, env: dict[str, str], timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinkerq.launcher.main", *args], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


def assert_on_no_command_line(secret: str, pids: list[int]) -> None:
    """``secret`` is on no process's command line, where every local user reads it (`ps`); ``pids`` are running
    (so their command lines were among those read)."""
    for pid in pids:
        assert alive(pid) and Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # processes that ended meanwhile
            assert secret.encode() not in cmdline.read_bytes(), f"{cmdline}: {cmdline.read_bytes()!r}"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    assert secret not in ps.stdout and str(pids[0]) in subprocess.run(
        ["ps", "-eo", "pid"], capture_output=True, text=True, check=True).stdout


def assert_fleet_files_private(folder: Path, secret: str) -> None:
    """The fleet's folder, its logs and its state (which holds ``secret``) are the owner's alone; no log holds it."""
    for path in (folder, folder / "logs"):
        assert path.stat().st_mode & 0o777 == 0o700, path
    assert (folder / "state.json").stat().st_mode & 0o777 == 0o600
    logs = list((folder / "logs").iterdir())
    assert logs
    for log in logs:
        assert log.stat().st_mode & 0o777 == 0o600, log
        assert secret not in log.read_text(errors="replace"), log


def hold_port(port: int) -> socket.socket | None:
    """Listen on 127.0.0.1:``port`` so a server cannot; None if something already does."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


def test_fleet_up_status_down_with_two_models(tmp_path, model_dir, monkeypatch, capsys):
    from tinkerq.errors import UnknownModelError
    from tinkerq.launcher.fleet import DEFAULT_FLOWER_PORT, DEFAULT_REDIS_PORT, cpu_cores
    from tinkerq.launcher.main import main as tinkerq_in_process
    from tinkerq.producer import ServiceClient

    other = build_tiny_llama(tmp_path / "other-model", seed=1)
    env = {"TINKERQ_HOME": str(tmp_path / "home"), "TINKERQ_HEARTBEAT_S": "1"}
    gateway_port = free_port()
    # The default ports are taken (by these sockets, or by whatever listens there already): `up` picks free ones.
    held = [hold_port(DEFAULT_REDIS_PORT), hold_port(DEFAULT_FLOWER_PORT)]
    try:
        up = _tinkerq("fleet", "up", "--fleet", "t", "--model", str(model_dir), "--model", str(other),
                      "--served-name", "org/Other-1B", "--samplers", "1", "--gateway-port", str(gateway_port), env=env)
    finally:
        for sock in held:
            if sock is not None:
                sock.close()
    assert up.returncode == 0, up.stderr[-3000:]
    broker = up.stdout.split("TINKERQ_BROKER_URL='")[1].split("'")[0]
    password = broker.split(":")[2].split("@")[0]
    assert "fleet 't' is up: 2 workers and 2 samplers for 2 models;" in up.stdout
    assert f"port {DEFAULT_REDIS_PORT} is taken: redis-server listens on " in up.stdout
    assert f"port {DEFAULT_FLOWER_PORT} is taken: Flower listens on " in up.stdout
    assert "Flower: http://127.0.0.1:" in up.stdout
    assert f"Flower: http://127.0.0.1:{DEFAULT_FLOWER_PORT}/" not in up.stdout
    assert f"TINKER_BASE_URL=http://127.0.0.1:{gateway_port}" in up.stdout
    assert f"console for tenants: http://127.0.0.1:{gateway_port}/console" in up.stdout
    assert "tinkerq fleet status --fleet t | tinkerq fleet down --fleet t" in up.stdout
    assert f"{other} is served as 'org/Other-1B'" in up.stdout
    # No --threads: the cores are split between the four torch processes (each would otherwise take them all).
    threads = max(1, cpu_cores() // 4)
    assert f"torch threads per worker process: {threads} ({cpu_cores()} cores shared by 4 processes;" in up.stdout
    folder = tmp_path / "home" / "fleet" / "t"
    state = json.loads((folder / "state.json").read_text())
    assert [w["threads"] for w in state["workers"]] == [threads] * 4
    try:
        # "up" means serving: Flower and the gateway answer HTTP as soon as `up` has returned.
        assert flower_up(state["flower"]["port"]) and gateway_up(f"http://127.0.0.1:{gateway_port}")
        assert 'id="sign-in"' in requests.get(f"http://127.0.0.1:{gateway_port}/console", timeout=10).text
        status = _tinkerq("fleet", "status", "--fleet", "t", env=env)
        assert status.returncode == 0, status.stderr
        assert status.stdout.count("running") == 7  # redis, two workers, two sampling workers, flower, gateway
        assert status.stdout.count(f"running  {threads} thread") == 4

        # The Redis password is on no command line (`ps` shows them to every local user): Redis reads it from an
        # owner-only file, the workers, Flower and the gateway from their environment.
        pids = [state["redis"]["pid"], state["flower"]["pid"], state["gateways"][0]["pid"],
                *(w["pid"] for w in state["workers"])]
        assert_on_no_command_line(password, pids)
        assert_fleet_files_private(folder, password)
        assert (folder / "redis" / "redis-auth.conf").stat().st_mode & 0o777 == 0o600

        # The gateway serves the official SDK with a key made by the operator's command.
        key = _tinkerq("keys", "create", "fleet-user", "--broker", broker, env=env).stdout.strip().splitlines()[-1]
        import tinker

        rest = tinker.RestClient(base_url=f"http://127.0.0.1:{gateway_port}", api_key=key)
        names = [m.model_name for m in rest.get_server_capabilities().result().supported_models]
        assert names == sorted([str(model_dir), "org/Other-1B"])
        assert status.stdout.count("sampler ") == 2
        assert status.stdout.count(f"{other} as 'org/Other-1B'") == 2  # its worker and its sampler
        # Registered under its served name, with the dtype the worker resolved (auto: float32 on the CPU).
        assert "  org/Other-1B  float32  loss head" in status.stdout
        assert "4 registered worker(s)" in status.stdout and "idle" in status.stdout
        assert "0 training session(s):" in status.stdout  # listed from Redis (tests/test_observability.py)
        assert ":" + broker.split(":")[2].split("@")[0] not in status.stdout  # the password is not shown

        # Two models share one Redis without interfering: each session lands on its own model's worker.
        with ServiceClient(broker_url=broker) as sc:
            served = [m.model_name for m in sc.get_server_capabilities().supported_models]
            assert served == sorted([str(model_dir), "org/Other-1B"])
            a, b = sc.create_training_client(str(model_dir)), sc.create_training_client("org/Other-1B")
            assert a.info.worker != b.info.worker
            data = make_batch(np.random.default_rng(40), 2)
            la = a.forward(data).result(timeout=60).metrics["loss:sum"]
            lb = b.forward(data).result(timeout=60).metrics["loss:sum"]
            assert la != lb  # different weights answered
            with pytest.raises(UnknownModelError):
                sc.create_training_client(str(tmp_path / "nobody-serves-this"))
            # Sampling spreads over a model's trainer and its sampling worker; both give the same samples.
            sampler = sc.create_sampling_client(base_model=str(model_dir))
            params = types.SamplingParams(max_tokens=8, seed=5)
            prompt = types.ModelInput.from_ints([1, 5, 6, 7])
            outs = [sampler.sample(prompt, 2, params).result(timeout=60) for _ in range(4)]
            assert all([s.tokens for s in o.sequences] == [s.tokens for s in outs[0].sequences] for o in outs)
            (sampler_log,) = [w["log"] for w in state["workers"]
                              if w.get("role") == "sampler" and w["model"] == str(model_dir)]
            assert "sample ok in" in Path(sampler_log).read_text()
            b.close()

            # A running task shows in `fleet status` as Flower shows it (its argsrepr), not as its raw request.
            monkeypatch.setenv("TINKERQ_HOME", env["TINKERQ_HOME"])
            rng = np.random.default_rng(45)
            queued = [a.forward_backward(make_batch(rng, 300, min_len=100, max_len=150)) for _ in range(8)]

            seen: list[str] = []

            def shows_the_running_task() -> bool:
                assert tinkerq_in_process(["fleet", "status", "--fleet", "t"]) == 0
                out = capsys.readouterr().out
                if "-> forward_backward(" in out:
                    seen.append(out)
                return bool(seen)

            wait_for(shows_the_running_task, 120, "a running forward_backward in fleet status")
            doing = seen[0].split("-> forward_backward(")[1].split(")\n")[0]
            assert f"model_id={a.model_id[:8]} seq=" in doing, seen[0]
            assert "loss_fn=cross_entropy datums=300 tokens=" in doing, seen[0]
            assert "sent_at" not in seen[0] and "blob" not in seen[0], seen[0]
            for future in queued:
                future.result(timeout=120)
            a.close()
    finally:
        down = _tinkerq("fleet", "down", "--fleet", "t", env=env)
    assert down.returncode == 0, down.stderr
    assert "8 process(es) stopped" in down.stdout or "7 process(es) stopped" in down.stdout
    again = _tinkerq("fleet", "status", "--fleet", "t", env=env)
    assert again.returncode == 2 and "no fleet named 't'" in again.stderr


def test_fleet_up_with_a_sharded_worker(tmp_path):
    """Two shards of a model with tied embeddings (stored once): saved weights and states round-trip. Its layers are
    checkpointed (``--activation-checkpointing on`` reaches both ranks): the step it trains is still the reference's."""
    from tests.helpers import load_reference, reference_logprobs
    from tinkerq import types
    from tinkerq.producer import ServiceClient

    model_dir = build_tiny_llama(tmp_path / "tied-model", seed=3, tied=True)
    env = {"TINKERQ_HOME": str(tmp_path / "home"), "TINKERQ_HEARTBEAT_S": "1"}
    # The operator's own Redis, with a password, given in the environment: it must reach no command line.
    password, port = secrets.token_urlsafe(16), free_port()
    redis_proc = start_redis(port, tmp_path / "redis", password=password)
    broker = f"redis://:{password}@127.0.0.1:{port}/0"
    pids: list[int] = []
    try:
        up = _tinkerq("fleet", "up", "--fleet", "s", "--model", str(model_dir), "--shards", "2", "--broker-from-env",
                      "--flower-port", "0", "--threads", "1", "--activation-checkpointing", "on",
                      env={**env, "TINKERQ_BROKER_URL": broker})
        assert up.returncode == 0, up.stderr[-3000:]
        pids = [w["pid"] for w in json.loads((tmp_path / "home" / "fleet" / "s" / "state.json").read_text())["workers"]]
        assert "fleet 's' is up: 1 worker (2 shard processes) for 1 model;" in up.stdout  # a worker, not 2
        assert "torch threads per worker process: 1 (--threads)" in up.stdout
        status = _tinkerq("fleet", "status", "--fleet", "s", env=env)
        assert status.stdout.count("running") == 2, status.stdout  # the two shards (Redis is not the fleet's)
        assert "(shard 0 of 2)" in status.stdout and "(shard 1 of 2)" in status.stdout
        assert "1 registered worker(s)" in status.stdout and "2 shards" in status.stdout  # one worker, 2 processes
        assert_on_no_command_line(password, pids)
        assert_fleet_files_private(tmp_path / "home" / "fleet" / "s", password)
        # A second `up` under the same name says how to reach the first: its name is in every hint.
        again = _tinkerq("fleet", "up", "--fleet", "s", "--model", str(model_dir), env=env)
        assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
        assert "`tinkerq fleet status --fleet s`" in again.stderr and "`tinkerq fleet down --fleet s`" in again.stderr
        with ServiceClient(broker_url=broker) as sc:
            tc = sc.create_training_client(str(model_dir))
            assert tc.info.extra["shards"] == 2
            data = make_batch(np.random.default_rng(42), 3)
            tc.forward_backward(data)
            tc.optim_step(types.AdamParams(learning_rate=1e-2))
            out = tc.forward(data).result(timeout=60)
            saved = load_reference(tc.save_weights_for_sampler("tied").result(timeout=60).path)
            assert saved.config.tie_word_embeddings
            with torch.no_grad():
                for d, o in zip(data, out.loss_fn_outputs, strict=True):
                    np.testing.assert_allclose(o["logprobs"].to_numpy(), reference_logprobs(saved, d).numpy(),
                                               atol=1e-5)
            state = tc.save_state("tied").result(timeout=60).path
            tc.close()
            resumed = sc.create_training_client_from_state(state)
            again = resumed.forward(data).result(timeout=60)
            for a, b in zip(out.loss_fn_outputs, again.loss_fn_outputs, strict=True):
                np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6)
            resumed.close()
    finally:
        down = _tinkerq("fleet", "down", "--fleet", "s", env=env)
        stop(redis_proc.pid, timeout=10)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(alive(pid) for pid in pids)  # rank 1 stopped with rank 0 (or by down itself)
    logs = sorted((tmp_path / "home" / "fleet" / "s" / "logs").glob("worker-*-rank1.log"))
    assert logs and "rank 0 stopped; rank 1 stops too" in logs[0].read_text()
    rank0 = sorted((tmp_path / "home" / "fleet" / "s" / "logs").glob("worker-*-rank0.log"))
    assert rank0 and "decoder layers checkpointed" in rank0[0].read_text()


def test_fleet_up_with_two_gateways_behind_the_proxy(tmp_path, model_dir):
    """--gateways 2: two gateways on private ports, `tinkerq proxy` on --gateway-port passing connections to each in
    turn; one gateway killed, clients still get answers through the other. No workers: the gateways alone."""
    env = {"TINKERQ_HOME": str(tmp_path / "home")}
    port = free_port()
    up = _tinkerq("fleet", "up", "--fleet", "g", "--model", str(model_dir), "--workers", "0", "--no-flower",
                  "--gateways", "2", "--gateway-port", str(port), "--redis-port", str(free_port()), env=env)
    folder = tmp_path / "home" / "fleet" / "g"
    pids: list[int] = []
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert f"TINKER_BASE_URL=http://127.0.0.1:{port}  (2 gateways behind a round-robin tinkerq proxy;" in up.stdout
        state = json.loads((folder / "state.json").read_text())
        gateways, front = state["gateways"], state["proxy"]
        assert len(gateways) == 2 and front["port"] == port and port not in [g["port"] for g in gateways]
        pids = [front["pid"], *(g["pid"] for g in gateways), state["redis"]["pid"]]
        status = _tinkerq("fleet", "status", "--fleet", "g", env=env)
        assert status.returncode == 0, status.stderr
        for g in gateways:
            assert f"running  http://127.0.0.1:{g['port']}/" in status.stdout
        assert f"running  http://127.0.0.1:{port}/  (round robin over 2 gateways)" in status.stdout
        assert status.stdout.count("  gateway ") == 2 and status.stdout.count("  proxy ") == 1

        # Each request on its own connection: the proxy's log shows both gateways used.
        proxy_log = Path(front["log"])
        for _ in range(4):
            assert gateway_up(f"http://127.0.0.1:{port}")
        log = proxy_log.read_text()
        for g in gateways:
            assert f"-> backend 127.0.0.1:{g['port']}" in log, log

        # A gateway gone (killed: as while it restarts): every request still answered, by the other one.
        os.kill(gateways[0]["pid"], signal.SIGKILL)
        wait_for(lambda: port_problem(gateways[0]["port"]) is None, 10, "the killed gateway's port to close")
        assert all(gateway_up(f"http://127.0.0.1:{port}") for _ in range(4))
        assert f"backend 127.0.0.1:{gateways[0]['port']} refused the connection: skipped" in proxy_log.read_text()
    finally:
        down = _tinkerq("fleet", "down", "--fleet", "g", env=env)
    assert down.returncode == 0 and "process(es) stopped" in down.stdout, down.stdout + down.stderr
    assert pids and not any(alive(pid) for pid in pids) and port_problem(port) is None


def test_warm_shutdown_finishes_the_running_task(tmp_path, model_dir, redis_url):
    """SIGTERM while a forward_backward runs: the task completes, its answer arrives, the worker exits 0."""
    from tinkerq.connection import Connection
    from tinkerq.launcher.processes import start_process, worker_command
    from tinkerq.producer import ServiceClient
    from tinkerq.settings import Settings

    log = tmp_path / "worker.log"
    # A private worker, serving the model under its own name so the shared test worker cannot take the task.
    proc = start_process(worker_command(str(model_dir), redis_url, threads=1,
                                        extra=["--name", "warm-shutdown-model"]), log,
                         {"TINKERQ_HEARTBEAT_S": "1", "TINKERQ_MICROBATCH_TOKENS": "64"})
    conn = Connection.open(Settings(broker_url=redis_url))
    try:
        wait_for(lambda: bool(conn.workers_serving("warm-shutdown-model")), 90, "worker", proc, log)
        with ServiceClient(broker_url=redis_url) as sc:
            tc = sc.create_training_client("warm-shutdown-model")
            # ~10 s of work (3 s per 1000 datums on a 2-core machine): outlasts the 3.5 s wait below with room.
            big = make_batch(np.random.default_rng(41), 3000, min_len=100, max_len=150)
            fb = tc.forward_backward(big)
            wait_for(lambda: "forward_backward" in log.read_text() and "received" in log.read_text(), 30, "task start")
            # The container healthcheck answers while the long task runs (the heartbeat is its own thread).
            time.sleep(3.5)  # longer than the registration TTL (3 s): it must have been refreshed meanwhile
            health = _tinkerq("healthcheck", "--broker", redis_url, env={}, timeout=30)
            assert health.returncode == 0 and "warm-shutdown-model" in health.stdout, health.stderr
            assert fb.done() is False  # still running: the check above happened during the task
            os.kill(proc.pid, signal.SIGTERM)
            out = fb.result(timeout=120)
            assert len(out.loss_fn_outputs) == len(big) and np.isfinite(out.metrics["loss:sum"])
            assert proc.wait(timeout=60) == 0
            assert not alive(proc.pid)
            # Its registration is withdrawn: new sessions for that model now fail fast.
            wait_for(lambda: not conn.workers_serving("warm-shutdown-model"), 10, "deregistration")
            from tinkerq.errors import UnknownModelError

            with pytest.raises(UnknownModelError):
                sc.create_training_client("warm-shutdown-model")
    finally:  # a failed assertion must not leave the private worker running
        stop(proc.pid, timeout=10)
        conn.close()


def test_a_killed_worker_fails_waiting_futures_instead_of_hanging(tmp_path, model_dir, redis_url):
    """SIGKILL (no warm shutdown): its registration expires, and the producer stops waiting with a clear error."""
    from tinkerq.connection import Connection
    from tinkerq.errors import WorkerLostError
    from tinkerq.launcher.processes import start_process, worker_command
    from tinkerq.producer import ServiceClient
    from tinkerq.settings import Settings

    log = tmp_path / "worker.log"
    proc = start_process(worker_command(str(model_dir), redis_url, threads=1, extra=["--name", "killed-model"]),
                         log, {"TINKERQ_HEARTBEAT_S": "1"})
    conn = Connection.open(Settings(broker_url=redis_url))
    try:
        wait_for(lambda: bool(conn.workers_serving("killed-model")), 90, "worker", proc, log)
        with ServiceClient(settings=Settings(broker_url=redis_url, heartbeat_s=1.0)) as sc:
            tc = sc.create_training_client("killed-model")
            tc.forward(make_batch(np.random.default_rng(43), 2)).result(timeout=60)
            os.kill(proc.pid, signal.SIGKILL)
            # The dead worker cannot answer: the producer sees its heartbeat stop (and, the session being
            # adoptable, waits TINKERQ_ADOPT_TIMEOUT_S for another worker first). The timeout is a hang guard only.
            err = tc.forward(make_batch(np.random.default_rng(44), 2)).exception(timeout=120)
            assert isinstance(err, WorkerLostError) and "stopped" in err.message, err
    finally:
        stop(proc.pid, timeout=10)
        conn.close()
