"""Every script under ``benchmarks/`` imports: a script that RESULTS.md or a doc quotes must not fail on its first
line after a refactor moves what it imports (``localleap_tiny.py`` imported a module the decoding core's
refactor into parts had removed).
What each script computes is tested beside the library part it measures."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
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


ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "model_cards").glob("*.md"))]  # fmt: skip


def quoted_commands() -> list[tuple[str, str, list[str]]]:
    """``(where, script, arguments)`` of every ``python benchmarks/<script>.py ...`` the docs quote: in fenced shell
    blocks (continued lines joined, ``NAME="..."`` assignments of the block expanded) and in inline code. A command
    that still holds a shell variable or an ellipsis is prose about a command, not one to run."""
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        fenced = re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S)
        inline = re.findall(r"`([^`\n]*python benchmarks/[^`\n]*)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for block in [*fenced, *inline]:
            env: dict[str, str] = {}
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if m := re.fullmatch(r'([A-Z0-9_]+)="([^"]*)"', line):
                    env[m.group(1)] = m.group(2)
                    continue
                for name, value in env.items():
                    line = line.replace(f"${name}", value)
                if not (m := re.search(r"python benchmarks/(\w+)\.py(.*)", line)):
                    continue
                rest = re.split(r"&&|\||;|>", m.group(2))[0]
                if "$" in rest.replace("$PWD", "") or "..." in rest or "…" in rest:
                    continue
                found.append((f"{doc.relative_to(ROOT)}: {line[:60]}", m.group(1), shlex.split(rest)))
    return found


COMMANDS = quoted_commands()


class _Parsed(Exception):
    """Raised once a script's arguments are parsed: the test stops there, before any work."""


def test_the_docs_quote_benchmark_commands() -> None:
    assert len(COMMANDS) >= 40 and {"window_schedule_probe", "localleap_tiny", "policy_overhead"} <= {c[1] for c in COMMANDS}


@pytest.mark.parametrize(("where", "script", "args"), COMMANDS, ids=[f"{c[1]}-{i}" for i, c in enumerate(COMMANDS)])
def test_the_commands_the_docs_quote_parse(monkeypatch, capsys, where: str, script: str, args: list[str]) -> None:
    """Every quoted command's options still exist (a renamed option would leave the docs' command failing),
    checked by the script's own parser; nothing runs past it."""
    module = load_benchmark(script)
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        raise _Parsed(real(self, argv, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    with pytest.raises(_Parsed):
        try:
            module.main()
        except SystemExit:
            pytest.fail(f"{where}: {capsys.readouterr().err.strip().splitlines()[-1]}")
