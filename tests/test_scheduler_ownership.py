"""The scheduler is the one owner of request state (issue 29): no module of the worker but worker/core/scheduler.py and
worker/core/ordering.py reads or changes a lane or an ordering. The source is checked: nothing outside them may import
``Lane`` or ``Ordering``, reach a unit of work's lanes, or touch the attributes only lanes and orderings have."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OWNERS = {"worker/core/scheduler.py", "worker/core/ordering.py"}
# Attributes only a Lane or an Ordering has: touched anywhere else, that code decides what the scheduler should.
LANE_STATE = {"lanes", "ordering", "next_seq", "buffered", "unsent", "running", "served", "broken_error",
              "buffered_bytes", "replies", "pop_ready", "drop_buffered", "put_back"}
PRIVATE_TYPES = {"Lane", "Ordering"}

pytestmark = pytest.mark.timeout(60)


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in LANE_STATE:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("tinkerq.worker.core.scheduler",
                                                                                   "tinkerq.worker.core.ordering")):
            found += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name in PRIVATE_TYPES]
    return found


def test_only_the_scheduler_touches_lanes_and_orderings():
    offenders = []
    for folder in ("worker", "tinkerq", "producer", "gateway", "launcher"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel not in OWNERS:
                offenders += [f"{rel}:{o}" for o in _offences(path)]
    assert not offenders, "lane or ordering state touched outside the scheduler:\n" + "\n".join(offenders)


def test_the_check_finds_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from tinkerq.worker.core.scheduler import Lane\n"
                   "def f(slot, service):\n"
                   "    slot.lane.ordering.next_seq = 3\n"
                   "    service.scheduler.lanes.pop('m')\n")
    found = _offences(bad)
    assert any("imports Lane" in o for o in found)
    assert any("next_seq" in o for o in found) and any("scheduler.lanes" in o for o in found)
