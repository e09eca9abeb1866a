"""`tinkerq fleet up` refusing: every failure is one line that says what to do, and leaves nothing running."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_fleet import _tinkerq, hold_port
from tinkerq.launcher.processes import free_port, port_problem

pytestmark = pytest.mark.timeout(240)


def _up_fails(*args: str, env: dict[str, str]) -> str:
    """`tinkerq fleet up ARGS` exits 2 with one line on stderr, no traceback, and no fleet recorded; returns it."""
    result = _tinkerq("fleet", "up", *args, env=env, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert not list(Path(env["TINKERQ_HOME"]).glob("fleet/*/state.json"))
    return result.stderr


def test_fleet_up_failures_are_one_line_with_what_to_do(tmp_path, model_dir):
    env = {"TINKERQ_HOME": str(tmp_path / "home")}
    model = ["--model", str(model_dir), "--name", "x"]

    assert "model path" in _up_fails("--model", str(tmp_path / "nope"), env=env)
    assert "--shards must be at least 1, got 0" in _up_fails(*model, "--shards", "0", env=env)
    assert "drop one of them" in _up_fails(*model, "--broker", "redis://127.0.0.1:1/0", "--redis-port", "7000",
                                           env=env)
    assert "TINKERQ_BROKER_URL is not set" in _up_fails(*model, "--broker-from-env", env=env)
    assert "both name a Redis" in _up_fails(*model, "--broker-from-env", "--broker", "redis://127.0.0.1:1/0",
                                            env={**env, "TINKERQ_BROKER_URL": "redis://127.0.0.1:1/0"})

    # A port the user gave that is taken: which one, and what to pass instead.
    taken = free_port()
    sock = hold_port(taken)
    assert sock is not None
    try:
        for flag, what in (("--redis-port", "redis-server"), ("--flower-port", "Flower"),
                           ("--gateway-port", "the gateway")):
            line = _up_fails(*model, flag, str(taken), env=env)
            assert f"port {taken} ({flag}) for {what} is taken: pass {flag} with a free port (e.g. {flag} " in line
    finally:
        sock.close()
    port = free_port()
    assert "is given twice" in _up_fails(*model, "--redis-port", str(port), "--gateway-port", str(port), env=env)

    # A port held by another fleet of this home names that fleet, and how to stop it.
    other = tmp_path / "home" / "fleet" / "other" / "state.json"
    other.parent.mkdir(parents=True)
    other.write_text(json.dumps({"name": "other", "redis": {"pid": 1, "port": taken}}))
    sock = hold_port(taken)
    assert sock is not None
    try:
        result = _tinkerq("fleet", "up", *model, "--redis-port", str(taken), env=env, timeout=120)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert f"port {taken} (--redis-port) for redis-server is taken by fleet 'other' (stop it with " \
               f"`tinkerq fleet down --name other`)" in result.stderr
    finally:
        sock.close()
        other.unlink()

    assert "redis-server is not installed: apt-get install -y redis-server" in _up_fails(
        *model, "--flower-port", "0", env={**env, "PATH": str(tmp_path)})  # python itself is an absolute path
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    assert f"cannot reach Redis at {unreachable}" in _up_fails(*model, "--broker", unreachable, "--flower-port", "0",
                                                               env=env)

    # A worker that cannot start: its own error, from its log; Redis, started first, is stopped again.
    (tmp_path / "not-a-model").mkdir()
    redis_port = free_port()
    line = _up_fails("--model", str(tmp_path / "not-a-model"), "--name", "x", "--redis-port", str(redis_port),
                     "--flower-port", "0", env=env)
    assert f"the worker for {tmp_path / 'not-a-model'} exited during start-up: " in line
    assert "has no config.json" in line and "worker-not-a-model-0.log" in line
    assert port_problem(redis_port) is None  # the fleet's redis-server was stopped

    status = _tinkerq("fleet", "status", "--name", "x", env=env)
    assert status.returncode == 2
    assert "no fleet named 'x' is running (start one with `tinkerq fleet up --name x --model DIR`)" in status.stderr
