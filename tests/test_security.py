"""Hardening (docs/security.md): names from messages never become paths outside the checkpoint directory,
planted symlinks are refused instead of followed, secrets stay off command lines, the fleet's files are
owner-only, Flower needs a login, and a risky broker URL is pointed out."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tinkerq import errors
from tinkerq.errors import ValidationError
from tinkerq.launcher.processes import ROOT, free_port

pytestmark = pytest.mark.timeout(240)
MODEL_ID = "0123456789abcdef0123456789abcdef"


def snapshot(folder: Path) -> dict[str, tuple]:
    """Everything under ``folder`` (links not followed): kind, mode, size and content hash of each entry."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = os.lstat(path)
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
            link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
            out[str(path.relative_to(folder))] = (stat.S_IFMT(st.st_mode), st.st_size, digest, link, st.st_mtime_ns)
    return out


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the checkpoint directory that a followed link would write into or delete."""
    folder = tmp_path / "outside"
    (folder / "victim").mkdir(parents=True)
    (folder / "victim" / "precious.txt").write_text("must survive")
    (folder / "keep.txt").write_text("must survive too")
    return folder


def _user_error(future, *words: str) -> errors.TinkerqError:
    err = future.exception(timeout=60)
    assert isinstance(err, errors.UserError), err
    for word in words:
        assert word in err.message, err.message
    return err


# -- planted symlinks, end to end: a real worker, the shared checkpoint directory --------------------------------


def test_symlinked_session_directory_is_refused(training_client, checkpoint_dir, outside):
    tc = training_client
    link = Path(checkpoint_dir) / tc.model_id
    before = snapshot(outside)
    os.symlink(outside, link)
    try:
        _user_error(tc.save_weights_for_sampler("victim"), "symbolic link", tc.model_id)
        _user_error(tc.save_state("victim"), "symbolic link")
        assert snapshot(outside) == before  # nothing written, replaced or deleted through the link
        assert os.path.islink(link)
    finally:
        link.unlink()
    path = tc.save_weights_for_sampler("victim").result(timeout=60).path  # the session goes on
    assert Path(path).is_dir() and not Path(path).is_symlink() and snapshot(outside) == before


def test_symlinked_state_directory_is_refused(training_client, checkpoint_dir, outside):
    tc = training_client
    session_dir = Path(checkpoint_dir) / tc.model_id
    session_dir.mkdir()
    before = snapshot(outside)
    os.symlink(outside, session_dir / "state")
    _user_error(tc.save_state("victim"), "symbolic link", "state")
    assert snapshot(outside) == before
    # Weights-only saves do not go through state/ and still work.
    assert tc.save_weights_for_sampler("fine").result(timeout=60).path.startswith(str(session_dir))


def test_symlinked_final_name_is_neither_followed_nor_replaced(training_client, checkpoint_dir, outside):
    tc = training_client
    session_dir = Path(checkpoint_dir) / tc.model_id
    (session_dir / "state").mkdir(parents=True)
    os.symlink(outside / "victim", session_dir / "victim")
    os.symlink(outside / "victim", session_dir / "state" / "victim")
    before = snapshot(outside)
    _user_error(tc.save_weights_for_sampler("victim"), "symbolic link")
    _user_error(tc.save_state("victim"), "symbolic link")
    assert snapshot(outside) == before
    assert os.path.islink(session_dir / "victim") and os.path.islink(session_dir / "state" / "victim")
    assert not [p for p in session_dir.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_symlinks_in_a_saved_state_are_refused_on_load(training_client, checkpoint_dir, outside):
    tc = training_client
    path = Path(tc.save_state("real").result(timeout=60).path)
    # A planted file link that would load fine if followed: a copy of the real weights, outside.
    shutil.copy2(path / "model.safetensors", outside / "model.safetensors")
    (path / "model.safetensors").unlink()
    os.symlink(outside / "model.safetensors", path / "model.safetensors")
    _user_error(tc.load_state(str(path)), "symbolic link", "model.safetensors")
    # A whole state directory that is a link to a valid state elsewhere.
    (path / "model.safetensors").unlink()
    shutil.copy2(outside / "model.safetensors", path / "model.safetensors")
    shutil.copytree(path, outside / "copied-state")
    linked = path.parent / "linked"
    os.symlink(outside / "copied-state", linked)
    _user_error(tc.load_state(str(linked)), "symbolic link")
    tc.load_state(str(path)).result(timeout=60)  # the real one still loads


# -- the path helper itself ----------------------------------------------------------------------------------------


def test_path_helper_refuses_dot_dot_absolute_and_separators(tmp_path):
    from tinkerq.worker import checkpoints

    root = tmp_path / "root"
    for model_id in ("../../x", "..", ".", "/etc", "a/b", "", "x\0y", None, 7):
        with pytest.raises(ValidationError, match="session id"):
            checkpoints.weights_path(str(root), model_id, "n")
        with pytest.raises(ValidationError, match="session id"):
            checkpoints.state_path(str(root), model_id, "n")
    for name in ("..", "../up", "/abs", "a/b", ""):
        with pytest.raises(ValidationError, match="checkpoint name"):
            checkpoints.weights_path(str(root), MODEL_ID, name)
    for parts in (("..",), ("a", "..", "b"), ("/abs",), ("a/b",)):
        with pytest.raises(ValidationError, match="cannot name a directory"):
            checkpoints.path_below(str(root), *parts)
    assert list(tmp_path.iterdir()) == []  # names are checked before any directory is created


def test_path_helper_creates_owner_only_directories_inside_the_root(tmp_path):
    from tinkerq.worker import checkpoints

    root = tmp_path / "root"
    final = checkpoints.state_path(str(root), MODEL_ID, "s1")
    assert final == root / MODEL_ID / "state" / "s1" and not final.exists()
    for d in (root, root / MODEL_ID, root / MODEL_ID / "state"):
        assert stat.S_IMODE(os.stat(d).st_mode) & 0o077 == 0, d
    checkpoints.write_atomically(final, lambda d: (d / "f").write_text("1"))
    assert stat.S_IMODE(os.stat(final).st_mode) & 0o077 == 0


def test_path_helper_refuses_symlinks_at_every_level(tmp_path):
    from tinkerq.worker import checkpoints

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    before = snapshot(tmp_path / "elsewhere")
    (root / MODEL_ID / "state").mkdir(parents=True)
    levels = [root / "linked-session", root / MODEL_ID / "state" / "linked-name", root / MODEL_ID / "linked"]
    for link in levels:
        os.symlink(elsewhere, link)
    with pytest.raises(ValidationError, match="symbolic link"):
        checkpoints.state_path(str(root), "linked-session", "x")
    with pytest.raises(ValidationError, match="symbolic link"):
        checkpoints.state_path(str(root), MODEL_ID, "linked-name")
    with pytest.raises(ValidationError, match="symbolic link"):
        checkpoints.weights_path(str(root), MODEL_ID, "linked")
    with pytest.raises(ValidationError, match="symbolic link"):
        checkpoints.write_atomically(root / MODEL_ID / "linked", lambda d: (d / "f").write_text("1"))
    assert snapshot(elsewhere) == before and all(p.is_symlink() for p in levels)


def test_the_root_itself_may_be_a_link(tmp_path):
    """Operators may point TINKERQ_CHECKPOINT_DIR at a link (e.g. to a bigger disk); only below it is refused."""
    from tinkerq.worker import checkpoints

    real = tmp_path / "disk" / "checkpoints"
    real.mkdir(parents=True)
    link = tmp_path / "ckpt-link"
    os.symlink(real, link)
    final = checkpoints.state_path(str(link), MODEL_ID, "s")
    checkpoints.write_atomically(final, lambda d: (d / checkpoints.STATE_FILE).write_text("{}"))
    assert (real / MODEL_ID / "state" / "s" / checkpoints.STATE_FILE).is_file()
    for given in (str(final), str(real / MODEL_ID / "state" / "s"), f"{MODEL_ID}/state/s"):
        assert checkpoints.resolve_state_path(given, str(link)) == link / MODEL_ID / "state" / "s"


def test_state_paths_to_load_are_checked(tmp_path):
    from tinkerq.worker import checkpoints

    root = tmp_path / "root"
    final = checkpoints.state_path(str(root), MODEL_ID, "s")
    checkpoints.write_atomically(final, lambda d: (d / checkpoints.STATE_FILE).write_text("{}"))
    cases = {
        str(root / MODEL_ID / "state" / ".." / "state" / "s"): "outside",
        str(tmp_path): "outside",
        "/etc": "outside",
        f"../{root.name}/{MODEL_ID}/state/s": "outside",
        str(root): "checkpoint directory itself",
        str(root / MODEL_ID / "state" / "nope"): "does not exist",
        str(root / MODEL_ID / "state"): "not a training state",
    }
    for given, words in cases.items():
        with pytest.raises(ValidationError, match=words):
            checkpoints.resolve_state_path(given, str(root))
    (final / "config.json").symlink_to("/etc/hostname")
    with pytest.raises(ValidationError, match="symbolic link"):
        checkpoints.resolve_state_path(str(final), str(root))


# -- broker warnings -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url, expected", [
    ("redis://:pw@127.0.0.1:6379/0", []),
    ("redis://:pw@localhost:6379/0", []),
    ("redis://:pw@[::1]:6379/0", []),
    ("rediss://:pw@redis.example.com:6380/0", []),
    ("unix:///run/redis.sock", []),
    ("memory://", []),
    (None, []),
    ("redis://127.0.0.1:6379/0", ["no password"]),
    ("redis://:pw@10.0.0.5:6379/0", ["without TLS"]),
    ("redis://redis.example.com:6379/0", ["no password", "without TLS"]),
    ("rediss://redis.example.com:6380/0", ["no password"]),
    # One broker: the password is the first address's, the hosts are all of them.
    ("sentinel://:pw@10.0.0.1:26379;sentinel://10.0.0.2:26379", ["without TLS"]),
    ("sentinel://:pw@127.0.0.1:26379;sentinel://127.0.0.1:26380", []),
    ("sentinel://127.0.0.1:26379", ["no password"]),
])
def test_broker_warnings(url, expected):
    from tinkerq.security import broker_warnings

    found = broker_warnings(url)
    assert len(found) == len(expected), found
    for line, words in zip(found, expected, strict=True):
        assert words in line
        assert ":pw@" not in line  # never repeats the password


def test_password_in_argv():
    from tinkerq.security import password_in_argv

    assert password_in_argv("redis://:secret@127.0.0.1:6379/0")
    assert password_in_argv("redis://user:secret@h/0")
    assert not password_in_argv("redis://127.0.0.1:6379/0") and not password_in_argv(None)


def test_worker_warns_about_a_password_on_its_command_line(monkeypatch, caplog, tmp_path):
    from tinkerq.launcher import main as launcher_main
    from tinkerq.launcher.main import main
    from tinkerq.worker.core import runtime as worker_runtime

    monkeypatch.setattr(launcher_main, "check_broker", lambda settings: None)  # no Redis at that address
    monkeypatch.setattr(worker_runtime, "run_worker", lambda *a, **k: None)
    (tmp_path / "config.json").write_text("{}")  # a model directory as far as the command checks (nothing loads)
    old = os.umask(0o022)
    try:
        with caplog.at_level(logging.WARNING):
            assert main(["worker", "--model", str(tmp_path), "--broker", "redis://:secret@10.1.2.3:6379/0"]) == 0
        assert os.umask(0o022) == 0o077  # the worker made everything it writes owner-only
    finally:
        os.umask(old)
    text = caplog.text
    assert "TINKERQ_BROKER_URL" in text and "without TLS" in text and "secret" not in text


# -- Flower's login ------------------------------------------------------------------------------------------------


def test_flower_without_a_login_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_BASIC_AUTH"}
    out = subprocess.run([sys.executable, "-m", "tinkerq.launcher.main", "flower", "--broker", "redis://127.0.0.1:1/0"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Flower needs a login" in out.stderr and "--no-auth" in out.stderr


def test_flower_gets_its_secrets_through_the_environment(monkeypatch, caplog):
    from tinkerq.launcher import main as cli

    calls = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((argv, env)))
    monkeypatch.setattr(os, "umask", lambda mask: 0o022)  # keep this test process's umask
    monkeypatch.delenv("FLOWER_BASIC_AUTH", raising=False)
    broker = "redis://:brokerpw@127.0.0.1:6379/0"
    assert cli.main(["flower", "--broker", broker, "--basic-auth", "op:flowerpw"]) == 0
    monkeypatch.setenv("FLOWER_BASIC_AUTH", "op:fromenv")
    monkeypatch.setenv("TINKERQ_BROKER_URL", broker)
    assert cli.main(["flower"]) == 0
    (argv1, env1), (argv2, env2) = calls
    for argv in (argv1, argv2):
        assert not any("flowerpw" in a or "fromenv" in a or "brokerpw" in a for a in argv), argv
    assert env1["FLOWER_BASIC_AUTH"] == "op:flowerpw" and env2["FLOWER_BASIC_AUTH"] == "op:fromenv"
    assert env1["TINKERQ_BROKER_URL"] == broker
    # --no-auth: an explicit, logged choice; it cannot be combined with a login.
    assert cli.main(["flower", "--no-auth"]) == 2
    monkeypatch.delenv("FLOWER_BASIC_AUTH")
    with caplog.at_level(logging.WARNING):
        assert cli.main(["flower", "--no-auth"]) == 0
    assert "WITHOUT a login" in caplog.text and "FLOWER_BASIC_AUTH" not in calls[-1][1]


# -- the local fleet: nothing secret in any process's argv, owner-only files ---------------------------------------


def _all_cmdlines() -> list[str]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):  # a process that just exited
                out.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return out


def test_fleet_keeps_secrets_off_command_lines_and_its_files_private(tmp_path, model_dir):
    env = {**os.environ, "TINKERQ_HOME": str(tmp_path / "home"), "TINKERQ_HEARTBEAT_S": "1"}
    env.pop("FLOWER_BASIC_AUTH", None)
    env.pop("TINKERQ_BROKER_URL", None)

    def tinkerq(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tinkerq.launcher.main", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=200)

    up = tinkerq("fleet", "up", "--fleet", "sec", "--model", str(model_dir), "--redis-port", str(free_port()),
                 "--flower-port", str(free_port()), "--threads", "1")
    folder = tmp_path / "home" / "fleet" / "sec"
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        state = json.loads((folder / "state.json").read_text())
        redis_password = state["broker"].split("://:")[1].split("@")[0]
        flower_password = state["flower"]["auth"].split(":", 1)[1]
        assert len(redis_password) >= 16 and len(flower_password) >= 12
        cmdlines = _all_cmdlines()
        assert any("tinkerq.launcher.main worker" in c for c in cmdlines)  # the scan sees the fleet's processes
        for secret in (redis_password, flower_password):
            assert not [c for c in cmdlines if secret in c]
        status = tinkerq("fleet", "status", "--fleet", "sec")
        assert status.returncode == 0, status.stderr
        assert redis_password not in status.stdout and flower_password not in status.stdout
        # Owner-only: the state (it holds the secrets), the logs, the AOF and Redis's config file.
        assert (folder / "redis" / "redis-auth.conf").is_file()
        loose = [str(p) for p in [folder, *folder.rglob("*")] if stat.S_IMODE(os.lstat(p).st_mode) & 0o077]
        assert not loose, loose
    finally:
        down = tinkerq("fleet", "down", "--fleet", "sec")
    assert down.returncode == 0, down.stderr
