"""The package as users install it: the sdist and the wheel setuptools builds from this tree.

Everything else runs against the editable install, which reads the checkout itself; these build both
artifacts (about 2 s, in a copy of the files that go into them) and read what they hold.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_blockbatch"


def _build_requirement_unmet() -> str | None:
    """Why this interpreter's setuptools cannot build the package (``build-system.requires``), or None."""
    try:
        import setuptools
        import tomllib
        from packaging.requirements import Requirement
    except ImportError as err:
        return f"cannot check the build requirement: {err}"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["build-system"]["requires"]
    need = next(Requirement(r) for r in requires if Requirement(r).name == "setuptools")
    if not need.specifier.contains(setuptools.__version__):
        return f"setuptools {setuptools.__version__} does not meet the build requirement {need}"
    return None


pytestmark = pytest.mark.skipif(_build_requirement_unmet() is not None, reason=str(_build_requirement_unmet()))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[str]]:
    """The member names of the sdist (without its top folder) and of the wheel."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        if (ROOT / name).is_file():
            shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(PACKAGE, src / "hf_blockbatch", ignore=ignore)
    shutil.copytree(ROOT / "tests", src / "tests", ignore=ignore)  # as in a clone, where the sdist is built
    code = "from setuptools import build_meta as b; s = b.build_sdist('dist'); print('BUILT', s, b.build_wheel('dist'))"
    run = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    sdist_name, wheel_name = next(line for line in run.stdout.splitlines() if line.startswith("BUILT "))[6:].split()
    with tarfile.open(src / "dist" / sdist_name) as tar:
        sdist = [m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()]
    with zipfile.ZipFile(src / "dist" / wheel_name) as whl:
        wheel = whl.namelist()
    return sdist, wheel


def _package_files() -> list[str]:
    return sorted(
        p.relative_to(ROOT).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def test_wheel_and_sdist_carry_the_whole_package(built: tuple[list[str], list[str]]) -> None:
    """Every file of hf_blockbatch/, the tiny checkpoints load_model opens among them (weights, config,
    tokenizer, chat template), reaches both artifacts; so do the licence and the README."""
    files = _package_files()
    assert "hf_blockbatch/assets/tiny-llada/model.safetensors" in files
    assert "hf_blockbatch/assets/tiny-dream/tokenizer.json" in files
    sdist, wheel = built
    assert [f for f in files if f not in wheel] == []
    assert [f for f in files if f not in sdist] == []
    assert {"LICENSE", "README.md", "pyproject.toml"} <= set(sdist)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel)
    assert any(n.endswith(".dist-info/entry_points.txt") for n in wheel)  # the hf-blockbatch command


def test_sdist_ships_no_tests_it_cannot_run(built: tuple[list[str], list[str]]) -> None:
    """setuptools' default put tests/test*.py alone in the sdist, without conftest.py, their helpers, their
    data and the docs, demo and scripts they read: 25 of the 38 files failed to import. The tests run from a
    clone (README); the sdist carries none, and nothing outside the package beside its metadata."""
    sdist, wheel = built
    assert [n for n in sdist if n.startswith("tests/")] == []
    top = {n.split("/", 1)[0] for n in sdist} - {"PKG-INFO", "setup.cfg", "hf_blockbatch.egg-info"}  # metadata
    assert top == {"hf_blockbatch", "LICENSE", "README.md", "pyproject.toml", "MANIFEST.in"}
    assert {n.split("/", 1)[0].split("-", 1)[0] for n in wheel} == {"hf_blockbatch"}  # and its dist-info
