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
    for name in ("worker", "worker-cpu", "flower", "sft", "gateway", "gateway-2"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    # The gateways' proxy is the only way in for SDK users: published on loopback, checked through the gateways'
    # health endpoint; the gateways themselves are not published.
    for name in ("gateway", "gateway-2", "gateway-proxy"):
        assert services[name]["profiles"] == ["gateway"]
        assert "/api/v1/healthz" in " ".join(services[name]["healthcheck"]["test"])
    assert services["gateway-proxy"]["ports"] == ["127.0.0.1:${GATEWAY_PORT:-8000}:8000"]
    assert "ports" not in services["gateway"] and "ports" not in services["gateway-2"]


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
    shards = {name: s for name, s in compose["services"].items() if "--shards" in s.get("command", [])}
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
        # A kept-quantized base is served from one process only: the group dequantizes whatever .env says, and
        # shares the rest of the workers' environment.
        env = service["environment"]
        assert env["TINKERQ_QUANTIZED_BASE"] == "dequantize"
        assert env["TINKERQ_BROKER_URL"] == compose["services"]["worker"]["environment"]["TINKERQ_BROKER_URL"]
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
    local_named = build_parser().parse_args(processes.worker_command("/models/model", None,
                                                                     extra=["--served-name", "org/M"])[3:])
    assert local_named.name == "org/M"  # what `fleet up --served-name` passes; compose passes the same flag
    proxy = build_parser().parse_args(processes.proxy_command(8000, [8001, 8002])[3:])
    assert proxy.listen == "127.0.0.1:8000" and proxy.backend == ["127.0.0.1:8001", "127.0.0.1:8002"]


def _nginx_blocks(text: str) -> dict[str, list[str]]:
    """The directives of ops/nginx-gateways.conf by the block they are in ("" for the top level, "upstream NAME",
    "server", "location /"), comments dropped."""
    blocks: dict[str, list[str]] = {"": []}
    stack = [""]
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.endswith("{"):
            stack.append(line[:-1].strip())
            blocks.setdefault(stack[-1], [])
        elif line == "}":
            stack.pop()
        elif line:
            blocks[stack[-1]].append(line.rstrip(";"))
    assert stack == [""], "unbalanced braces"
    return blocks


def _seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h)?", value).groups()  # type: ignore[union-attr]
    return int(number) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[unit]


def test_gateways_behind_a_round_robin_proxy(compose):
    """`--profile gateway`: two identical stateless gateways behind nginx, which sends each request to the next
    one in turn (its default), around one that refuses, and waits out the SDK's 45 s long polls."""
    services = compose["services"]
    gateways = {name: s for name, s in services.items() if "build" in s and _parse(s["command"]).func.__name__ ==
                "cmd_gateway"}
    assert set(gateways) == {"gateway", "gateway-2"}
    assert gateways["gateway"] == gateways["gateway-2"]  # one definition (a YAML anchor): any may serve any request
    port = _parse(gateways["gateway"]["command"]).port
    proxy = services["gateway-proxy"]
    image, version = proxy["image"].split(":")
    assert image == "nginx" and tuple(map(int, version.split("-")[0].split("."))) >= (1, 27, 3)  # `resolve`
    assert proxy["volumes"] == ["./ops/nginx-gateways.conf:/etc/nginx/conf.d/default.conf:ro"]
    assert {name: d["condition"] for name, d in proxy["depends_on"].items()} == dict.fromkeys(gateways,
                                                                                             "service_healthy")

    blocks = _nginx_blocks((ROOT / "ops" / "nginx-gateways.conf").read_text())
    (upstream,) = [b for b in blocks if b.startswith("upstream ")]
    servers = [d.split()[1] for d in blocks[upstream] if d.startswith("server ")]
    assert sorted(servers) == sorted(f"{name}:{port}" for name in gateways)
    assert all(d.split()[-1] == "resolve" for d in blocks[upstream] if d.startswith("server "))
    assert any(d.startswith("resolver 127.0.0.11") for d in blocks[""])  # Docker's DNS, for `resolve`
    balancing = {"hash", "ip_hash", "least_conn", "least_time", "random", "sticky"}
    assert not [d for d in blocks[upstream] if d.split()[0] in balancing]  # round robin
    listen = [d.split()[1] for d in blocks["server"] if d.startswith("listen ")]
    assert listen == [proxy["ports"][0].rsplit(":", 1)[1]]
    location = dict(d.split(None, 1) for d in blocks["location /"])
    assert location["proxy_pass"] == f"http://{upstream.split()[1]}"
    assert _seconds(location["proxy_read_timeout"]) >= 60 and _seconds(location["proxy_send_timeout"]) >= 60
    assert "non_idempotent" not in location["proxy_next_upstream"]  # a POST a gateway received is never resent
    assert location["client_max_body_size"] == "0"  # the gateway's own limit applies, not nginx's 1 MB


def test_workers_are_served_under_one_configurable_name(compose):
    """TINKERQ_SERVED_NAME reaches every worker of the model as --served-name (`tinkerq worker --name`'s
    spelling in `tinkerq fleet up`), defaulting to the model's directory, which was the name before."""
    for name in ("worker", "worker-cpu", "sampler"):
        args = _parse(compose["services"][name]["command"])
        assert args.name == "VALUE", name
        assert "--served-name" in compose["services"][name]["command"]
        assert "${TINKERQ_SERVED_NAME:-/models/model}" in compose["services"][name]["command"]


def test_dockerfiles_never_install_pypi_apex():
    for path in (ROOT / "ops").glob("Dockerfile*"):
        for line in path.read_text().splitlines():
            if line.lstrip().startswith("#"):
                continue
            assert not re.search(r"pip install[^\n]*\bapex\b", line), (path, line)
