"""Fixtures: a private redis-server, a tiny Hugging Face model on disk, and a real worker process."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests import sdk_coverage
from tests.helpers import build_tiny_llama
from tests.sdk_coverage import (  # noqa: F401  (hooks: the SDK surface check)
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    pytest_sessionfinish,
    pytest_terminal_summary,
)
from tinkerq.launcher.processes import free_port, start_process, start_redis, wait_for, worker_command
from tinkerq.store import KeyValueStore, MemoryStore, RedisStore

# Small micro-batches in the test worker, so batch splitting inside the worker is exercised too.
WORKER_MICROBATCH_TOKENS = 96
WORKER_MAX_MESSAGE_BYTES = 2 * 1024 * 1024
WORKER_GAP_TIMEOUT_S = 3


# The modules that take longest, longest first. scripts/test runs the suite in parallel (pytest-xdist: --dist
# loadfile --no-loadscope-reorder), handing whole modules to its processes in collection order: started first,
# the long ones do not end up last on one process while the others idle. The cookbook's modules come a little
# later: scripts/test builds their venvs while the first ones run (cookbook_venvs). Only the order changes; a
# module missing here runs after these, in the usual order.
SLOW_MODULES_FIRST = [
    "test_adoption.py", "test_cli.py", "test_outages.py", "test_fleet.py", "test_families_fleet.py",
    "test_cookbook.py", "test_sharding.py", "test_sharded_adoption.py", "test_multihost.py", "test_families_lora.py",
    "test_auto_snapshot.py", "test_sharded_lora.py", "test_published_fleet.py", "test_sdk_download.py",
    "test_sdk_walk_training.py", "test_sdk_sampling_options.py", "test_console.py", "test_sdk_walk_rest.py",
    "test_sdk_checkpoints.py", "test_sdk_sessions.py", "test_sdk_auth.py", "test_gateway_sequence.py",
    "test_families_benchmark.py", "test_sampling_families.py", "test_memory.py", "test_families_cookbook.py",
    "test_observability.py", "test_families_cli.py", "test_redis_modes.py", "test_keys.py", "test_security.py",
    "test_cli_errors.py", "test_fuzz.py", "test_gateway.py", "test_numerics.py", "test_fleet_cli.py",
]


@pytest.fixture(scope="module", autouse=True)
def close_sdk_clients() -> Iterator[None]:
    """Close every official SDK client a test module left open. An open one keeps its session heartbeat going
    after the module's gateway is gone, and its "Session heartbeat failed" warnings landed in a later module's
    captured output in the same process (test_cli_errors counts the lines a CLI error prints).

    What is closed is each SDK holder with a session made during the module (tinker 0.38's InternalClientHolder: a
    ServiceClient's, an unpickled client's), not the ServiceClients: a test that drops its ServiceClient and keeps
    the training client left the holder, and its heartbeat, alive after the ServiceClient was collected (seen: 8-23
    sessions' "Session heartbeat failed for 420+ seconds" in a CI run's output)."""
    try:
        from tinker.lib.internal_client_holder import InternalClientHolder
    except ImportError:  # the plain install has no SDK
        yield
        return
    import weakref

    made: weakref.WeakSet = weakref.WeakSet()  # a holder with a heartbeat is kept alive by its task until closed
    original = InternalClientHolder.__init__

    def init(self: InternalClientHolder, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        made.add(self)

    InternalClientHolder.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        InternalClientHolder.__init__ = original  # type: ignore[method-assign]
        for holder in list(made):  # not ServiceClient.close(status): that posts to a gateway already gone
            # Those with a session (a heartbeat) only: the SDK keeps one session-less holder per URL and key for
            # the process (RestClient's), never closed, and would hand a closed one to a later client.
            if getattr(holder, "_session_heartbeat_task", None) is not None:
                with contextlib.suppress(Exception):
                    holder.close()  # cancels the heartbeat (tinker 0.38: InternalClientHolder.close)


def pytest_configure(config: pytest.Config) -> None:
    # The installed SDK's methods record which tests use them (tests/sdk_coverage.py); without the SDK, the tests
    # that need it skip.
    with contextlib.suppress(ImportError):
        sdk_coverage.install()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # One torch thread per test process when they run in parallel (scripts/test): on 2 cores with 3 test
        # processes and their worker processes, two threads each made in-process tests 2x slower, not faster.
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's tests keep their order


@pytest.fixture(scope="session")
def cookbook_venvs() -> None:
    """tinker-cookbook's venvs (.venv-cookbook, .venv-cookbook-061) are ready. scripts/test builds them while the
    tests run and names the file their build's exit status goes to in TINKERQ_TEST_COOKBOOK_VENVS: wait for it.
    Without it (pytest run by hand), whatever ./scripts/cookbook-venv built is there or not."""
    status = os.environ.get("TINKERQ_TEST_COOKBOOK_VENVS")
    if not status:
        return
    path = Path(status)
    wait_for(path.exists, 900, "scripts/cookbook-venv to build tinker-cookbook's venvs")
    if path.read_text().strip() != "0":
        log = path.with_suffix(".log")
        pytest.fail(f"scripts/cookbook-venv failed:\n{log.read_text()[-3000:] if log.exists() else ''}")


@pytest.fixture(scope="session")
def plain_install_python() -> str:
    """The interpreter of a plain ``pip install -e '.[worker,gateway]'`` (no dev extras), to run servers on as a user
    installs them. scripts/test builds it (.venv-plain) beside the tests and names the file its exit status goes to in
    TINKERQ_TEST_PLAIN_INSTALL: wait for it. Without it (pytest by hand), this interpreter."""
    status = os.environ.get("TINKERQ_TEST_PLAIN_INSTALL")
    if not status:
        return sys.executable
    path = Path(status)
    wait_for(path.exists, 900, "scripts/test to build the plain install (.venv-plain)")
    if path.read_text().strip() != "0":
        log = path.with_suffix(".log")
        pytest.fail(f"the plain install failed:\n{log.read_text()[-3000:] if log.exists() else ''}")
    return str(Path(__file__).resolve().parent.parent / ".venv-plain" / "bin" / "python")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server on a free port for this test session."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run `apt-get install -y redis-server` (.ci/run does)")
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(params=["redis", "memory"])
def store(request: pytest.FixtureRequest) -> Iterator[KeyValueStore]:
    """Each test that takes it runs twice: on the private redis-server (its transactions) and on the
    in-memory store, which must give the same answers."""
    if request.param == "memory":
        yield MemoryStore()
        return
    client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    yield RedisStore(client, retry_s=5)
    client.close()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def start_worker_process(model_dir: Path, redis_url: str, log: Path, env: dict[str, str] | None = None,
                         extra: list[str] | None = None, python: str | None = None) -> subprocess.Popen:
    """``python``: another interpreter to run the worker on (an install of its own: plain_install_python)."""
    cmd = worker_command(str(model_dir), redis_url, threads=1, extra=["--max-sessions", "16", *(extra or [])])
    return start_process([python or cmd[0], *cmd[1:]], log, env)


def start_named_worker(model_dir: Path, redis_url: str, name: str, log: Path, env: dict[str, str] | None = None,
                       extra: list[str] | None = None, timeout: float = 120,
                       python: str | None = None) -> subprocess.Popen:
    """A private worker serving ``model_dir`` as ``name`` (heartbeat 1 s), registered when this returns."""
    from tinkerq.connection import Connection
    from tinkerq.settings import Settings

    proc = start_worker_process(model_dir, redis_url, log, {"TINKERQ_HEARTBEAT_S": "1", **(env or {})},
                                extra=["--name", name, *(extra or [])], python=python)
    conn = Connection.open(Settings(broker_url=redis_url))
    try:
        wait_for(lambda: bool(conn.workers_serving(name)), timeout, f"tinkerq worker {name}", proc, log)
    finally:
        conn.close()
    return proc


@pytest.fixture(scope="session")
def worker(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[subprocess.Popen]:
    """A real `tinkerq worker` process serving the tiny model from the private Redis."""
    from tinkerq.connection import Connection
    from tinkerq.settings import Settings

    log = tmp_path_factory.mktemp("logs") / "worker.log"
    metrics_port = free_port()
    proc = start_worker_process(model_dir, redis_url, log, extra=["--metrics-port", str(metrics_port)], env={
        "TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir),
        "TINKERQ_MICROBATCH_TOKENS": str(WORKER_MICROBATCH_TOKENS),
        "TINKERQ_MAX_MESSAGE_BYTES": str(WORKER_MAX_MESSAGE_BYTES),
        "TINKERQ_HEARTBEAT_S": "1",
        "TINKERQ_GAP_TIMEOUT_S": str(WORKER_GAP_TIMEOUT_S),
    })
    conn = Connection.open(Settings(broker_url=redis_url))
    wait_for(lambda: bool(conn.workers_serving(str(model_dir))), 90, "tinkerq worker", proc, log)
    proc.log_path = log  # type: ignore[attr-defined]
    proc.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # type: ignore[attr-defined]
    yield proc
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    conn.close()


@pytest.fixture
def service(redis_url: str, worker) -> Iterator:
    from tinkerq.producer import ServiceClient

    sc = ServiceClient(broker_url=redis_url)
    yield sc
    sc.close()


@pytest.fixture
def training_client(service, model_dir: Path) -> Iterator:
    tc = service.create_training_client(str(model_dir))
    yield tc
    tc.close()
