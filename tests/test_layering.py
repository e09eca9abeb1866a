"""The architecture is visible and enforced: the core and the producer never import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "tokenizers", "worker", "recipes", "launcher")


@pytest.mark.parametrize("module", ["producer", "tinkerq", "tinkerq.connection", "tinkerq.validation", "gateway"])
def test_light_packages_do_not_import_heavy_ones(module):
    code = (
        f"import sys, {module}\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {module} pulled in: {out.stdout.strip()}"


def test_nothing_imports_upward():
    """tinkerq imports no other package; producer never imports worker; the gateway (a producer) neither (source)."""
    rules = {"tinkerq": ("producer", "worker", "gateway", "recipes", "launcher"),
             "producer": ("worker", "gateway", "recipes", "launcher"),
             "gateway": ("worker", "recipes", "launcher")}
    offenders = []
    for package, forbidden in rules.items():
        for path in (ROOT / package).rglob("*.py"):
            for line in path.read_text().splitlines():
                stripped = line.strip()
                if stripped.startswith(("import ", "from ")) and stripped.split()[1].split(".")[0] in forbidden:
                    offenders.append(f"{path.relative_to(ROOT)}: {stripped}")
    assert not offenders, offenders
