"""A check that cannot fall behind the SDK: every public method of the installed tinker SDK's clients, every loss it
names and every subcommand of its `tinker` command must be used by a test that passes.

Nothing is listed by hand but what is not served yet (NOT_YET, each with its reason; an entry that a passing test
now uses fails the run too, so the list only shrinks). The surface is read from the installed SDK: the public
callables of ServiceClient, TrainingClient, SamplingClient, RestClient and AdminClient (sync and async spellings are
separate entries), the LossFnType literal, and the click tree of `tinker.cli`.

How use is seen: at start-up the SDK's public methods are wrapped (functools.wraps: signatures and kinds unchanged,
so tests/test_sdk_surface.py still compares the SDK's own) to record each call made from outside the SDK (its own
internal calls do not count), and ``loss:<name>`` for the loss a forward/forward_backward is given. CLI subcommands
are recorded by tests.helpers.run_tinker_cli, the one way tests run the `tinker` command. What a test used counts
once the test has passed. Under pytest-xdist each process writes what its passed tests used to
$TINKERQ_SDK_COVERAGE_DIR; the run's last hook reads them all and fails the run on a gap. Active only for a whole
run (scripts/test: no test paths, -k or -m), where that variable is set.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

# What is not served yet, and why. Entries leave as the tests that use them land (issue 28).
NOT_YET: dict[str, str] = {}
# Only what needs the Hugging Face Hub, which tests cannot reach.
NEEDS_THE_HUB = {"cli:checkpoint push-hf": "uploads a checkpoint to the Hugging Face Hub"}

CLIENTS = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient", "AdminClient")
LOSS_METHODS = {"forward", "forward_async", "forward_backward", "forward_backward_async"}

_used_now: set[str] = set()  # by the running test (setup, call, teardown)
_used_by_passed: set[str] = set()


def record(entry: str) -> None:
    _used_now.add(entry)


def surface() -> set[str]:
    """Every entry of the installed SDK's surface (module doc)."""
    import click
    import tinker
    from tinker.cli.__main__ import main_cli
    from tinker.types import loss_fn_type

    found = {f"{name}.{attr}" for name in CLIENTS for attr, _ in _public_methods(getattr(tinker, name))}
    found |= {f"loss:{loss}" for loss in typing.get_args(loss_fn_type.LossFnType)}

    def walk(group: click.Group, ctx: click.Context, prefix: list[str]) -> None:
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            if isinstance(command, click.Group):
                walk(command, click.Context(command, parent=ctx), [*prefix, name])
            elif command is not None:
                found.add("cli:" + " ".join([*prefix, name]))

    walk(main_cli, click.Context(main_cli), [])
    return found


def cli_entry(args: list[str]) -> str | None:
    """The ``cli:...`` entry a `tinker` command line runs (options before the subcommand skipped), or None."""
    words, rest = [], iter(args)
    for arg in rest:
        if arg in ("-f", "--format"):  # the root group's one option with a value
            next(rest, None)
        elif not arg.startswith("-"):
            words.append(arg)
    known = {e for e in surface() if e.startswith("cli:")}
    for n in (2, 1):
        entry = "cli:" + " ".join(words[:n])
        if entry in known:
            return entry
    return None


def _public_methods(cls: type) -> list[tuple[str, Any]]:
    return [(name, value) for name, value in inspect.getmembers(cls)
            if not name.startswith("_") and callable(value) and not inspect.isclass(value)]


def _from_outside() -> bool:
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return not (caller == "tinker" or caller.startswith("tinker."))


def _client_of(target: Any, inheritors: list[type]) -> type | None:
    """The most derived client class ``target`` (an instance or a class) is, among those that have the method."""
    cls = target if isinstance(target, type) else type(target)
    matches = [c for c in inheritors if isinstance(cls, type) and issubclass(cls, c)]
    return max(matches, key=lambda c: len(c.__mro__), default=None)


def _recorder(name: str, func: Any, inheritors: list[type], bound: bool) -> Any:
    """``func`` recording ``<Client>.<name>`` (and ``loss:<loss_fn>``) when called from outside the SDK. ``bound``:
    its first argument is the instance or class (not a staticmethod)."""
    signature = inspect.signature(func)

    @functools.wraps(func)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        if _from_outside():
            client = _client_of(args[0], inheritors) if bound and args else None
            for cls in [client] if client is not None else inheritors:
                record(f"{cls.__name__}.{name}")
            if name in LOSS_METHODS:
                try:
                    loss = signature.bind(*args, **kwargs).arguments.get("loss_fn", "cross_entropy")
                except TypeError:
                    loss = None
                if isinstance(loss, str):
                    record(f"loss:{loss}")
        return func(*args, **kwargs)

    recorded._tinkerq_recorded = True  # type: ignore[attr-defined]
    return recorded


def install() -> None:
    """Wrap the SDK's public client methods, each once, on the class that defines it."""
    import tinker

    clients = [getattr(tinker, name) for name in CLIENTS]
    for cls in clients:
        for name, _ in _public_methods(cls):
            owner = next(c for c in cls.__mro__ if name in vars(c))
            raw = vars(owner)[name]
            func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            if not inspect.isfunction(func) or getattr(func, "_tinkerq_recorded", False):
                continue
            inheritors = [c for c in clients if issubclass(c, owner)]
            wrapped = _recorder(name, func, inheritors, bound=not isinstance(raw, staticmethod))
            setattr(owner, name, type(raw)(wrapped) if isinstance(raw, (staticmethod, classmethod)) else wrapped)


# -- pytest hooks (imported into tests/conftest.py) ---------------------------------------------------------------

def _active(config: pytest.Config) -> bool:
    return bool(os.environ.get("TINKERQ_SDK_COVERAGE_DIR"))


def _whole_run(config: pytest.Config) -> bool:
    args = [a for a in config.args if a not in ("tests", "tests/")]
    return not args and not config.option.keyword and not config.option.markexpr


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _used_now.clear()
    yield
    if item.stash.get(_PASSED, False):
        _used_by_passed.update(_used_now)
    _used_now.clear()


_PASSED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[_PASSED] = report.passed
    elif report.failed:  # a failed setup or teardown: nothing it used counts
        item.stash[_PASSED] = False


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _active(session.config):
        return
    directory = Path(os.environ["TINKERQ_SDK_COVERAGE_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None:
        (directory / f"{worker}.json").write_text(json.dumps(sorted(_used_by_passed)))
        return
    used = set(_used_by_passed)
    for file in directory.glob("*.json"):
        used.update(json.loads(file.read_text()))
    if not _whole_run(session.config):
        return
    gaps = sorted(surface() - used - set(NOT_YET) - set(NEEDS_THE_HUB))
    stale = sorted(set(NOT_YET) & used)
    lines = []
    if gaps:
        lines.append(f"{len(gaps)} entries of the installed SDK's surface are used by no passing test: "
                     + ", ".join(gaps))
    if stale:
        lines.append("NOT_YET in tests/sdk_coverage.py lists entries a passing test now uses (remove them): "
                     + ", ".join(stale))
    total = len(surface())
    session.config.stash[_SUMMARY] = [f"SDK surface: {total - len(gaps) - len(NOT_YET) - len(NEEDS_THE_HUB)} of "
                                      f"{total} entries used by passing tests, {len(NOT_YET)} not yet served, "
                                      f"{len(NEEDS_THE_HUB)} need the Hugging Face Hub", *lines]
    if gaps or stale:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_SUMMARY = pytest.StashKey[list[str]]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    for line in config.stash.get(_SUMMARY, []):
        terminalreporter.write_line(line)
