"""A/B against an earlier commit in one run: that commit's tinkerq, importable by a worker process of this venv.

``baseline_env(rev, folder)`` extracts ``rev`` with ``git archive`` into ``folder``, lays its folders out as the
installed packages (pyproject.toml's ``package-dir``: ``worker/`` becomes ``tinkerq/worker`` ...), and returns the
environment a child process needs to import that tree instead of the current one: ``PYTHONPATH`` naming a folder
whose ``sitecustomize`` puts a finder for ``tinkerq`` first and drops the current tree's editable finder (the
repository root a worker starts in would otherwise shadow it too). The venv's packages (torch, transformers,
celery, ...) are shared, so only tinkerq's own code differs between the two sides.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent

_SITECUSTOMIZE = '''\
# Written by benchmarks/_baseline.py: import tinkerq from this folder, not from the current tree.
import os
import sys
from importlib.machinery import PathFinder

_HERE = os.path.dirname(os.path.abspath(__file__))


class _ThisTree:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return PathFinder.find_spec(name, [_HERE]) if name == "tinkerq" else None


sys.meta_path[:] = [_ThisTree, *(f for f in sys.meta_path if "editable" not in type(f).__name__.lower())]
for _name in [m for m in sys.modules if m == "tinkerq" or m.startswith("tinkerq.")]:
    del sys.modules[_name]
'''


def baseline_env(rev: str, folder: Path) -> dict[str, str]:
    """The environment of a child process that runs commit ``rev``'s tinkerq (extracted below ``folder``; its
    whole tree, benchmarks included, is in ``folder / "source"``)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    source = folder / "source"
    source.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    package_dirs = tomllib.loads((source / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    layout = folder / "site"
    for package, directory in sorted(package_dirs.items()):  # "tinkerq" first, then its subpackages
        shutil.copytree(source / directory, layout / package.replace(".", "/"), dirs_exist_ok=True)
    (layout / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    check = subprocess.run([sys.executable, "-c", "import tinkerq.worker; print(tinkerq.worker.__file__)"],
                           env={"PYTHONPATH": str(layout)}, cwd=ROOT, capture_output=True, text=True)
    if not check.stdout.startswith(str(layout)):
        raise RuntimeError(f"the baseline tree at {layout} is not what a child imports: {check.stdout}{check.stderr}")
    return {"PYTHONPATH": str(layout)}
