"""A real fleet for the SDK's REST tests (tests/test_sdk_sessions.py, tests/test_sdk_checkpoints.py): a worker
serving the tiny Llama under a cookbook name, a gateway that reaches the same checkpoint directory (for
set_checkpoint_ttl and copy_weights), Redis, and two tenants' keys."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import start_named_worker
from tests.helpers import run_tinker_cli
from tests.test_gateway import NAME
from tinkerq.launcher.processes import free_port, gateway_command, gateway_up, start_process, wait_for
from tinkerq.settings import Settings
from tinkerq.tenants import ApiKeys


@dataclass
class Fleet:
    url: str
    keys: dict[str, str]  # "alice", "bob" -> API key
    tenants: dict[str, str]  # "alice", "bob" -> tenant name
    redis_url: str
    checkpoint_dir: Path
    worker: subprocess.Popen
    logs: Path

    def cli(self, who: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """The `tinker` command as ``who``, against this gateway (recorded for tests/sdk_coverage.py)."""
        return run_tinker_cli(list(args), base_url=self.url, api_key=self.keys[who], timeout=timeout)


@contextmanager
def sdk_fleet(model_dir: Path, redis_url: str, checkpoint_dir: Path, logs: Path) -> Iterator[Fleet]:
    env = {"TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir)}
    worker = start_named_worker(model_dir, redis_url, NAME, logs / "worker.log", env=env)
    port = free_port()
    gateway = start_process(gateway_command(redis_url, port), logs / "gateway.log",
                            {**env, "TINKERQ_GATEWAY_POLL_S": "2"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: gateway_up(url), 60, "tinkerq gateway", gateway, logs / "gateway.log")
        api_keys = ApiKeys.open(Settings(broker_url=redis_url))
        tenants = {who: f"{who}-{uuid.uuid4().hex[:6]}" for who in ("alice", "bob")}
        made = {who: api_keys.create(name) for who, name in tenants.items()}
        api_keys.close()
        yield Fleet(url, made, tenants, redis_url, checkpoint_dir, worker, logs)
    finally:
        for proc in (gateway, worker):
            proc.terminate()
            proc.wait(30)
