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


def shell_blocks(text: str) -> list[str]:
    """The fenced blocks of a Markdown text that hold shell (```bash, ```sh or a bare ```), continued lines joined.
    Fences are paired line by line: a regex over the text pairs a closing fence with the next opening one."""
    blocks, current, shell = [], None, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is None:
                current, shell = [], line.strip()[3:].strip() in ("", "bash", "sh", "shell", "console")
            else:
                if shell:
                    blocks.append("\n".join(current).replace("\\\n", " "))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def quoted_commands() -> list[tuple[str, str, list[str]]]:
    """``(where, script, arguments)`` of every ``python benchmarks/<script>.py ...`` the docs quote: in fenced shell
    blocks (continued lines joined, ``NAME="..."`` assignments of the block expanded) and in inline code. A command
    that still holds a shell variable or an ellipsis is prose about a command, not one to run."""
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        prose = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("```"))
        inline = re.findall(r"`([^`\n]*python benchmarks/[^`\n]*)`", prose)
        for block in [*shell_blocks(text), *inline]:
            env: dict[str, str] = {}
            for line in block.splitlines():
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


def quoted_cli_commands() -> list[tuple[str, list[str]]]:
    """``(where, arguments)`` of every ``hf-blockbatch generate|bench|demo ...`` in the docs' fenced shell blocks
    (``docs/bad_inputs.md`` quotes wrong ones on purpose), continued lines joined."""
    found = []
    for doc in DOCS:
        if doc.name == "bad_inputs.md":
            continue
        for block in shell_blocks(doc.read_text(encoding="utf-8")):
            for line in block.splitlines():
                if not (m := re.search(r"hf-blockbatch ((?:generate|bench|demo)\b.*)", line.split(" #")[0])):
                    continue
                rest = re.split(r"&&|\||;|>", m.group(1))[0]
                if any(c in rest for c in ("$", "...", "…", "<", "`")):  # a placeholder, or prose in a bare fence
                    continue
                found.append((f"{doc.relative_to(ROOT)}: {line.strip()[:60]}", shlex.split(rest)))
    return found


CLI_COMMANDS = quoted_cli_commands()


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


def test_the_docs_quote_cli_commands() -> None:
    assert len(CLI_COMMANDS) >= 10 and {"generate", "bench"} <= {args[0] for _, args in CLI_COMMANDS}


@pytest.mark.parametrize(("where", "args"), CLI_COMMANDS, ids=[f"cli-{i}" for i in range(len(CLI_COMMANDS))])
def test_the_cli_commands_the_docs_quote_parse(capsys, where: str, args: list[str]) -> None:
    from hf_blockbatch.cli import build_parser

    try:
        build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: {capsys.readouterr().err.strip().splitlines()[-1]}")
