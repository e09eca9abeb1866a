"""docker-compose.yml cannot run here (no Docker engine), so it is checked against the real command line:
every service command parses with `tinkerq`'s own parser, every variable is documented in .env.example,
GPU reservations and healthchecks are well-formed, and the local launcher builds the same commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tinkerq.launcher import processes
from tinkerq.launcher.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
TINKERQ_IMAGES = {"ops/Dockerfile.gpu", "ops/Dockerfile.cpu", "ops/Dockerfile.producer"}


@pytest.fixture(scope="module")
def compose_text() -> str:
    return (ROOT / "docker-compose.yml").read_text()


@pytest.fixture(scope="module")
def compose(compose_text) -> dict:
    return yaml.safe_load(compose_text)


def _fill(value: str) -> str:
    """Substitute ${VAR...} with a placeholder, as compose would with a value."""
    return re.sub(r"\$\{[^}]+\}", "VALUE", value)


def _parse(command: list[str]):
    return build_parser().parse_args([_fill(c) for c in command])  # SystemExit on any unknown flag


def test_services(compose):
    services = compose["services"]
    assert {"redis", "worker", "worker-cpu", "flower", "sft"} <= set(services)
    assert services["worker-cpu"]["profiles"] == ["cpu"] and services["sft"]["profiles"] == ["producer"]
    redis = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis and "--appendfsync everysec" in redis and "noeviction" in redis
    # The password reaches Redis on stdin (`redis-server -`), from the environment, not on its command line.
    assert "redis-server -" in redis and 'requirepass "$$REDIS_PASSWORD"' in redis and "--requirepass" not in redis
    assert services["redis"]["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD")
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"])
    for name in ("worker", "worker-cpu", "flower", "sft", "gateway"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    # The gateway is the only way in for SDK users: published on loopback, checked through its health endpoint.
    assert services["gateway"]["profiles"] == ["gateway"]
    assert services["gateway"]["ports"] == ["127.0.0.1:${GATEWAY_PORT:-8000}:8000"]
    assert "/api/v1/healthz" in " ".join(services["gateway"]["healthcheck"]["test"])


def test_every_command_is_a_real_tinkerq_command(compose):
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        dockerfile = service["build"]["dockerfile"]
        assert dockerfile in TINKERQ_IMAGES, name
        assert 'ENTRYPOINT ["tinkerq"]' in (ROOT / dockerfile).read_text()
        args = _parse(service["command"])
        assert callable(args.func), name
        healthcheck = service.get("healthcheck", {}).get("test", [])
        if healthcheck[1:2] == ["tinkerq"]:
            _parse(healthcheck[2:])


def test_workers_mount_the_model_and_checkpoints(compose):
    for name in ("worker", "worker-cpu"):
        service = compose["services"][name]
        args = _parse(service["command"])
        targets = [v.split(":")[-2] if v.endswith((":ro", ":rw")) else v.split(":")[-1] for v in service["volumes"]]
        assert args.model in targets and args.checkpoint_dir in targets
        assert any(v.endswith(f"{args.model}:ro") for v in service["volumes"])  # read-only model
        assert service["environment"]["TINKERQ_BROKER_URL"].startswith("redis://:${REDIS_PASSWORD")
        assert re.fullmatch(r"\d+(m|s)", service["stop_grace_period"])  # time for a warm shutdown


def test_gpu_reservation_is_well_formed(compose):
    devices = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia"
    assert devices[0]["count"] == "all" or int(devices[0]["count"]) >= 1
    assert "gpu" in devices[0]["capabilities"]
    assert "--device" in compose["services"]["worker"]["command"]


def test_sharded_services_form_one_group(compose):
    """Ranks 0..N-1, the same --shards, rendezvous and name, one distinct GPU each, a shared checkpoint volume."""
    shards = {name: s for name, s in compose["services"].items() if "--shards" in s["command"]}
    assert shards, "no sharded services"
    args = {name: _parse(s["command"]) for name, s in shards.items()}
    n = {a.shards for a in args.values()}
    assert len(n) == 1 and sorted(a.rank for a in args.values()) == list(range(n.pop()))
    assert len({a.rendezvous for a in args.values()}) == 1 and len({a.name for a in args.values()}) == 1
    leader = next(name for name, a in args.items() if a.rank == 0)
    host = next(iter(args.values())).rendezvous.removeprefix("tcp://").split(":")[0]
    assert host == leader  # the other ranks reach rank 0 by its service name
    gpus = [d for s in shards.values() for d in s["deploy"]["resources"]["reservations"]["devices"]]
    ids = [i for d in gpus for i in d["device_ids"]]
    assert len(ids) == len(set(ids)) == len(shards) and all(d["driver"] == "nvidia" for d in gpus)
    for name, service in shards.items():
        assert "checkpoints:/checkpoints" in service["volumes"] and args[name].checkpoint_dir == "/checkpoints"
        assert service["profiles"] == ["sharded"]
    assert "healthcheck" in shards[leader]  # it registers; the other ranks do not


def test_healthchecks_are_well_formed(compose):
    for name, service in compose["services"].items():
        if "healthcheck" not in service:
            continue
        check = service["healthcheck"]
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        for key in ("interval", "timeout"):
            assert re.fullmatch(r"\d+(ms|s|m)", check[key]), (name, key)
    assert "healthcheck" in compose["services"]["worker"] and "healthcheck" in compose["services"]["flower"]


def test_every_variable_is_documented(compose_text):
    used = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", compose_text))
    example = (ROOT / ".env.example").read_text()
    documented = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", example, flags=re.M))
    assert used, "no variables found: the check would prove nothing"
    assert used <= documented, f"undocumented in .env.example: {sorted(used - documented)}"
    for var in documented:  # and each has a comment line above it
        assert re.search(rf"#.*\n(#.*\n)*{var}=", example), var


def test_flower_has_auth_and_persistent_state(compose):
    flower = compose["services"]["flower"]
    args = _parse(flower["command"])
    assert args.basic_auth is None and not args.no_auth  # the login comes from the environment
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    assert flower["environment"]["TINKERQ_BROKER_URL"].startswith("redis://:${REDIS_PASSWORD")
    assert args.db.startswith("/data/") and args.address == "0.0.0.0"


def test_no_secret_on_any_command_line(compose):
    """Compose substitutes ${VAR} into commands, and a container's command line is visible to the whole host."""
    for name, service in compose["services"].items():
        command = " ".join(service.get("command", []))
        for secret in ("REDIS_PASSWORD", "FLOWER_BASIC_AUTH"):
            assert "${" + secret not in command, (name, secret)
        assert "--broker" not in command and "--basic-auth" not in command, name


def test_local_launcher_builds_the_same_commands(compose):
    """`tinkerq fleet up` and the tests start workers and Flower through launcher.processes: same subcommands."""
    compose_worker = _parse(compose["services"]["worker-cpu"]["command"])
    local_worker = build_parser().parse_args(processes.worker_command("/models/model", None)[3:])
    assert local_worker.func is compose_worker.func and local_worker.model == compose_worker.model
    assert local_worker.broker is None  # like compose: the broker URL comes from the environment
    compose_flower = _parse(compose["services"]["flower"]["command"])
    local_flower = build_parser().parse_args(processes.flower_command(None, 5555, db=Path("/data/flower.db"))[3:])
    assert local_flower.func is compose_flower.func and local_flower.port == compose_flower.port
    assert local_flower.broker is None and local_flower.basic_auth is None
    assert set(processes.secret_env("redis://:p@h:1/0", "a:b")) == {"TINKERQ_BROKER_URL", "FLOWER_BASIC_AUTH"}


def test_dockerfiles_never_install_pypi_apex():
    for path in (ROOT / "ops").glob("Dockerfile*"):
        for line in path.read_text().splitlines():
            if line.lstrip().startswith("#"):
                continue
            assert not re.search(r"pip install[^\n]*\bapex\b", line), (path, line)
