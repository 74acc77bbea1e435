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


# what the build may not import: pip builds in an isolated environment that has setuptools but none of the
# package's dependencies, so the version must be read from hf_blockbatch/__init__.py without running it
_BUILD = (
    "import sys; sys.modules.update(dict.fromkeys(('torch', 'transformers', 'hf_blockbatch'), None)); "
    "from setuptools import build_meta as b; s = b.build_sdist('dist'); print('BUILT', s, b.build_wheel('dist'))"
)


def _copy_sources(src: Path) -> None:
    """The files that go into the artifacts, copied to ``src`` (the build writes beside them)."""
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        if (ROOT / name).is_file():
            shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(PACKAGE, src / "hf_blockbatch", ignore=ignore)
    shutil.copytree(ROOT / "tests", src / "tests", ignore=ignore)  # as in a clone, where the sdist is built


def _build(src: Path) -> tuple[Path, Path]:
    """The sdist and the wheel setuptools builds in ``src``."""
    run = subprocess.run([sys.executable, "-c", _BUILD], cwd=src, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    sdist_name, wheel_name = next(line for line in run.stdout.splitlines() if line.startswith("BUILT "))[6:].split()
    return src / "dist" / sdist_name, src / "dist" / wheel_name


def _versions(sdist_path: Path, wheel_path: Path) -> tuple[str, str]:
    """The ``Version:`` of the sdist's PKG-INFO and of the wheel's METADATA."""
    with tarfile.open(sdist_path) as tar:
        pkg_info = next(m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
        sdist_meta = tar.extractfile(pkg_info).read().decode()
    with zipfile.ZipFile(wheel_path) as whl:
        wheel_meta = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return tuple(next(line[9:] for line in m.splitlines() if line.startswith("Version: ")) for m in (sdist_meta, wheel_meta))


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The sdist and the wheel built from a copy of this tree."""
    src = tmp_path_factory.mktemp("src")
    _copy_sources(src)
    return _build(src)


@pytest.fixture(scope="module")
def built(artifacts: tuple[Path, Path]) -> tuple[list[str], list[str]]:
    """The member names of the sdist (without its top folder) and of the wheel."""
    sdist_path, wheel_path = artifacts
    with tarfile.open(sdist_path) as tar:
        sdist = [m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()]
    with zipfile.ZipFile(wheel_path) as whl:
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


def test_artifacts_carry_the_package_version(artifacts: tuple[Path, Path]) -> None:
    """The wheel's METADATA and the sdist's PKG-INFO say ``hf_blockbatch.__version__`` (what a clone
    imported without installing reports, and what benchmark runs record)."""
    import hf_blockbatch

    assert _versions(*artifacts) == (hf_blockbatch.__version__, hf_blockbatch.__version__)


def test_the_version_is_written_once(tmp_path: Path) -> None:
    """pyproject.toml and hf_blockbatch/__init__.py both wrote "0.1.0", and nothing kept them in step: a
    bump of one left the other behind. pyproject.toml reads ``__version__``; a copy whose ``__version__``
    is bumped builds artifacts of the bumped version."""
    _copy_sources(tmp_path)
    init = tmp_path / "hf_blockbatch" / "__init__.py"
    text = init.read_text(encoding="utf-8")
    line = next(line for line in text.splitlines() if line.startswith("__version__ = "))
    init.write_text(text.replace(line, '__version__ = "9.8.7"'), encoding="utf-8")
    assert _versions(*_build(tmp_path)) == ("9.8.7", "9.8.7")
