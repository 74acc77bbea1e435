"""The sandbox: verdicts, time and memory limits, and that destructive calls do nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hf_blockbatch.tasks.execution import check_program, check_programs, run_program, run_programs


def test_passing_and_failing_programs() -> None:
    assert check_program("def f(x):\n    return x + 1\nassert f(1) == 2\nprint('noise')\n")
    r = run_program("assert 1 == 2, 'nope'")
    assert (r.passed, r.status) == (False, "failed") and "AssertionError" in r.detail
    r = run_program("def f(:\n    pass")
    assert r.status == "failed" and "SyntaxError" in r.detail


def test_infinite_loop_times_out_within_the_limit() -> None:
    t0 = time.monotonic()
    r = run_program("while True:\n    pass\n", timeout=1.0)
    elapsed = time.monotonic() - t0
    assert r.status == "timeout" and not r.passed
    assert elapsed < 1.0 + 1.5


def test_sleeping_program_times_out() -> None:
    r = run_program("import time\ntime.sleep(60)\n", timeout=0.5)
    assert r.status == "timeout"


def test_huge_allocation_fails_without_harming_the_parent() -> None:
    r = run_program("x = [0] * 10**10\n", memory_mb=256)
    assert not r.passed and r.status in ("failed", "error")
    r = run_program("x = []\nwhile True:\n    x.append(' ' * 10**6)\n", memory_mb=256, timeout=5)
    assert not r.passed
    # the parent is still fine and the sandbox still works
    assert check_program("assert sum(range(10)) == 45")


def test_destructive_calls_do_nothing(tmp_path: Path) -> None:
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    for prog in (
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        "import shutil\nshutil.rmtree('/')",
        f"import os\nos.remove({str(victim)!r})",
        f"import os\nos.unlink({str(victim)!r})",
        f"import pathlib\npathlib.Path({str(victim)!r}).unlink()",
        f"import os\nos.rename({str(victim)!r}, {str(victim) + '.moved'!r})",
        f"import os\nos.system('rm -f {victim}')",
        f"import subprocess\nsubprocess.run(['rm', '-f', {str(victim)!r}])",
        "import os\nos.kill(os.getppid(), 9)",
    ):
        r = run_program(prog)
        assert not r.passed, prog
        assert victim.read_text() == "precious", prog
    assert os.getpid() > 0  # still alive


def test_no_network() -> None:
    r = run_program("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)\n")
    assert r.status == "failed" and "disabled" in r.detail
    r = run_program("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n")
    assert r.status == "failed"
    r = run_program("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)\n")
    assert not r.passed


def test_program_cannot_forge_a_verdict() -> None:
    prog = (
        "import os, sys\n"
        'print(\'{"status": "passed", "detail": ""}\')\n'
        'os.write(1, b\'{"status": "passed", "detail": ""}\')\n'
        "raise ValueError('really failed')\n"
    )
    assert run_program(prog).status == "failed"
    r = run_program("import os\nos._exit(0)\n")  # exits before the verdict
    assert r.status == "error" and not r.passed


def test_cwd_is_a_fresh_temporary_directory() -> None:
    prog = "import os\nassert os.listdir('.') == []\nopen('scratch.txt', 'w').write('x')\n"
    assert check_program(prog)
    assert check_program(prog)  # a new directory each time


def test_batched_runs_keep_order() -> None:
    progs = ["assert True", "assert False", "while True: pass", "assert 2 + 2 == 4"]
    res = run_programs(progs, timeout=1.0, workers=2)
    assert [r.status for r in res] == ["passed", "failed", "timeout", "passed"]
    assert check_programs([progs[0], progs[1], progs[3]], workers=2) == [True, False, True]


def test_program_swallowing_the_timeout_is_still_killed() -> None:
    prog = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass\n"
    t0 = time.monotonic()
    r = run_program(prog, timeout=0.5)
    assert r.status == "timeout" and time.monotonic() - t0 < 0.5 + 2.0


def test_the_memory_limit_fails_what_the_machine_could_give() -> None:
    """An allocation past ``memory_mb`` fails with a MemoryError though the machine has the memory (the test above
    asks for 80 GB, which fails without the limit too)."""
    r = run_program("x = bytearray(300 * 2**20)\n", memory_mb=256)
    assert r.status == "failed" and r.detail.startswith("MemoryError")
    assert run_program("x = bytearray(300 * 2**20)\n", memory_mb=1024).passed


def test_a_program_that_crashes_the_interpreter_is_an_error_naming_the_signal() -> None:
    """A completion that kills its interpreter (here a segmentation fault) gets no verdict: an ``error`` result
    saying which signal, not an exception in the scorer."""
    res = run_program("import faulthandler\nfaulthandler._sigsegv()")
    assert (res.passed, res.status) == (False, "error") and res.detail.startswith("killed by signal SIGSEGV")


def test_run_programs_with_the_default_workers_or_one_keeps_order() -> None:
    progs = ["assert True", "assert False", "assert 2 + 2 == 4"]
    for workers in (None, 1):
        assert [r.status for r in run_programs(progs, workers=workers)] == ["passed", "failed", "passed"]


def test_an_interpreter_that_cannot_start_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-python"
    r = run_program("pass\n", python=str(missing))
    assert (r.passed, r.status, r.elapsed) == (False, "error", 0.0)
    assert r.detail == f"could not start the sandbox: [Errno 2] No such file or directory: '{missing}'"
