"""The sandbox: verdicts, time and memory limits, and that destructive calls do nothing."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from hf_blockbatch.tasks import execution, get_suite
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


def test_an_interpreter_that_cannot_start_raises_naming_it_without_retrying(tmp_path: Path, caplog) -> None:
    """A missing interpreter is no shortage that passes: it is raised at once, naming the cause, not tried again."""
    caplog.set_level("INFO", logger=execution.__name__)
    missing = tmp_path / "no-python"
    with pytest.raises(execution.SandboxStartError) as raised:
        run_program("pass\n", python=str(missing))
    assert raised.value.reason == f"could not start the sandbox: [Errno 2] No such file or directory: '{missing}'"
    assert str(raised.value) == (f"the code sandbox stopped starting ({raised.value.reason}), so every code item from "
                                 "here would score wrong: fix what it names (e.g. raise ulimit -n or ulimit -u) and "
                                 "run again.")  # fmt: skip
    assert "trying again" not in caplog.text


def _fake_python(folder: Path, body: str) -> str:
    """An executable standing in for the interpreter: a shell script that runs ``body`` (after reading the program
    from stdin, as the child does)."""
    path = folder / "fake-python"
    path.write_text("#!/bin/sh\ncat > /dev/null\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_a_child_that_writes_no_json_verdict_is_an_error_with_its_exit_code(tmp_path: Path) -> None:
    """What the child prints is parsed as the verdict: text that is no JSON, JSON that is no verdict object, or a
    status the sandbox never writes, is an ``error`` naming the exit code and the end of stderr, not an exception."""
    cases = {
        "echo 'Traceback: not json'": "exited with code 0 without a verdict",
        "echo '[1, 2]'; echo 'boom' >&2; exit 3": "exited with code 3 without a verdict: boom",
        "echo '{\"status\": \"hacked\"}'": "exited with code 0 without a verdict",
        "printf '\\377\\376'": "exited with code 0 without a verdict",  # not even UTF-8
    }
    for body, detail in cases.items():
        r = run_program("pass\n", python=_fake_python(tmp_path, body))
        assert (r.passed, r.status, r.detail) == (False, "error", detail), body
    r = run_program("pass\n", python=_fake_python(tmp_path, "echo '{\"status\": \"failed\", \"detail\": \"why\"}'"))
    assert (r.passed, r.status, r.detail) == (False, "failed", "why")


def test_a_child_stopped_by_the_cpu_limit_is_a_timeout() -> None:
    """SIGXCPU, the signal of the CPU-time limit, is reported as a timeout (the CPU backstop of the wall clock)."""
    r = run_program("import signal\nsignal.raise_signal(signal.SIGXCPU)\n")
    assert (r.passed, r.status, r.detail) == (False, "timeout", "CPU time limit exceeded")


def test_a_program_past_its_cpu_time_gets_sigxcpu_not_sigkill(tmp_path: Path) -> None:
    """The child set its CPU limit with the soft limit equal to the hard one, where Linux sends SIGKILL, not SIGXCPU:
    a program past its CPU time (one swallowing the wall-clock alarm in several busy threads) was an ``error`` "killed
    by signal SIGKILL", and the SIGXCPU branch above never ran. Here the child is given 1 CPU second (the real
    interpreter behind a wrapper that lowers the limit argument) and a 30 s wall clock: the CPU limit ends it."""
    import sys

    wrapper = tmp_path / "python-1s-cpu"
    # the arguments: -I -c <child code> <memory> <cpu seconds> <file size> <wall seconds>
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$1" "$2" "$3" "$4" 1 "$6" "$7"\n')
    wrapper.chmod(0o755)
    prog = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass\n"
    r = run_program(prog, timeout=30, python=str(wrapper))
    assert (r.passed, r.status, r.detail) == (False, "timeout", "CPU time limit exceeded")
    assert r.elapsed < 25


def test_the_cpu_limit_is_the_timeout_rounded_up_plus_one_second() -> None:
    """The child's own limits, as the kernel holds them: CPU soft ``ceil(timeout) + 1`` s, hard one second more."""
    limits = "open('/proc/self/limits').read()"
    prog = f"import re\nassert re.search(r'Max cpu time +3 +4 +seconds', {limits}), {limits}\n"
    r = run_program(prog, timeout=1.5)
    assert r.passed, r.detail


def test_an_exception_while_waiting_kills_the_child_and_propagates(monkeypatch) -> None:
    """An exception other than the timeout while the parent waits (a Ctrl-C, here) must not leave the child running:
    the ``finally`` kills its process group, the pipes are closed (they were left open, to the garbage collector's
    ResourceWarnings), and the exception reaches the caller."""
    import signal
    import subprocess

    from hf_blockbatch.tasks import execution

    started = []

    class Interrupted(subprocess.Popen):
        def communicate(self, *_a, **_k):
            started.append(self)
            assert self.poll() is None  # the child is running (waiting for its program on stdin)
            raise KeyboardInterrupt

    monkeypatch.setattr(execution.subprocess, "Popen", Interrupted)
    try:
        run_program("pass\n")
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the KeyboardInterrupt did not reach the caller")
    (proc,) = started
    assert proc.stdin.closed and proc.stdout.closed and proc.stderr.closed  # not left to the garbage collector
    try:
        assert proc.wait(timeout=2) == -signal.SIGKILL
    finally:  # a child the sandbox left running (the failure this test catches) is not left to outlive the test
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()


def _no_process_left(*args: object, **kwargs: object) -> None:
    raise OSError(errno.EMFILE, "Too many open files")


def test_a_sandbox_that_cannot_start_is_said_up_front_and_not_scored_as_a_failed_assert(monkeypatch, tmp_path) -> None:
    """Under ``ulimit -n 10`` every child failed to start: ``bench --task code`` reported 0 % accuracy, each row
    saying "failed hidden asserts". ``check_sandbox`` says it in one line (``run_bench`` calls it before the model
    loads, so no model is passed here), and a code item scored without a sandbox says why it is wrong."""
    from hf_blockbatch.eval.runner import BenchSettings, run_bench
    from hf_blockbatch.tasks import get_suite
    from hf_blockbatch.tasks.execution import check_sandbox

    check_sandbox()
    monkeypatch.setattr(execution.subprocess, "Popen", _no_process_left)
    monkeypatch.setattr(execution, "_START_RETRY_DELAYS", ())  # a shortage that lasts: no waits for it to pass
    message = (r"^the code sandbox cannot run a program here \(error: could not start the sandbox: \[Errno 24\] Too "
               r"many open files\), so every code item would score wrong: fix what it names \(e\.g\. raise ulimit -n "
               r"or ulimit -u\) before scoring code\.$")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        check_sandbox()
    with pytest.raises(ValueError, match=message):
        run_bench(BenchSettings(tasks=["code"], limit=1, output_dir=str(tmp_path / "out"), progress=False))
    task = get_suite("code")
    item = task.items("test", limit=1)[0]
    with pytest.raises(execution.SandboxStartError, match=r"^the code sandbox stopped starting \(could not start the "
                                                          r"sandbox: \[Errno 24\] Too many open files\)"):  # fmt: skip
        task.score(item, "whatever")


_POPEN = subprocess.Popen  # the real one, for the stand-in below to call once the test has replaced it


class _StartsAfter:
    """``subprocess.Popen`` failing its first ``failures`` calls with ``error`` (``None``: every call), then real."""

    def __init__(self, failures: int | None, error: int = errno.EAGAIN) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self, *args: object, **kwargs: object) -> subprocess.Popen:
        self.calls += 1
        if self.failures is None or self.calls <= self.failures:
            raise OSError(self.error, os.strerror(self.error))
        return _POPEN(*args, **kwargs)


def test_a_sandbox_start_that_fails_once_for_want_of_processes_is_tried_again(monkeypatch, caplog) -> None:
    """A sandbox that could not start once (EAGAIN: no processes left to the user, for a moment) scored the item wrong,
    its detail "could not start the sandbox": the accuracy of a run lost an item to the machine. It is tried again
    after a short wait, and the program gets its verdict."""
    caplog.set_level("INFO", logger=execution.__name__)
    popen = _StartsAfter(1)
    monkeypatch.setattr(execution.subprocess, "Popen", popen)
    assert run_program("assert 1 + 1 == 2\n").status == "passed"
    assert run_program("assert 1 + 1 == 3\n").status == "failed"  # the next program starts at once
    assert popen.calls == 3
    assert caplog.messages == ["the sandbox could not start ([Errno 11] Resource temporarily unavailable): trying "
                               "again in 0.1 s"]  # fmt: skip
    # a task scores it as the program it is
    task = get_suite("code")
    item = task.items("test", limit=1)[0]
    popen.calls = 0
    assert task.score(item, item.target).correct and popen.calls == 2


def test_a_sandbox_that_stops_starting_mid_run_stops_the_run_instead_of_scoring_wrong(monkeypatch, caplog) -> None:
    """Past the retries (3.1 s of waits; shortened here), a start that still fails raises, through the scoring and the
    parallel runs: the run stops with one line (``hf-blockbatch`` says an ``OSError`` as ``error: ...``) rather than
    report every later code item wrong."""
    assert sum(execution._START_RETRY_DELAYS) == pytest.approx(3.1)
    caplog.set_level("INFO", logger=execution.__name__)
    monkeypatch.setattr(execution, "_START_RETRY_DELAYS", (0.01, 0.02))
    popen = _StartsAfter(None, errno.EMFILE)
    monkeypatch.setattr(execution.subprocess, "Popen", popen)
    says = (r"^the code sandbox stopped starting \(could not start the sandbox: \[Errno 24\] Too many open files "
            r"\(3 tries\)\), so every code item from here would score wrong: fix what it names \(e\.g\. raise ulimit -n "
            r"or ulimit -u\) and run again\.$")  # fmt: skip
    with pytest.raises(execution.SandboxStartError, match=says) as raised:
        run_program("pass\n")
    assert isinstance(raised.value, OSError) and popen.calls == 3
    assert [m.rsplit(" ", 2)[1] for m in caplog.messages] == ["0.01", "0.02"]
    monkeypatch.setattr(execution, "_START_RETRY_DELAYS", ())
    with pytest.raises(execution.SandboxStartError, match="could not start the sandbox"):
        run_programs(["pass\n"] * 3, workers=2)
    task = get_suite("code")
    with pytest.raises(execution.SandboxStartError, match="could not start the sandbox"):
        task.score(task.items("test", limit=1)[0], "whatever")
