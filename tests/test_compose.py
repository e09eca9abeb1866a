"""docker-compose.yml cannot run here (no Docker engine), so check it against the real command line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launcher.main import build_parser

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_and_healthcheck(compose):
    assert {"redis", "worker"} <= set(compose["services"])
    redis = compose["services"]["redis"]
    assert redis["healthcheck"]["test"][0] == "CMD" and "noeviction" in redis["command"]
    assert compose["services"]["worker"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_worker_command_is_a_real_tinkerq_command(compose):
    worker = compose["services"]["worker"]
    dockerfile = (ROOT / worker["build"]["dockerfile"]).read_text()
    assert 'ENTRYPOINT ["tinkerq"]' in dockerfile
    args = build_parser().parse_args(worker["command"])  # exits on an unknown flag
    assert args.command == "worker" and args.model == "/models/model" and args.broker == "redis://redis:6379/0"
    mounts = [v.split(":")[-2] if v.count(":") >= 2 else v.split(":")[-1] for v in worker["volumes"]]
    assert "/models/model" in mounts and args.checkpoint_dir in mounts


def test_dockerfile_never_installs_pypi_apex():
    for path in (ROOT / "ops").glob("Dockerfile*"):
        text = path.read_text()
        assert "pip install apex" not in text and "install apex " not in text
