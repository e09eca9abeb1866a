"""API keys of the gateway's tenants (tinkerq/tenants.py) and `tinkerq keys`, against a private redis-server."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tinkerq import keys
from tinkerq.errors import BrokerUnavailableError, UserError, ValidationError
from tinkerq.launcher.processes import ROOT, free_port
from tinkerq.quotas import Limits
from tinkerq.settings import Settings
from tinkerq.store import MemoryStore, RedisStore
from tinkerq.tenants import ApiKeys, check_tenant_name

pytestmark = pytest.mark.timeout(120)

TINKERQ = Path(sys.executable).parent / "tinkerq"  # the console script of this venv


def _name(base: str = "alice") -> str:
    return f"{base}-{uuid.uuid4().hex[:8]}"  # the Redis is shared by the session: names never collide


@pytest.fixture
def api_keys(redis_url: str) -> Iterator[ApiKeys]:
    ak = ApiKeys.open(Settings(broker_url=redis_url))
    yield ak
    ak.close()


def _offline(retry_s: float = 0.0) -> ApiKeys:
    """ApiKeys over a Redis that is not there: any call that reaches Redis raises BrokerUnavailableError."""
    client = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5)
    return ApiKeys(RedisStore(client), retry_s=retry_s)


def test_create_authenticate_list_revoke(api_keys: ApiKeys):
    name = _name()
    key = api_keys.create(name)
    assert key.startswith("tml-") and len(key) == 4 + 43  # token_urlsafe(32): 43 characters
    assert api_keys.authenticate(key) == name
    listed = {t["name"]: t for t in api_keys.list()}
    assert set(listed[name]) == {"name", "created_at", "last_used_at", "limits"}  # never the key or its digest
    assert listed[name]["limits"] == Limits()  # none unless given
    assert listed[name]["created_at"] > 0 and listed[name]["last_used_at"] is not None  # authenticate noted it
    assert api_keys.revoke(name) is True
    assert api_keys.authenticate(key) is None
    assert name not in {t["name"] for t in api_keys.list()}
    assert api_keys.revoke(name) is False  # nothing left to revoke


def test_last_used_is_none_until_the_key_is_used(api_keys: ApiKeys):
    name = _name("unused")
    key = api_keys.create(name)
    assert next(t for t in api_keys.list() if t["name"] == name)["last_used_at"] is None
    api_keys.authenticate(key)
    assert next(t for t in api_keys.list() if t["name"] == name)["last_used_at"] is not None
    api_keys.revoke(name)


def test_a_name_with_a_live_key_is_refused_until_revoked(api_keys: ApiKeys):
    name = _name()
    first = api_keys.create(name)
    with pytest.raises(UserError, match="revoke it first"):
        api_keys.create(name)
    assert api_keys.authenticate(first) == name  # the refused create changed nothing
    api_keys.revoke(name)
    second = api_keys.create(name)
    assert second != first
    assert api_keys.authenticate(first) is None and api_keys.authenticate(second) == name
    api_keys.revoke(name)


@pytest.mark.parametrize("bad", ["", "a" * 65, "has space", "semi;colon", "a/b", "ünï", "x\n", ".", "..", "a:b", 7,
                                 None])
def test_bad_tenant_names_are_refused(api_keys: ApiKeys, bad):
    with pytest.raises(ValidationError, match="tenant name"):
        api_keys.create(bad)
    assert api_keys.revoke(bad) is False


@pytest.mark.parametrize("good", ["a", "a" * 64, "team-a.prod_1", "A.b-C_9", ".hidden"])
def test_good_tenant_names_are_accepted(good):
    assert check_tenant_name(good) == good


def test_unknown_random_and_malformed_keys_are_none(api_keys: ApiKeys):
    assert api_keys.authenticate("tml-" + secrets.token_urlsafe(32)) is None  # well-formed, unknown


@pytest.mark.parametrize("bad", [None, "", "tml-", "abc", "tml-short", "TML-" + "a" * 43, "tml-" + "a" * 43 + "\n",
                                 "tml-" + "a" * 43 + " ", "tml-" + "a" * 20 + "!" + "a" * 20, "tml-" + "a" * 1_000_000,
                                 b"tml-" + b"a" * 43, 12])
def test_malformed_keys_are_none_without_asking_redis(bad):
    # An offline store: reaching Redis would raise, so None here means the key was refused before hashing.
    assert _offline().authenticate(bad) is None


def test_an_unreachable_redis_is_an_error_not_a_missing_key():
    with pytest.raises(BrokerUnavailableError):
        _offline(retry_s=0.2).authenticate("tml-" + secrets.token_urlsafe(32))


def _everything_in(client: redis.Redis) -> bytes:
    """Every key name and value in the database, as one blob (read by type, never DUMP, which may compress)."""
    parts: list[bytes] = []
    for name in client.scan_iter(count=1000):
        parts.append(name)
        kind = client.type(name).decode()
        if kind == "string":
            parts.append(client.get(name) or b"")
        elif kind == "hash":
            for k, v in client.hgetall(name).items():
                parts += [k, v]
        elif kind == "list":
            parts += client.lrange(name, 0, -1)
        elif kind == "set":
            parts += list(client.smembers(name))
        elif kind == "zset":
            parts += [m for m, _ in client.zrange(name, 0, -1, withscores=True)]
        elif kind == "stream":
            parts += [repr(e).encode() for e in client.xrange(name)]
    return b"\n".join(parts)


def test_redis_never_holds_a_key(api_keys: ApiKeys, redis_url: str):
    made = {}
    for _ in range(5):
        name = _name("stored")
        made[name] = api_keys.create(name)
        assert api_keys.authenticate(made[name]) == name  # also writes last_used_at
    revoked = next(iter(made))
    api_keys.revoke(revoked)
    blob = _everything_in(redis.Redis.from_url(redis_url))
    assert keys.TENANTS.encode() in blob  # the scan did see the tenants' records
    for key in made.values():
        assert key.encode() not in blob and key[4:].encode() not in blob


def test_concurrent_creates_of_one_name_let_exactly_one_win(redis_url: str):
    name = _name("race")
    client = redis.Redis.from_url(redis_url)
    stores = [ApiKeys(RedisStore(client)) for _ in range(12)]
    barrier = threading.Barrier(len(stores))
    won: list[str] = []
    refused: list[Exception] = []

    def create(ak: ApiKeys) -> None:
        barrier.wait()
        try:
            won.append(ak.create(name))
        except UserError as exc:
            refused.append(exc)

    threads = [threading.Thread(target=create, args=(ak,)) for ak in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(won) == 1 and len(refused) == len(stores) - 1
    assert all("revoke it first" in str(exc) for exc in refused)
    assert stores[0].authenticate(won[0]) == name
    assert client.hlen(keys.TENANTS) >= 1 and len([t for t in stores[0].list() if t["name"] == name]) == 1
    stores[0].revoke(name)
    client.close()


def test_a_cache_keeps_only_good_answers_and_is_cleared_by_its_own_revoke(redis_url: str):
    settings = Settings(broker_url=redis_url)
    cached, other = ApiKeys.open(settings, cache_s=60), ApiKeys.open(settings)
    try:
        name = _name("cached")
        key = "tml-" + secrets.token_urlsafe(32)
        assert cached.authenticate(key) is None  # a miss is not cached...
        key = other.create(name)
        assert cached.authenticate(key) == name  # ...so a new key works at once
        other.revoke(name)
        assert other.authenticate(key) is None
        assert cached.authenticate(key) == name  # documented: up to cache_s in another process
        other.create(name)
        cached.revoke(name)
        assert cached.authenticate(key) is None  # its own revoke takes effect at once
    finally:
        cached.close()
        other.close()


def test_the_memory_store_keeps_keys_as_redis_does():
    """The store seam's in-memory side: the same answers as Redis for every call ApiKeys makes."""
    ak = ApiKeys(MemoryStore())
    key = ak.create("mem")
    with pytest.raises(UserError, match="revoke it first"):
        ak.create("mem")
    assert [t["name"] for t in ak.list()] == ["mem"] and ak.list()[0]["last_used_at"] is None
    assert ak.authenticate(key) == "mem" and ak.list()[0]["last_used_at"] is not None
    assert ak.update_limits("mem", {"keep_checkpoints": 2}) == Limits(keep_checkpoints=2) == ak.list()[0]["limits"]
    assert ak.revoke("mem") is True and ak.revoke("mem") is False
    assert ak.authenticate(key) is None and ak.list() == []


def test_the_embedded_fleet_has_no_keys():
    from tinkerq.connection import Connection

    conn = Connection.open(Settings(broker_url="memory://"))
    try:
        with pytest.raises(UserError, match="TINKERQ_BROKER_URL"):
            ApiKeys.from_connection(conn)
    finally:
        conn.close()
    with pytest.raises(UserError, match="TINKERQ_BROKER_URL"):
        ApiKeys.open(Settings(broker_url=None))


def test_tenants_imports_nothing_heavy():
    code = ("import sys, tinkerq.tenants\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'producer', 'worker', 'gateway', 'launcher', 'recipes', 'celery'))))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# -- the command line ----------------------------------------------------------------------------------------

def _cli(*args: str, broker_env: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TINKERQ_BROKER_URL"}
    if broker_env:
        env["TINKERQ_BROKER_URL"] = broker_env
    return subprocess.run([str(TINKERQ), *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)


def test_cli_create_list_revoke(redis_url: str):
    name = _name()
    out = _cli("keys", "create", name, "--broker", redis_url)
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip().splitlines()[-1]
    assert key.startswith("tml-") and key == key.strip() and len(key) == 47
    assert name in out.stdout.splitlines()[0]  # a human line first
    client = redis.Redis.from_url(redis_url)
    ak = ApiKeys(RedisStore(client))
    assert ak.authenticate(key) == name
    assert key.encode() not in _everything_in(client)

    again = _cli("keys", "--broker", redis_url, "create", name)  # --broker before the subcommand works too
    assert again.returncode == 2 and "revoke it first" in again.stderr and "tml-" not in again.stdout

    listed = _cli("keys", "list", broker_env=redis_url)  # the broker from TINKERQ_BROKER_URL
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:2] == ["NAME", "CREATED"]
    assert any(line.split()[0] == name for line in lines[1:]) and "tml-" not in listed.stdout

    revoked = _cli("keys", "revoke", name, "--broker", redis_url)
    assert revoked.returncode == 0 and name in revoked.stdout
    assert ak.authenticate(key) is None
    listed = _cli("keys", "list", "--broker", redis_url)
    assert listed.returncode == 0 and name not in listed.stdout

    missing = _cli("keys", "revoke", name, "--broker", redis_url)
    assert missing.returncode == 1 and "has no API key" in missing.stderr and "Traceback" not in missing.stderr
    client.close()


def _limits_listed(listing: str, name: str) -> list[str]:
    lines = listing.splitlines()
    assert lines[0].split()[-4:] == ["TRAINING", "SAMPLING", "TOKENS/MIN", "KEEP"]
    return next(line.split()[-4:] for line in lines[1:] if line.split()[0] == name)


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`tinkerq ARGS` in this process (the console script itself is run by the test before: seconds each)."""
    from tinkerq.launcher.main import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_limits_create_update_list(redis_url: str, capsys: pytest.CaptureFixture[str]):
    name = _name("limited")
    out = _cli("keys", "create", name, "--max-training-clients", "2", "--max-tokens-per-minute", "60000",
               "--broker", redis_url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].startswith("tml-")  # the key still alone on the last line
    assert "max_training_clients=2, max_tokens_per_minute=60000" in out.stdout
    code, listed, _ = _main(capsys, "keys", "list", "--broker", redis_url)
    assert code == 0 and _limits_listed(listed, name) == ["2", "-", "60000", "-"]

    code, said, err = _main(capsys, "keys", "update", name, "--max-training-clients", "none", "--keep-checkpoints",
                            "5", "--max-sampling-inflight", "8", "--broker", redis_url)
    assert code == 0, err
    assert "max_sampling_inflight=8, max_tokens_per_minute=60000, keep_checkpoints=5" in said
    code, listed, _ = _main(capsys, "keys", "list", "--broker", redis_url)
    assert _limits_listed(listed, name) == ["-", "8", "60000", "5"]
    client = redis.Redis.from_url(redis_url)
    after = Limits(max_sampling_inflight=8, max_tokens_per_minute=60_000, keep_checkpoints=5)
    assert ApiKeys(RedisStore(client)).limits(name) == after

    refused = _name("refused")
    for command, target, value in (("update", name, "0"), ("update", name, "-2"), ("create", refused, "0")):
        code, said, err = _main(capsys, "keys", command, target, "--keep-checkpoints", value, "--broker", redis_url)
        assert code == 2 and "tml-" not in said
        assert err.strip() == (f"tinkerq keys: [user error] --keep-checkpoints must be at least 1, got {value}: "
                               f"to remove the limit instead, pass --keep-checkpoints none")
    assert ApiKeys(RedisStore(client)).limits(name) == after  # unchanged
    assert refused not in {t["name"] for t in ApiKeys(RedisStore(client)).list()}  # the refused create made no key

    code, _, err = _main(capsys, "keys", "update", _name("nobody"), "--keep-checkpoints", "3", "--broker", redis_url)
    assert code == 2 and "has no API key" in err
    code, _, err = _main(capsys, "keys", "update", name, "--broker", redis_url)
    assert code == 2 and "no limit to change" in err
    ApiKeys(RedisStore(client)).revoke(name)
    client.close()


def test_cli_says_what_to_do_without_a_broker_or_with_a_bad_name(redis_url: str):
    out = _cli("keys", "list")
    assert out.returncode == 2 and "TINKERQ_BROKER_URL" in out.stderr and "Traceback" not in out.stderr
    out = _cli("keys", "create", "no spaces", "--broker", redis_url)
    assert out.returncode == 2 and "tenant name" in out.stderr and "tml-" not in out.stdout


def test_cli_gateway_help_needs_no_gateway_module():
    out = _cli("gateway", "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: tinkerq gateway" in out.stdout and "--port" in out.stdout and "--host" in out.stdout
    out = _cli("gateway")  # no broker: refused before the gateway module is imported
    assert out.returncode == 2 and "TINKERQ_BROKER_URL" in out.stderr
