"""`tinkerq fleet up` refusing: every failure is one line that says what to do, and leaves nothing running."""

from __future__ import annotations

import json
import sys
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
    model = ["--model", str(model_dir), "--fleet", "x"]

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
        for flag, what, extra in (("--redis-port", "redis-server", []), ("--flower-port", "Flower", []),
                                  ("--gateway-port", "the gateway", [])):
            line = _up_fails(*model, flag, str(taken), *extra, env=env)
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
               f"`tinkerq fleet down --fleet other`)" in result.stderr
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
    line = _up_fails("--model", str(tmp_path / "not-a-model"), "--fleet", "x", "--redis-port", str(redis_port),
                     "--flower-port", "0", env=env)
    assert f"the worker for {tmp_path / 'not-a-model'} exited during start-up: " in line
    assert "has no config.json" in line and "worker-not-a-model-0.log" in line
    assert port_problem(redis_port) is None  # the fleet's redis-server was stopped

    status = _tinkerq("fleet", "status", "--fleet", "x", env=env)
    assert status.returncode == 2
    assert "no fleet named 'x' is running (start one with `tinkerq fleet up --fleet x --model DIR`)" in status.stderr


def _in_process_fails(capsys, *args: str) -> str:
    """`tinkerq ARGS`, run in this process, exits 2 with one line on stderr; returns it."""
    from tinkerq.launcher.main import main as tinkerq_in_process

    try:
        code = tinkerq_in_process(list(args))
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_fleet_flags_mean_what_they_mean_on_the_other_commands(tmp_path, model_dir, monkeypatch, capsys):
    """--fleet names the fleet on every subcommand; --name (a model's served name on `tinkerq worker`) is refused
    there with a pointer to the flag meant; --served-name belongs to the --model before it; --gateways and
    --no-flower agree with the ports given. All refused before anything starts."""
    monkeypatch.setenv("TINKERQ_HOME", str(tmp_path / "home"))
    for args in (["up", "--name", "t", "--model", str(model_dir)], ["status", "--name", "t"], ["down", "--name"]):
        err = _in_process_fails(capsys, "fleet", *args)
        assert "--name is not a `tinkerq fleet` option: the fleet's name is --fleet " in err
        assert ("--served-name NAME after its --model" in err) == (args[0] == "up"), err
    model = ["--model", str(model_dir)]
    taken = free_port()
    sock = hold_port(taken)
    assert sock is not None
    try:
        for args, expected in (
                (["--served-name", "Qwen/Qwen3-8B", *model], "put it after that --model DIR"),
                ([*model, "--served-name", "a", "--served-name", "b"], "has two --served-name"),
                ([*model, "--served-name", ""], "is empty"),
                ([*model, "--served-name", "m", *model, "--served-name", "m"], "two --model are served as 'm'"),
                ([*model, "--gateways", "2"], "--gateways 2 needs --gateway-port PORT"),
                ([*model, "--gateways", "0", "--gateway-port", "8000"], "--gateways 0 starts no gateway, but"),
                ([*model, "--no-flower", "--flower-port", "5555"], "--no-flower and --flower-port 5555 contradict"),
                ([*model, "--redis-port", "0"], "--redis-port 0 is no port"),
                ([*model, "--gateways", "2", "--gateway-port", str(taken)],
                 f"port {taken} (--gateway-port) for the gateways' proxy is taken")):
            assert expected in _in_process_fails(capsys, "fleet", "up", *args), args
    finally:
        sock.close()
    assert not list((tmp_path / "home").glob("fleet/*/state.json"))


def test_fleet_up_without_flower_and_gateway_names_both_extras_in_one_line(tmp_path, model_dir, monkeypatch, capsys):
    """A plain `.[worker]` install has neither Flower nor the gateway: `up --gateway-port` says both in one line
    (one pip command for both extras), before starting anything, instead of one error after the other."""
    from tinkerq.launcher import flower, processes
    from tinkerq.launcher.main import main as tinkerq_in_process

    monkeypatch.setenv("TINKERQ_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(flower, "installed", lambda: False)
    monkeypatch.setattr(processes, "GATEWAY_MODULES", ("fastapi", "tinkerq_no_such_module"))
    redis_port = free_port()
    up = ["fleet", "up", "--fleet", "f", "--model", str(model_dir), "--workers", "0", "--redis-port", str(redis_port),
          "--gateway-port", str(free_port())]
    assert tinkerq_in_process(up) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "Flower and the gateway are not installed" in err and "-m pip install -e '.[ops,gateway]'" in err, err
    assert "--no-flower, no --gateway-port" in err, err
    assert port_problem(redis_port) is None  # nothing was started
    assert not list((tmp_path / "home").glob("fleet/*/state.json"))
    # the gateway alone missing: its own line, as before
    monkeypatch.setattr(flower, "installed", lambda: True)
    assert tinkerq_in_process(up) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the gateway needs tinkerq_no_such_module" in err and ".[gateway]" in err, err


def test_fleet_up_without_flower_says_how_to_install_it(tmp_path, model_dir, monkeypatch, capsys):
    """Flower comes with the ops extra. Missing, `up` says so before starting anything; and should `celery flower`
    still fail as it does without Flower (it exits with "No such command"), `up` says the same and stops what it
    had started."""
    from tinkerq.launcher import flower, processes
    from tinkerq.launcher.main import main as tinkerq_in_process

    monkeypatch.setenv("TINKERQ_HOME", str(tmp_path / "home"))
    redis_port = free_port()
    up = ["fleet", "up", "--fleet", "f", "--model", str(model_dir), "--workers", "0", "--redis-port", str(redis_port)]

    monkeypatch.setattr(flower, "installed", lambda: False)
    assert tinkerq_in_process(up) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Flower is not installed: it comes with tinkerq's ops extra" in err, err
    assert "-m pip install -e '.[ops]'" in err and "or pass --no-flower" in err
    monkeypatch.undo()

    celery_without_flower = [sys.executable, "-c", "import sys; sys.stderr.write(\"Usage: python -m celery [OPTIONS] "
                             "[COMMAND] [ARGS]...\\n\\nError: No such command 'flower'.\\n\"); sys.exit(2)"]
    monkeypatch.setenv("TINKERQ_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(processes, "flower_command", lambda *args, **kwargs: celery_without_flower)
    assert tinkerq_in_process(up) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "Flower exited during start-up: Error: No such command 'flower'. Flower is not installed" in err, err
    assert "or pass --no-flower" in err and "flower.log" in err
    assert port_problem(redis_port) is None  # the redis-server it had started is stopped
    assert not list((tmp_path / "home").glob("fleet/*/state.json"))

    # --no-flower: the same fleet comes up without it.
    assert tinkerq_in_process([*up, "--no-flower"]) == 0
    out = capsys.readouterr().out
    assert "fleet 'f' is up: 0 workers for 1 model" in out and "Flower:" not in out
    assert tinkerq_in_process(["fleet", "down", "--fleet", "f"]) == 0
    assert "1 process(es) stopped" in capsys.readouterr().out
