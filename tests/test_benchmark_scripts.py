"""Every script under ``benchmarks/`` imports: a script that RESULTS.md or a doc quotes must not fail on its first
line after a refactor moves what it imports (``localleap_tiny.py`` imported a module the decoding core's
refactor into parts had removed).
What each script computes is tested beside the library part it measures."""

from __future__ import annotations

import argparse
import json
import os
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



@pytest.mark.parametrize("script", SCRIPTS)
def test_the_options_a_script_s_docstring_names_exist(monkeypatch, script: str) -> None:
    """Every ``--option`` a script's module docstring names in code (outside a span naming another script, e.g.
    ``beyond_paper.py --split test``) is one of its parser's options: reference_side_by_side.py documented a
    ``--float32`` it does not take (only ``--no-float32``)."""
    module = load_benchmark(script)
    spans = re.findall(r"``(.*?)``", module.__doc__ or "", flags=re.S)
    named = {f for span in spans if not re.search(r"\w\.py\b", span) for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", span)}
    if not named:
        return

    def parse_then_stop(self, argv=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [f"{script}.py"])
    with pytest.raises(_Parsed) as parsed:
        module.main()
    assert sorted(named - set(parsed.value.args[0]._option_string_actions)) == []

def test_the_docs_quote_cli_commands() -> None:
    assert len(CLI_COMMANDS) >= 10 and {"generate", "bench"} <= {args[0] for _, args in CLI_COMMANDS}


@pytest.mark.parametrize(("where", "args"), CLI_COMMANDS, ids=[f"cli-{i}" for i in range(len(CLI_COMMANDS))])
def test_the_cli_commands_the_docs_quote_parse(capsys, where: str, args: list[str]) -> None:
    from hf_blockbatch.cli import build_parser

    try:
        build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: {capsys.readouterr().err.strip().splitlines()[-1]}")


# --------------------------------------------------------------------------------------------- bad input
#: ``(id, script, arguments, what the one error line says)``: bad values each script refuses in one line with exit
#: status 2, before any model loads. ``{tmp}`` is the test's folder, which holds ``a_file`` (a file),
#: ``list.json`` (``[1, 2]``), ``five.json`` (``{"mine": 5}``), ``not_json.json`` and ``bench/summary.json`` (not JSON),
#: ``ref.json`` (a ``--config-file`` of one reference-variant BlockBatch, blocks 16, 32 and 64).
BAD_INPUTS = [
    ("entropy-bound-hang", "commit_rules_probe", ["--rules", "entropy:-0.5"], "entropy bound (nats) must be >= 0"),
    ("threshold-above-1", "commit_rules_probe", ["--rules", "threshold:1.5"], "threshold must be in [0, 1]"),
    ("tau-back-0", "commit_rules_probe", ["--tau-back", "0"], "--tau-back: must be in (0, 1]"),
    ("block-negative", "commit_rules_probe", ["--block", "-4"], "--block: must be >= 1, got -4"),
    ("device-unknown", "commit_rules_probe", ["--device", "nosuch"], "not a torch device: 'nosuch'"),
    ("split-unknown", "window_schedule_probe", ["--split", "nosuch"], "invalid choice: 'nosuch'"),
    ("items-negative", "localleap_tiny", ["--items", "-3"], "--items: must be >= 1, got -3"),
    ("block-0", "draft_misses", ["--block", "0"], "--block: must be >= 1, got 0"),
    ("suite-unknown", "draft_misses", ["--suites", "arithh"], "--suites: invalid choice: 'arithh'"),
    ("suite-unknown", "window_schedule_probe", ["--suites", "arith", "arithh"], "--suites: invalid choice: 'arithh'"),
    ("suite-real-for-training", "lookahead_shapes", ["--suites", "gsm8k"], "--suites: invalid choice: 'gsm8k'"),
    ("suite-unknown", "beyond_paper", ["--suites", "code", "gsm8kk"], "--suites: invalid choice: 'gsm8kk'"),
    ("limit-0", "draft_rankings", ["--limit", "0"], "--limit: must be >= 1, got 0"),
    ("threads-0", "lookahead_shapes", ["--threads", "0"], "--threads: must be >= 1, got 0"),
    ("temperature-0", "keyed_draw", ["--temperatures", "0"], "--temperatures: must be > 0"),
    ("items-0", "noise_designs", ["--items", "0"], "--items: must be >= 1, got 0"),
    ("bandwidth-0", "gpu_projection", ["--bandwidth", "0"], "--bandwidth: must be > 0"),
    ("config-file-entry", "gpu_projection", ["--config-file", "{tmp}/five.json"], "entry 'mine' is 5, not a config"),
    ("config-file-list", "beyond_paper", ["--config-file", "{tmp}/list.json"], "list.json: holds an array"),
    ("config-file-missing", "beyond_paper", ["--config-file", "{tmp}/none.json"], "none.json: no such file"),
    ("rounds-0", "beyond_paper", ["--rounds", "0"], "--rounds: must be >= 1, got 0"),
    # valid at lists' 64 tokens, not at arith's 96: was refused after loading the model (at a length of 1 in the
    # cache key, so for every suite), then, that fixed, after lists had decoded
    ("config-invalid-at-a-suite-length", "beyond_paper", ["--suites", "lists", "arith", "--configs", "ref",
     "--config-file", "{tmp}/ref.json"], "config 'ref' at arith's generation length (96 tokens): variant='reference'"),
    ("out-under-a-file", "beyond_paper", ["--out", "{tmp}/a_file/x"], "a_file is a file, not a folder"),
    ("cells-no-block", "many_masks_grid", ["--cells", "arith"], "expected suite:block"),
    ("cells-bad-block", "runner_up_grid", ["--cells", "arith:x"], "expected suite:block"),
    ("repeats-0", "sampling_memory", ["--repeats", "0", "--out", "{tmp}/sm"], "--repeats: must be >= 1, got 0"),
    ("repeats-0", "attention_cpu", ["--repeats", "0"], "--repeats: must be >= 1, got 0"),
    ("length-short", "attention_cpu", ["--length", "100"], "--length must be at least 256"),
    ("callers-negative", "policy_overhead", ["--callers", "-1"], "--callers: must be >= 0, got -1"),
    ("seed-greedy", "policy_overhead", ["--seed", "5"], "--seed keys the sampling noise"),
    ("vocab-4", "policy_overhead", ["--random", "--vocab", "4"], "--vocab must be more than 8"),
    ("ops-negative", "step_anatomy", ["--ops", "-1"], "--ops: must be >= 0, got -1"),
    ("steps-0", "overlay_attention", ["--steps", "0"], "--steps: must be >= 1, got 0"),
    ("out-a-folder", "nfe_oracle", ["--out", "{tmp}"], "is a folder: name a file"),
    ("json-under-a-file", "official_parity", ["--llada-dir", "{tmp}", "--json", "{tmp}/a_file/r.json"],
     "a_file is a file, not a folder"),
    ("summary-not-json", "make_tables", ["{tmp}/bench"], "summary.json: not JSON"),
    ("sweep-a-list", "paper_table", ["--targets", "--heldout-sweep", "{tmp}/list.json"], "list.json: holds an array"),
    ("results-not-a-run", "reference_side_by_side", ["--reference-results", "{tmp}/five.json"], "five.json: holds an object"),
    ("repeats-0", "gpu_check", ["--repeats", "0"], "--repeats: must be >= 1, got 0"),
]


def _bad_input_folder(tmp: Path) -> Path:
    (tmp / "a_file").write_text("")
    (tmp / "list.json").write_text("[1, 2]")
    (tmp / "five.json").write_text('{"mine": 5}')
    (tmp / "not_json.json").write_text("not json")
    (tmp / "ref.json").write_text('{"ref": {"strategy": "blockbatch", "variant": "reference", "block_sizes": [16, 32, 64]}}')
    (tmp / "bench").mkdir()
    (tmp / "bench" / "summary.json").write_text("not json")
    return tmp


def _run_script(monkeypatch, capsys, script: str, args: list[str], load: bool = False) -> tuple[int, str, str]:
    """``benchmarks/<script>.py args`` as its ``__main__`` runs it (``run_main(main)``): its exit status, stdout and
    stderr. Unless ``load``, loading a model fails the test: a bad value is refused before any model loads."""
    import hf_blockbatch as hb
    from hf_blockbatch import hub
    from hf_blockbatch.eval.script_args import run_main

    module = load_benchmark(script)
    if not load:
        def no_model(*args, **kwargs):
            raise AssertionError(f"{script} loaded a model before refusing its bad input")

        monkeypatch.setattr(hub, "load_model", no_model)
        monkeypatch.setattr(hb, "load_model", no_model)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    capsys.readouterr()
    try:
        status = run_main(module.main)
    except SystemExit as exit_:  # argparse's error
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize(("script", "args", "says"), [c[1:] for c in BAD_INPUTS], ids=[f"{c[1]}-{c[0]}" for c in BAD_INPUTS])
def test_a_script_refuses_bad_input_in_one_line_before_any_model_loads(monkeypatch, capsys, tmp_path, script: str,
                                                                       args: list[str], says: str) -> None:  # fmt: skip
    """Each bad value gets exit status 2 and one ``error:`` line that says it (argparse's own, or ``run_main``'s), never
    a hang (``entropy:-0.5`` committed nothing, forever), an empty result that exits 0, or a traceback; and it is said
    before a model loads. The scripts' output paths are the test's folder: a refusal that came too late would write
    there, not into the checkout."""
    tmp = _bad_input_folder(tmp_path)
    status, out, err = _run_script(monkeypatch, capsys, script, [a.replace("{tmp}", str(tmp)) for a in args])
    errors = [line for line in err.splitlines() if "error:" in line]
    assert status == 2 and len(errors) == 1 and says in errors[0], (status, err[-600:])
    assert "Traceback" not in err
    if script == "make_tables":  # no table header before the failure
        assert out == ""


def test_reference_side_by_side_refuses_results_that_match_no_item(monkeypatch, capsys, tmp_path) -> None:
    """Reference results decoded for other items left an empty table and exit status 0, which reads as a comparison
    that found nothing wrong. Needs no outside code: the results file stands in for the authors' decoder."""
    path = tmp_path / "theirs.json"
    path.write_text(json.dumps([{"key": "nosuch/0", "tokens": [1], "nfe_authors": 1, "stats": {}}]))
    status, _, err = _run_script(monkeypatch, capsys, "reference_side_by_side",
                                 ["--reference-results", str(path), "--suites", "arith", "--items", "1"], load=True)  # fmt: skip
    assert status == 2 and err.strip().splitlines()[-1].startswith("error: no reference result matches an item")


def test_step_anatomy_writes_a_checkpoint_folders_report_under_out(monkeypatch, tmp_path) -> None:
    """``--model /some/path`` put the report beside the checkpoint: the file is named by the checkpoint's name."""
    sa = load_benchmark("step_anatomy")
    written = []
    monkeypatch.setattr(sa, "load_for_benchmark", lambda *a, **k: (None, None))
    monkeypatch.setattr(sa, "measure", lambda *a, **k: {})
    monkeypatch.setattr(sa, "markdown", lambda *a, **k: "")
    monkeypatch.setattr(sa, "write_report", lambda stem, *a: written.append(stem))
    monkeypatch.setattr(sys, "argv", ["step_anatomy.py", "--model", str(tmp_path / "ckpt" / "my-llada"), "--out",
                                      str(tmp_path / "out")])  # fmt: skip
    sa.main()
    assert written == [tmp_path / "out" / "my-llada_code_b1_64"]


def test_step_anatomy_usage_names_the_decoders_as_they_are_spelt(capsys) -> None:
    """argparse's usage line dropped the parentheses of the choices (``drafted`` for ``drafted()``, which
    ``--decoders`` refuses)."""
    with pytest.raises(SystemExit):
        load_benchmark("step_anatomy").main(["--help"])
    text = capsys.readouterr().out
    assert ",drafted," not in text and "'drafted()'" in text


def test_the_shared_argument_types_and_run_main(tmp_path, capsys) -> None:
    from hf_blockbatch.eval import script_args as sa

    assert (sa.positive_int("3"), sa.nonnegative_int("0"), sa.positive_float("0.5"), sa.probability("1")) == (3, 0, 0.5, 1.0)
    assert (sa.nonnegative_float("0"), sa.finite_float("-2.5")) == (0.0, -2.5)
    for kind, text, says in ((sa.positive_int, "0", "must be >= 1, got 0"), (sa.positive_int, "x", "expected an integer"),
                             (sa.nonnegative_int, "-1", "must be >= 0, got -1"), (sa.positive_float, "0", "must be > 0"),
                             (sa.positive_float, "nan", "finite"), (sa.probability, "1.5", "must be in (0, 1]"),
                             (sa.probability, "0", "must be in (0, 1]"), (sa.nonnegative_float, "-1", "must be >= 0")):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
            kind(text)
    (tmp_path / "f").write_text("")
    assert sa.out_folder(str(tmp_path / "new" / "deeper")) == tmp_path / "new" / "deeper"
    with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a folder"):
        sa.out_folder(str(tmp_path / "f" / "x"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder"):
        sa.out_file(str(tmp_path))
    # a folder this process cannot write into (a read-only file system; root ignores permissions, so os.access says it)
    real = os.access
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "access", lambda path, mode: False if Path(path) == tmp_path and mode & os.W_OK else real(path, mode))
        with pytest.raises(argparse.ArgumentTypeError, match=rf"^{re.escape(str(tmp_path))} is not writable here: "
                                                             rf"name a folder you can write into for .*new$"):  # fmt: skip
            sa.out_folder(str(tmp_path / "new"))
    (tmp_path / "obj.json").write_text('{"a": 1}')
    assert sa.read_json(tmp_path / "obj.json") == {"a": 1}
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}: cannot read it \(Is a directory\); expected a JSON file$"):
        sa.read_json(tmp_path)
    with pytest.raises(ValueError, match="holds an object, expected a list of runs"):
        sa.read_json(tmp_path / "obj.json", list, "a list of runs")

    def raises(err: BaseException):
        def main() -> None:
            raise err

        return main

    assert sa.run_main(lambda: None) == 0 and sa.run_main(lambda: 3) == 3 and sa.run_main(lambda: {"report": 1}) == 0
    assert sa.run_main(lambda: True) == 0 and sa.run_main(lambda: False) == 0  # a bool is a report, not a status
    capsys.readouterr()
    for err, says in ((ValueError("bad --x"), "bad --x"), (KeyError("unknown suite 'y'"), "unknown suite 'y'"),
                      (NotADirectoryError("f is a file"), "f is a file")):  # fmt: skip
        assert sa.run_main(raises(err)) == 2
        assert capsys.readouterr().err == f"error: {says}\n"
    with pytest.raises(RuntimeError):  # not bad input: a fault keeps its traceback
        sa.run_main(raises(RuntimeError("bug")))


def test_a_script_stopped_by_ctrl_c_or_a_closed_pipe_says_one_line_or_none(monkeypatch, capsys) -> None:
    """A Ctrl-C, a reader that stopped reading (``| head``) and an ASCII-only stdout (``PYTHONIOENCODING=ascii``)
    were a traceback, ``error: [Errno 32] Broken pipe`` then an ``Exception ignored`` traceback at exit, and ``error:
    'ascii' codec can't encode`` (said as bad input, the report lost): now ``interrupted`` (130), nothing (141, with
    stdout on /dev/null for the exit's flush), and the report with backslash escapes."""
    import io

    from hf_blockbatch.eval import script_args as sa

    def interrupted() -> None:
        raise KeyboardInterrupt

    assert sa.run_main(interrupted) == 130
    assert capsys.readouterr().err == "interrupted\n"
    read, write = os.pipe()
    os.close(read)  # the reader has gone
    stdout = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert sa.run_main(lambda: print("a row of a long report", flush=True)) == 141
    assert capsys.readouterr().err == ""
    assert os.write(write, b"the exit's flush") == 16  # now /dev/null: no second BrokenPipeError
    stdout.close()
    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", ascii_out)
    assert sa.run_main(lambda: print("0.5\u00d7 \u2014", flush=True)) == 0
    assert ascii_out.buffer.getvalue() == b"0.5\\xd7 \\u2014\n"


def test_the_command_line_says_a_ctrl_c_in_one_line(monkeypatch, capsys) -> None:
    """``hf-blockbatch bench`` or ``generate`` stopped by a Ctrl-C: ``interrupted`` and status 130, not a traceback
    of wherever the decode was."""
    from hf_blockbatch import cli

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    assert cli.main(["generate"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_the_library_parts_the_scripts_share_refuse_bad_values(tmp_path) -> None:
    from hf_blockbatch.eval.runner import load_for_benchmark, write_report
    from hf_blockbatch.tasks import get_suite

    with pytest.raises(ValueError, match="threads must be >= 1"):
        load_for_benchmark("tiny-llada", 0)
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match=r"f is a file, not a folder: name a folder"):
        write_report(tmp_path / "f" / "sub" / "report", {}, "")
    with pytest.raises(ValueError, match=re.escape("limit must be >= 0 (or None: every item)")):
        get_suite("arith").items("test", limit=-3)
    assert get_suite("arith").items("test", limit=0) == []


def test_the_command_line_says_a_full_disk_in_one_line(monkeypatch, capsys) -> None:
    """``hf-blockbatch bench`` on a full disk (``ulimit -f``: EFBIG writing ``summary.json``) or ``generate >
    /dev/full`` ended in a traceback: now ``error: <why>`` and status 1."""
    from hf_blockbatch import cli

    def full_disk(args: argparse.Namespace) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "cmd_generate", full_disk)
    assert cli.main(["generate"]) == 1
    assert capsys.readouterr().err == "error: [Errno 28] No space left on device\n"
