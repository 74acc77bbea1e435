"""Every script under ``benchmarks/`` imports: a script that RESULTS.md or a doc quotes must not fail on its first
line after a refactor moves what it imports (``localleap_tiny.py`` imported a module the decoding core's
refactor into parts had removed).
What each script computes is tested beside the library part it measures."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_benchmark

SCRIPTS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def test_the_scripts_are_found() -> None:
    assert {"paper_table", "policy_overhead", "localleap_tiny", "window_schedule_probe"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_script_imports_and_has_a_main(name: str) -> None:
    module = load_benchmark(name)
    assert callable(getattr(module, "main", None)), f"benchmarks/{name}.py has no main()"
