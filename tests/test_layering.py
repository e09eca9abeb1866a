"""The architecture is visible and enforced: the core and the producer never import torch; the gateway drives the
fleet through the producer's public API only; Redis key names come from tinkerq/keys.py only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "tokenizers", "tinkerq.worker", "tinkerq.recipes", "tinkerq.launcher")
# Each package's folder in the repository (pyproject.toml's package-dir) and the packages it must not import.
UPWARD = {"tinkerq": ("tinkerq.producer", "tinkerq.worker", "tinkerq.gateway", "tinkerq.recipes", "tinkerq.launcher"),
          "producer": ("tinkerq.worker", "tinkerq.gateway", "tinkerq.recipes", "tinkerq.launcher"),
          "gateway": ("tinkerq.worker", "tinkerq.recipes", "tinkerq.launcher")}


# tinkerq.operations: the operations registry, read by producer, gateway and worker alike.
@pytest.mark.parametrize("module", ["tinkerq.producer", "tinkerq", "tinkerq.connection", "tinkerq.validation",
                                    "tinkerq.operations", "tinkerq.gateway"])
def test_light_packages_do_not_import_heavy_ones(module):
    code = (
        f"import sys, {module}\n"
        f"bad = sorted(m for m in sys.modules if m.startswith(tuple(p + '.' for p in {HEAVY!r})) or m in {HEAVY!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {module} pulled in: {out.stdout.strip()}"


def test_nothing_imports_upward():
    """tinkerq imports no other package; producer never imports worker; the gateway (a producer) neither (source)."""
    offenders = []
    for folder, forbidden in UPWARD.items():
        for path in (ROOT / folder).rglob("*.py"):
            for line in path.read_text().splitlines():
                stripped = line.strip()
                if not stripped.startswith(("import ", "from ")):
                    continue
                module = stripped.split()[1]
                if module == "tinkerq" and stripped.startswith("from "):  # from tinkerq import producer
                    module += "." + stripped.split()[3].rstrip(",")
                if module in forbidden or module.startswith(tuple(f + "." for f in forbidden)):
                    offenders.append(f"{path.relative_to(ROOT)}: {stripped}")
    assert not offenders, offenders


def _private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``x._name`` where ``x`` is not ``self``/``cls`` (another object's private attribute), and imports of
    underscored names from the producer."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tinkerq.producer"):
            found += [(node.lineno, f"from {node.module} import {alias.name}") for alias in node.names
                      if alias.name.startswith("_")]
    return found


def test_the_gateway_uses_only_the_producers_public_api():
    """gateway/ reaches producer objects (ServiceClient, TrainingClient, SamplingClient, futures) through their
    public names only, and its own objects through ``self``: a private attribute of another object is a seam
    missing from the producer's API (add one there: e.g. TrainingClient.submit / skip)."""
    offenders = [f"gateway/{path.name}:{line}: {text}" for path in sorted((ROOT / "gateway").glob("*.py"))
                 for line, text in _private_uses(ast.parse(path.read_text()))]
    assert not offenders, offenders


def test_the_private_use_check_notices_them():
    code = ("from tinkerq.producer.client import _background\n"
            "def f(self, run):\n    run.client._submit('echo', {})\n    self._ok()\n    return service._open\n")
    assert sorted(text for _, text in _private_uses(ast.parse(code))) == [
        "from tinkerq.producer.client import _background", "run.client._submit", "service._open"]


KEYS_ONLY = ["gateway/*.py", "tinkerq/tenants.py", "tinkerq/quotas.py", "tinkerq/usage.py"]


def _key_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants (f-string parts too) holding a Redis key name, and uses of keys.PREFIX to build one."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "tinkerq:" in node.value:
            found.append((node.lineno, node.value[:80]))
        elif isinstance(node, ast.Attribute) and node.attr == "PREFIX":
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_key_names_come_from_tinkerq_keys():
    """The gateway's records, the tenants' API keys, quotas and usage are named by tinkerq/keys.py's builders, never by
    hand."""
    offenders = [f"{path.relative_to(ROOT)}:{line}: {text!r}" for pattern in KEYS_ONLY
                 for path in sorted(ROOT.glob(pattern))
                 for line, text in _key_literals(ast.parse(path.read_text()))]
    assert not offenders, offenders
    code = 'PREFIX = "tinkerq:gw:"\nkey = f"tinkerq:apikey:{d}"\nother = keys.PREFIX + ":x"\n'
    assert len(_key_literals(ast.parse(code))) == 3


# -- Redis only through the store ---------------------------------------------------------------------------------

# The folders of tinkerq's own code, and the files in them that may speak redis-py, with why. Everything else reaches
# Redis through tinkerq/store.py's primitives (and its records beside their owners). A new exception is a line here.
SOURCE_FOLDERS = ("tinkerq", "producer", "gateway", "worker", "launcher", "recipes")
REDIS_PY_ALLOWED = {
    "tinkerq/store.py": "the store seam itself",
    "tinkerq/redis_client.py": "makes the clients (URLs, TLS, Sentinel) and pings a server being started",
    "tinkerq/connection.py": "opens the store, and turns a failed first ping into a clear error",
    "tinkerq/retry.py": "tells redis-py's transient errors from the others",
    "worker/transport/intake.py": "subclasses kombu's Redis transport (its read path and ack emulation)",
}
# redis-py calls that bypass the store, wherever its client came from.
RAW_CALLS = ("pipeline", "pubsub", "register_script", "execute_command")


def _redis_py_uses(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] == "redis"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "redis" and not node.level:
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Attribute) and node.attr in RAW_CALLS and not (
                isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr == "client" and "store" in ast.unparse(node.value):
            found.append((node.lineno, ast.unparse(node)))  # a RedisStore's client, reached around the store
    return found


def test_redis_is_reached_only_through_the_store():
    offenders = [f"{rel}:{line}: {text}" for folder in SOURCE_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
                 if (rel := str(path.relative_to(ROOT))) not in REDIS_PY_ALLOWED
                 for line, text in _redis_py_uses(ast.parse(path.read_text()))]
    assert not offenders, offenders


def test_the_redis_check_notices_raw_uses():
    code = ("import redis\nfrom redis.exceptions import WatchError\nimport redis.sentinel\n"
            "def f(gw):\n    gw.store.client.get('k')\n    with r.pipeline() as p: pass\n    r.pubsub()\n"
            "    self.pipeline()\n    self.store.publish('c', 'm')\n")
    assert sorted(text for _, text in _redis_py_uses(ast.parse(code))) == sorted([
        "import redis", "from redis.exceptions import ...", "import redis.sentinel", "gw.store.client", "r.pipeline",
        "r.pubsub"])


def test_the_store_is_generic():
    """tinkerq/store.py knows no domain: it imports nothing of tinkerq but the retries, and names no key (each
    domain's records are written on its primitives beside their owner: tenants.py, quotas.py, usage.py, the gateway's
    records, the worker's journal)."""
    tree = ast.parse((ROOT / "tinkerq" / "store.py").read_text())
    imported = sorted({node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                       and (node.module or "").startswith("tinkerq")} |
                      {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
                       if a.name.startswith("tinkerq")})
    assert imported == ["tinkerq.retry"], imported
    assert not _key_literals(tree)


# -- the worker's folders (docs/architecture.md, The worker core) ------------------------------------------------

# The engines below the request path: what a session, a pass, a sampler, a checkpoint or an estimate is. They never
# import the request path (transport, core, recovery) or the planner above them.
ENGINES = ("training", "lora", "sampling", "sharding", "loss_head", "checkpoints", "loading", "memory")
REQUEST_PATH = ("transport", "core", "recovery", "planning")
# Pure decision code: no torch, no Redis, nothing of the worker but its own order.
PURE = {"worker/core/scheduler.py": {"tinkerq.worker.core.ordering"}, "worker/core/ordering.py": set()}


def _worker_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "tinkerq.worker":
                found += [(node.lineno, f"tinkerq.worker.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_worker_engines_do_not_import_the_request_path():
    offenders = []
    for folder in ENGINES:
        for path in sorted((ROOT / "worker" / folder).rglob("*.py")):
            for line, module in _worker_imports(path):
                if module.startswith(tuple(f"tinkerq.worker.{up}" for up in REQUEST_PATH)):
                    offenders.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert not offenders, offenders


def test_the_worker_has_no_loose_modules_beside_its_folders():
    loose = sorted(p.name for p in (ROOT / "worker").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"worker/ modules outside a folder: {loose}"


@pytest.mark.parametrize("rel", sorted(PURE))
def test_the_scheduler_is_pure(rel):
    allowed = PURE[rel]
    bad = [f"{line}: {m}" for line, m in _worker_imports(ROOT / rel)
           if m.split(".")[0] in ("torch", "redis", "celery", "kombu", "transformers")
           or (m.startswith("tinkerq.worker") and m not in allowed)]
    assert not bad, bad


def _plain_threads(tree: ast.AST) -> list[int]:
    """Lines that make a ``threading.Thread`` (or a bare ``Thread``) directly."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Attribute) and node.func.attr == "Thread") or
        (isinstance(node.func, ast.Name) and node.func.id == "Thread"))]


def test_tinkerqs_threads_are_named_threads():
    """Every thread tinkerq starts is a tinkerq.threads.NamedThread, so its OS thread carries its name (top -H,
    ps -T, benchmarks/sampling_threads.py)."""
    offenders = [f"{path.relative_to(ROOT)}:{line}" for folder in SOURCE_FOLDERS
                 for path in sorted((ROOT / folder).rglob("*.py"))
                 for line in _plain_threads(ast.parse(path.read_text()))]
    assert not offenders, offenders
    assert sorted(_plain_threads(ast.parse("import threading\nthreading.Thread(target=f).start()\nThread(target=g)\n"
                                           "NamedThread(f, 'tinkerq-x')\n"))) == [2, 3]
