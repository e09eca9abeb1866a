"""One top-level name: tinkerq installs as `tinkerq` alone, so it neither shadows nor is shadowed by another
distribution's `worker`, `producer`, `launcher`, `recipes` or `gateway` (pyproject.toml's package-dir)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("producer", "worker", "gateway", "recipes", "launcher")  # installed as tinkerq.<folder>

pytestmark = pytest.mark.timeout(300)


def test_the_wheel_installs_everything_under_tinkerq(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("tinkerq", *FOLDERS):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=240)
    (wheel,) = (tmp_path / "dist").glob("tinkerq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"tinkerq", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for folder in FOLDERS:  # every module of each folder is in the wheel, under tinkerq/
        expected = {f"tinkerq/{folder}/{p.relative_to(ROOT / folder).as_posix()}"
                    for p in (ROOT / folder).rglob("*.py") if "data" not in p.parts}
        assert expected <= set(names), sorted(expected - set(names))
    assert "tinkerq/recipes/data/train.jsonl" in names  # the bundled data set ships
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "tinkerq = tinkerq.launcher.main:main" in entry


def test_other_top_level_packages_cannot_shadow_tinkerq(tmp_path: Path):
    """Packages named worker, producer, ... first on sys.path (as another distribution's would be) change
    nothing: tinkerq never imports those names."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text(f"raise RuntimeError('the other {folder} was imported')\n")
    code = ("import tinkerq.producer, tinkerq.worker.core.runtime, tinkerq.gateway.app, tinkerq.launcher.main, "
            "tinkerq.recipes.sft; print(tinkerq.worker.core.runtime.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == ROOT / "worker" / "core" / "runtime.py"
    cli = subprocess.run([sys.executable, "-m", "tinkerq.launcher.main", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(tmp_path)})
    assert cli.returncode == 0 and "fleet" in cli.stdout, cli.stderr


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_folder_imported_by_its_bare_name_says_which_name_to_use(folder: str):
    out = subprocess.run([sys.executable, "-c", f"import {folder}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert f"tinkerq's {folder} package is tinkerq.{folder}: import it by that name" in out.stderr.splitlines()[-1]
