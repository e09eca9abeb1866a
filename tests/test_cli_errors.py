"""Every command-line mistake: one line on stderr that says what to do, category [user error], exit status 2.

Each mistake is caught before a model is built, loaded or a fleet started, so these run in seconds. Most run
``tinkerq``'s main() in this process (_run_here: no Python start and imports per case); the ones that load
a model's files, bind a port or talk to a server run the real command (_run), and
test_in_process_runs_say_what_the_command_says checks that the two agree.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from tests.test_cli import _run

pytestmark = pytest.mark.timeout(120)


def _run_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``tinkerq ARGS`` as _run runs it (no TINKERQ_* setting but ``env``'s; exit status, stdout, stderr with the
    log lines main()'s logging.basicConfig would print there), but by calling main() in this process."""
    from tinkerq.launcher.main import main

    clean = {k: v for k, v in os.environ.items() if not k.startswith("TINKERQ_")}
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # Not the official SDK's own loggers ("tinker.*"): a client another module of this process left open logs its
    # failing heartbeats from its own thread, which is not what this command printed.
    handler.addFilter(lambda record: record.name != "tinker" and not record.name.startswith("tinker."))
    level, umask = root.level, os.umask(0o022)
    os.umask(umask)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with mock.patch.dict(os.environ, {**clean, **(env or {})}, clear=True), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code: object = main(list(args))
            except SystemExit as exc:  # argparse's usage errors, --version
                code = exc.code
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        os.umask(umask)  # cmd_worker sets its own
    if isinstance(code, str):  # sys.exit("message"): Python prints it and exits 1
        err.write(code + "\n")
        code = 1
    return subprocess.CompletedProcess(["tinkerq", *args], int(code or 0), out.getvalue(), err.getvalue())


@pytest.mark.parametrize("args", [("sft", "--steps", "0"), ("plot", "/no/such/metrics.jsonl"),
                                  ("healthcheck",), ("--version",)])
def test_in_process_runs_say_what_the_command_says(args):
    """_run_here (main() in this process) gives what the real command gives: a usage error, a [user error]
    line, a settings error, and the version; so the tests that use it test the command."""
    real, here = _run(*args), _run_here(*args)
    assert (here.returncode, here.stdout, here.stderr) == (real.returncode, real.stdout, real.stderr)


def assert_one_line_mistake(out: subprocess.CompletedProcess, command: str, *says: str) -> str:
    """Exit 2, and stderr is exactly one line: ``tinkerq COMMAND: [user error] ...`` holding every ``says``."""
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert lines[0].startswith(f"tinkerq {command}: [user error] "), lines[0]
    for text in says:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def data_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """JSONL files a user might pass by mistake, and a directory that is not a Hugging Face model."""
    root = tmp_path_factory.mktemp("mistakes")
    files = {
        "wrong_fields": root / "wrong_fields.jsonl",
        "not_jsonl": root / "summary.json",
        "empty": root / "empty.jsonl",
        "a_file": root / "a_file",
        "no_config": root / "no_config",
        "model_like": root / "model_like",  # passes `tinkerq worker`'s first check, so a later one can fail
    }
    files["wrong_fields"].write_text('{"question": "abc>", "answer": "cba"}\n')
    files["not_jsonl"].write_text(json.dumps({"steps": 250, "after": {"exact_match": 0.97}}, indent=2))
    files["empty"].write_text("\n")
    files["a_file"].write_text("not a directory\n")
    files["no_config"].mkdir()
    files["model_like"].mkdir()
    (files["model_like"] / "config.json").write_text("{}")
    return files


SFT_RL_NUMBERS = [
    ("sft", "--steps", "0", "positive integer"),
    ("sft", "--steps", "-5", "positive integer"),
    ("sft", "--batch-size", "0", "positive integer"),
    ("sft", "--lr", "0", "positive number"),
    ("sft", "--lr", "nan", "positive number"),
    ("sft", "--eval-examples", "0", "positive integer"),
    ("sft", "--threads", "0", "positive integer"),
    ("rl", "--iterations", "0", "positive integer"),
    ("rl", "--prompts", "0", "positive integer"),
    ("rl", "--group-size", "0", "positive integer"),
    ("rl", "--updates-per-batch", "0", "positive integer"),
    ("rl", "--warmup-steps", "-1", "0 or a positive integer"),
    ("rl", "--lr", "-0.001", "positive number"),
]


@pytest.mark.parametrize(("command", "option", "value", "says"), SFT_RL_NUMBERS)
def test_numbers_out_of_range_are_refused_not_replaced_by_the_default(command, option, value, says):
    """`--steps 0` once trained the default 250 steps (`args.steps or DEFAULT`): now it is a usage error."""
    assert_one_line_mistake(_run_here(command, option, value), command, f"argument {option}", says,
                            f"see: tinkerq {command} --help")


@pytest.mark.parametrize("command", ["sft", "rl"])
def test_missing_model_directory(command):
    assert_one_line_mistake(_run_here(command, "--model", "/no/such/model"), command,
                            "--model /no/such/model: no such directory", "pass a local Hugging Face model directory")


@pytest.mark.parametrize("command", ["sft", "rl"])
def test_model_directory_without_config(command, data_files):
    assert_one_line_mistake(_run_here(command, "--model", str(data_files["no_config"])), command,
                            "no config.json there", "pass a local Hugging Face model directory")


def test_model_directory_without_tokenizer(tmp_path: Path, model_dir: Path):
    """A model's config but no tokenizer: refused when the tokenizer loads, before the fleet starts."""
    model = tmp_path / "config-only"
    model.mkdir()
    (model / "config.json").write_text((model_dir / "config.json").read_text())
    assert_one_line_mistake(_run("sft", "--model", str(model), "--out", str(tmp_path / "run")), "sft",
                            "cannot load its tokenizer", "the directory needs the tokenizer files")
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_missing_train_file():
    assert_one_line_mistake(_run_here("sft", "--train", "/no/such.jsonl"), "sft",
                            "--train /no/such.jsonl: no such file",
                            'pass a JSONL file with one {"prompt": "...", "completion": "..."} object per line')


def test_train_file_with_the_wrong_fields(data_files):
    line = assert_one_line_mistake(_run_here("sft", "--train", str(data_files["wrong_fields"])), "sft",
                                   "line 1: needs string fields 'prompt' and 'completion'", "'question', 'answer'")
    assert "--train" in line


@pytest.mark.parametrize("kind", ["not_jsonl", "empty"])
def test_eval_file_that_is_not_pairs(data_files, kind):
    assert_one_line_mistake(_run_here("sft", "--eval", str(data_files[kind])), "sft", "--eval",
                            'one {"prompt": "...", "completion": "..."} object per line')


def test_batch_larger_than_the_training_set():
    assert_one_line_mistake(_run_here("sft", "--batch-size", "100000"), "sft", "--batch-size 100000 is more than the",
                            "pass at most")


def test_rl_prompts_more_than_the_training_set():
    assert_one_line_mistake(_run_here("rl", "--prompts", "100000"), "rl", "--prompts 100000 is more than the",
                            "pass at most")


def test_out_is_a_file(data_files, model_dir):
    assert_one_line_mistake(_run("sft", "--model", str(model_dir), "--out", str(data_files["a_file"])), "sft",
                            "is a file; pass a directory")


def test_plot_refuses_what_is_not_a_metrics_file(data_files):
    """`tinkerq plot summary.json` once ended in a JSONDecodeError traceback."""
    assert_one_line_mistake(_run_here("plot", str(data_files["not_jsonl"])), "plot", "summary.json, line 1: not JSON",
                            "pass the metrics.jsonl")


def test_plot_of_a_missing_file():
    assert_one_line_mistake(_run_here("plot", "/no/such/metrics.jsonl"), "plot", "no such file",
                            "pass the metrics.jsonl")


@pytest.mark.parametrize("option", ["--keys", "--x"])
def test_plot_with_unknown_columns_leaves_the_previous_png_alone(tmp_path: Path, option):
    """Unknown --keys once wrote an empty PNG over the previous one and exited 0."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "loss": 1.0 / i, "grad_norm": 0.5}) + "\n" for i in range(1, 5)))
    png = tmp_path / "metrics.png"
    previous = b"\x89PNG\r\n\x1a\n the previous curve"
    png.write_bytes(previous)
    line = assert_one_line_mistake(_run_here("plot", str(metrics), option, "lose"), "plot",
                                   f"has no column 'lose' ({option})", "its columns: step, loss, grad_norm")
    assert png.read_bytes() == previous, line


@pytest.mark.parametrize("command", [["healthcheck"], ["keys", "list"], ["gateway"], ["worker", "--model", "MODEL"],
                                     ["dead", "list"]])
def test_commands_that_need_a_broker_say_none_is_configured(command, data_files):
    """healthcheck once answered "no worker registered" from an empty in-process fleet."""
    command = [str(data_files["model_like"]) if arg == "MODEL" else arg for arg in command]
    assert_one_line_mistake(_run_here(*command), command[0], "no broker configured", "set TINKERQ_BROKER_URL")


@pytest.mark.parametrize(("args", "says"), [
    (["--device", "gpu0"], "--device 'gpu0' is not a torch device"),
    (["--loglevel", "chatty"], "argument --loglevel: invalid choice"),
    (["--max-sessions", "0"], "argument --max-sessions: must be a positive integer"),
    (["--metrics-port", "70000"], "argument --metrics-port: must be a port number"),
    (["--rendezvous-timeout", "0"], "argument --rendezvous-timeout: must be a finite positive number"),
])
def test_worker_option_mistakes(args, says, data_files):
    assert_one_line_mistake(_run_here("worker", "--model", str(data_files["model_like"]), *args,
                                      env={"TINKERQ_BROKER_URL": "redis://:pw@h:1/0"}), "worker", says)


def test_worker_model_path_is_checked_before_anything_loads(data_files):
    """A --model that is no model directory is told before torch loads and before the broker is asked (none
    configured here, and that is not what is said)."""
    assert_one_line_mistake(_run_here("worker", "--model", str(data_files["a_file"])), "worker",
                            "is not a directory", "pass a local Hugging Face model directory")
    probe = ("import sys\nfrom tinkerq.launcher.main import main\n"
             "print('exit', main(sys.argv[1:]), 'torch' in sys.modules)\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TINKERQ_")}
    out = subprocess.run([sys.executable, "-c", probe, "worker", "--model", str(data_files["no_config"])],
                         capture_output=True, text=True, timeout=60, env=clean)
    assert out.stdout.split() == ["exit", "2", "False"], (out.stdout, out.stderr)  # torch never imported
    assert "has no config.json" in out.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["list", "--limit", "0"], "argument --limit: must be a positive integer"),
    (["show", "-1"], "argument index: must be 0 or a positive integer"),
])
def test_dead_option_mistakes(args, says):
    """`--limit 0` once listed everything and `show -1` the oldest entry."""
    assert_one_line_mistake(_run_here("dead", *args, env={"TINKERQ_BROKER_URL": "redis://:pw@h:1/0"}),
                            f"dead {args[0]}", says)


def test_gateway_on_a_taken_port():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _run("gateway", "--port", str(port), env={"TINKERQ_BROKER_URL": "redis://:pw@127.0.0.1:1/0"})
    assert_one_line_mistake(out, "gateway", f"cannot listen on 127.0.0.1:{port} (taken)", "pass --port")


def test_worker_model_that_is_not_a_hugging_face_directory(data_files, redis_url):
    out = _run("worker", "--model", str(data_files["no_config"]), env={"TINKERQ_BROKER_URL": redis_url})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    # The broker's own warning (no password) may come first; the error is the last line.
    assert out.stderr.splitlines()[-1].startswith("tinkerq worker: [user error] ")
    assert "has no config.json; is it a Hugging Face model directory?" in out.stderr


def test_version_is_the_installed_distribution():
    from importlib.metadata import version

    out = _run("--version")
    assert out.returncode == 0 and out.stdout == f"tinkerq {version('tinkerq')}\n", out


def _options(parser: argparse.ArgumentParser, prog: str) -> list[tuple[str, argparse.Action]]:
    """Every argument of ``parser`` and of its subcommands, as (their prog, the action); -h excluded."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _options(child, f"{prog} {name}")
        elif not isinstance(action, argparse._HelpAction):
            found.append((prog, action))
    return found


def _subcommands() -> list[str]:
    from tinkerq.launcher.main import build_parser

    return sorted({prog.split()[1] for prog, _ in _options(build_parser(), "tinkerq") if " " in prog})


@pytest.mark.parametrize("command", ["", *_subcommands()])
def test_every_option_has_help(command):
    from tinkerq.launcher.main import build_parser

    everything = _options(build_parser(), "tinkerq")
    mine = [(prog, a) for prog, a in everything if prog.split()[1:2] == command.split()[:1]]
    assert mine
    silent = [f"{prog} {'/'.join(a.option_strings) or a.dest}" for prog, a in mine if not a.help]
    assert silent == [], f"arguments without help: {silent}"


def test_checkpoint_dir_help_names_the_real_default():
    """--checkpoint-dir defaults to Settings.checkpoint_dir, $TINKERQ_HOME/checkpoints (once said ~/.cache/tinkerq)."""
    from tinkerq.launcher.main import build_parser
    from tinkerq.settings import Settings

    defaults = Settings()
    assert Path(defaults.checkpoint_dir) == Path(defaults.home) / "checkpoints"
    assert defaults.home == str(Path.home() / ".cache" / "tinkerq")
    [help_text] = [a.help for prog, a in _options(build_parser(), "tinkerq")
                   if prog == "tinkerq worker" and "--checkpoint-dir" in a.option_strings]
    assert "$TINKERQ_HOME/checkpoints" in help_text and "TINKERQ_HOME defaults to ~/.cache/tinkerq" in help_text


def test_a_broker_url_that_points_at_something_else_says_so(tmp_path: Path):
    """An HTTP server where Redis should be (a proxy on that port, say) was a redis-py traceback."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer_http() -> None:
        with server:
            for _ in range(3):  # redis-py may reconnect once or twice
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(1024)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=answer_http, daemon=True).start()
    out = _run("healthcheck", "--broker", f"redis://127.0.0.1:{port}/0")
    server.close()
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"redis://127.0.0.1:{port}/0 answered, but not as Redis" in lines[0], lines[0]
    assert "check the host and port" in lines[0]
