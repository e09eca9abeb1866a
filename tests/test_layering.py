"""The architecture is visible and enforced: the core and the producer never import torch."""

from __future__ import annotations

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


@pytest.mark.parametrize("module", ["tinkerq.producer", "tinkerq", "tinkerq.connection", "tinkerq.validation",
                                    "tinkerq.gateway"])
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
