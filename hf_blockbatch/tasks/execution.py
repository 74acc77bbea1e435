"""Sandboxed execution of generated programs (HumanEval, MBPP, the tiny ``code`` suite).

Generated code is untrusted: a model can write ``while True: pass``, allocate 80 GB, or call
``shutil.rmtree``. We follow the pattern of OpenAI's ``human-eval`` executor (separate process,
wall-clock limit, temporary working directory, destructive functions disabled) and add what it
leaves out: an address-space limit, a file-size limit, no network, and a verdict that the
program cannot forge by printing.

Why a fresh interpreter (``subprocess`` running ``sys.executable -I``) rather than a forked
``multiprocessing`` child: the parent is a model server with CUDA initialised and, in
:func:`run_programs`, several threads; forking such a process is unsafe (locks held by other
threads are copied locked; CUDA state is not fork-safe). A fresh interpreter costs ~30 ms and
inherits nothing. Its resource limits are set inside the child (not with ``preexec_fn``, which
is not thread-safe either).

What this is not: a security boundary against a deliberately malicious program (it runs as the
same user and can still write files outside its temporary directory). Use a container for that.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from hf_blockbatch.checks import check_positive_real

logger = logging.getLogger(__name__)

__all__ = [
    "ExecResult",
    "SandboxStartError",
    "run_program",
    "check_program",
    "run_programs",
    "check_programs",
    "check_sandbox",
]

Status = Literal["passed", "failed", "timeout", "error"]


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one program.

    ``status``: ``passed`` (ran to the end), ``failed`` (raised: a failed assert, a
    ``SyntaxError``, a ``MemoryError`` from the memory limit, a blocked call ...), ``timeout``
    (killed at the wall-clock limit) or ``error`` (died without a verdict: killed by a signal,
    ``os._exit``). ``detail`` says why, briefly. A sandbox that cannot start is no result: it raises
    :class:`SandboxStartError`.
    """

    passed: bool
    status: Status
    detail: str = ""
    elapsed: float = 0.0


class SandboxStartError(OSError):
    """The sandbox's interpreter could not start, after the retries a passing shortage gets.

    Not an ``error`` result: that scored the program wrong, so a run whose sandbox stopped starting partway (no
    processes left to the user, no file descriptors) reported a lower accuracy, each such row saying why only in its
    detail. An ``OSError``: the command line says it in one line, as it says a full disk. ``reason`` is the short
    cause, ``could not start the sandbox: <the OSError>``.
    """

    def __init__(self, reason: str, tries: int) -> None:
        """``reason``: the short cause; ``tries``: how many starts failed."""
        self.reason = reason
        after = f" ({tries} tries)" if tries > 1 else ""
        super().__init__(
            f"the code sandbox stopped starting ({reason}{after}), so every code item from here would score wrong: "
            "fix what it names (e.g. raise ulimit -n or ulimit -u) and run again."
        )


#: A sandbox start that fails for a shortage that passes (no process left to the user, no file descriptor, memory:
#: other sandboxes of :func:`run_programs` hold them up to ``timeout + 1`` s each) is tried again after each of
#: these waits (seconds, 3.1 in all); any other failure (a missing interpreter) is raised at once
_START_RETRY_DELAYS: tuple[float, ...] = (0.1, 0.2, 0.4, 0.8, 1.6)
_PASSING_SHORTAGES = frozenset({errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def _start(args: list[str], cwd: str, env: dict[str, str]) -> subprocess.Popen:
    """Start the sandbox's interpreter; retry a start that failed for a passing shortage (see
    :data:`_START_RETRY_DELAYS`), and raise :class:`SandboxStartError` when it still fails."""
    for tries, delay in enumerate((*_START_RETRY_DELAYS, None), start=1):
        try:
            return subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as err:
            if delay is None or err.errno not in _PASSING_SHORTAGES:
                raise SandboxStartError(f"could not start the sandbox: {err}", tries) from err
            logger.info("the sandbox could not start (%s): trying again in %g s", err, delay)
            time.sleep(delay)
    raise AssertionError("unreachable: the last try returns or raises")  # pragma: no cover


# The child's code. It reads the program from stdin, keeps a private copy of the result pipe,
# points fds 1/2 at /dev/null (so a print flood cannot fill the parent's memory and so the
# program cannot write a fake verdict), applies the limits and the guard, and runs the program.
_CHILD = r"""
import builtins, json, os, resource, sys
_res = os.fdopen(os.dup(1), "w")
_src = sys.stdin.buffer.read().decode("utf-8", "replace")
_null = os.open(os.devnull, os.O_RDWR)
for _fd in (0, 1, 2):
    os.dup2(_null, _fd)
import io
sys.stdin = io.StringIO("")
sys.stdout = io.StringIO()
sys.stderr = io.StringIO()
_mem, _cpu, _fsize, _wall = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
def _limit(kind, value, slack=0):
    try:
        soft, hard = resource.getrlimit(kind)
        high = value + slack
        if hard != resource.RLIM_INFINITY:
            value, high = min(value, hard), min(high, hard)
        resource.setrlimit(kind, (value, high))
    except (ValueError, OSError):
        pass
if _mem > 0:
    _limit(resource.RLIMIT_AS, _mem)
    _limit(resource.RLIMIT_DATA, _mem)
# the soft limit sends SIGXCPU (the parent's "CPU time limit exceeded"); the hard one, a second later, SIGKILL.
# Linux sends SIGKILL, not SIGXCPU, at a soft limit equal to the hard one
_limit(resource.RLIMIT_CPU, _cpu, 1)
_limit(resource.RLIMIT_FSIZE, _fsize)
_limit(resource.RLIMIT_CORE, 0)
import faulthandler, shutil, socket, subprocess
faulthandler.disable()
def _blocked(name):
    def _f(*a, **k):
        raise PermissionError(name + " is disabled in the sandbox")
    return _f
class _NoSocket:
    def __init__(self, *a, **k):
        raise PermissionError("network access is disabled in the sandbox")
socket.socket = _NoSocket
for _n in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo",
           "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
    if hasattr(socket, _n):
        setattr(socket, _n, _blocked("socket." + _n))
for _n in ("system", "popen", "remove", "unlink", "rmdir", "removedirs", "rename", "renames",
           "replace", "truncate", "ftruncate", "kill", "killpg", "fork", "forkpty", "execv",
           "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe", "spawnl",
           "spawnv", "spawnve", "spawnvp", "posix_spawn", "posix_spawnp",
           "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "chroot", "fchdir", "chdir",
           "setuid", "setgid", "seteuid", "setegid", "setreuid", "setregid", "setresuid",
           "setresgid", "setsid", "setpgid", "nice", "link", "symlink", "mkfifo", "mknod",
           "plock", "sched_setaffinity"):
    if hasattr(os, _n):
        setattr(os, _n, _blocked("os." + _n))
for _n in ("rmtree", "move", "chown", "copytree", "copyfile", "copy", "copy2", "disk_usage"):
    setattr(shutil, _n, _blocked("shutil." + _n))
for _n in ("Popen", "call", "run", "check_call", "check_output", "getoutput", "getstatusoutput"):
    setattr(subprocess, _n, _blocked("subprocess." + _n))
for _n in ("ipdb", "joblib", "resource", "psutil", "tkinter", "multiprocessing", "ctypes"):
    sys.modules[_n] = None
builtins.help = None
builtins.exit = _blocked("exit")
builtins.quit = _blocked("quit")
import signal
class _SandboxTimeout(BaseException):
    pass
def _on_alarm(signum, frame):
    raise _SandboxTimeout()
signal.signal(signal.SIGALRM, _on_alarm)
_verdict = {"status": "passed", "detail": ""}
try:
    signal.setitimer(signal.ITIMER_REAL, _wall)
    exec(compile(_src, "<program>", "exec"), {"__name__": "__sandbox__", "__builtins__": builtins})
    signal.setitimer(signal.ITIMER_REAL, 0)
except _SandboxTimeout:
    _verdict = {"status": "timeout", "detail": "timed out after %g s" % _wall}
except BaseException as _e:
    signal.setitimer(signal.ITIMER_REAL, 0)
    _msg = str(_e)
    _verdict = {"status": "failed", "detail": (type(_e).__name__ + (": " + _msg if _msg else ""))[:500]}
_res.write(json.dumps(_verdict))
_res.flush()
os._exit(0)
"""


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child and anything it started (it runs in its own session/process group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def run_program(
    program: str,
    timeout: float = 3.0,
    memory_mb: int = 512,
    max_file_mb: int = 16,
    python: str | None = None,
) -> ExecResult:
    """Run ``program`` in a sandboxed child interpreter and report how it ended.

    ``timeout`` is wall-clock seconds for the program: an interval timer inside the child stops
    it at ``timeout`` (a busy loop returns ``timeout`` after about ``timeout`` + 0.05 s), and
    the parent SIGKILLs the whole process group at ``timeout`` + 1 s in case the program
    swallowed the signal or is stuck in C code;
    ``memory_mb`` caps the child's address space (``0``: no cap); ``max_file_mb`` caps any file
    it writes. The working directory is a fresh temporary directory, removed afterwards by the
    parent. Standard output of the program is discarded. A sandbox that cannot start, after retries where the cause
    may pass, raises :class:`SandboxStartError` (no result to score).
    """
    # a timeout of -1 returned "timeout" for every program without running it (every answer scored wrong, in
    # silence), and NaN failed in math.ceil
    check_positive_real("timeout", timeout)
    python = python or sys.executable
    cpu_s = max(1, math.ceil(timeout) + 1)  # CPU backstop; the wall-clock kill is the real limit
    args = [
        python,
        "-I",
        "-c",
        _CHILD,
        str(memory_mb * 1024 * 1024),
        str(cpu_s),
        str(max_file_mb * 1024 * 1024),
        repr(float(timeout)),
    ]
    env = {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hfbb-exec-") as tmp:
        env["HOME"] = tmp
        env["TMPDIR"] = tmp
        proc = _start(args, tmp, env)
        # Popen's context closes the pipes and reaps the child however the wait ends (an exception too: the
        # killed child was left unreaped, its pipes open until garbage collection, with ResourceWarnings)
        with proc:
            # Interpreter start-up is not the program's time: allow a fixed margin for it.
            try:
                out, err = proc.communicate(program.encode("utf-8", "replace"), timeout=timeout + 1.0)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.communicate()
                return ExecResult(False, "timeout", f"killed after {timeout:g} s", time.monotonic() - start)
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
        elapsed = time.monotonic() - start
    try:
        verdict = json.loads(out.decode("utf-8", "replace").strip() or "null")
    except json.JSONDecodeError:
        verdict = None
    if not isinstance(verdict, dict) or verdict.get("status") not in ("passed", "failed", "timeout"):
        rc = proc.returncode
        if rc is not None and rc < 0:
            sig = -rc
            if sig == signal.SIGXCPU:
                return ExecResult(False, "timeout", "CPU time limit exceeded", elapsed)
            why = (
                f"killed by signal {signal.Signals(sig).name}"
                if sig in signal.valid_signals()
                else f"signal {sig}"
            )
        else:
            why = f"exited with code {rc} without a verdict"
        tail = err.decode("utf-8", "replace").strip()[-300:]
        return ExecResult(False, "error", why + (f": {tail}" if tail else ""), elapsed)
    status: Status = verdict["status"]
    return ExecResult(status == "passed", status, str(verdict.get("detail", "")), elapsed)


def check_program(program: str, timeout: float = 3.0, memory_mb: int = 512) -> bool:
    """Whether ``program`` runs to the end without raising, in the sandbox (see :func:`run_program`)."""
    return run_program(program, timeout=timeout, memory_mb=memory_mb).passed


def check_sandbox(python: str | None = None) -> None:
    """Raise a ``ValueError`` saying why when the sandbox cannot run a trivial program here.

    A sandbox that cannot start (too many open files, no processes left to the user, a missing interpreter) scores
    no program (:class:`SandboxStartError`), and a program it cannot run to a verdict scores wrong. Callers that
    score code check this once, before their work (:func:`run_bench <hf_blockbatch.eval.runner.run_bench>`), so the
    run is refused in one line before minutes of decoding rather than stopped at its first code item.
    """
    try:
        res = run_program("assert True\n", python=python)
    except SandboxStartError as err:
        res = ExecResult(False, "error", err.reason)
    if not res.passed:
        raise ValueError(
            f"the code sandbox cannot run a program here ({res.status}: {res.detail}), so every code item would score "
            "wrong: fix what it names (e.g. raise ulimit -n or ulimit -u) before scoring code."
        )


def _default_workers() -> int:
    """Half the CPUs (at least 1, at most 8): execution shares the machine with the model."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def run_programs(
    programs: Sequence[str],
    timeout: float = 3.0,
    workers: int | None = None,
    memory_mb: int = 512,
) -> list[ExecResult]:
    """Run many programs, ``workers`` child interpreters at a time; results in input order.

    Threads only wait on child processes, so a small thread pool is enough to keep
    ``workers`` sandboxes busy.
    """
    workers = workers or _default_workers()
    if workers <= 1 or len(programs) <= 1:
        return [run_program(p, timeout=timeout, memory_mb=memory_mb) for p in programs]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda p: run_program(p, timeout=timeout, memory_mb=memory_mb), programs))


def check_programs(
    programs: Sequence[str],
    timeout: float = 3.0,
    workers: int | None = None,
    memory_mb: int = 512,
) -> list[bool]:
    """Batched :func:`check_program`: one pass/fail per program, in input order."""
    return [r.passed for r in run_programs(programs, timeout=timeout, workers=workers, memory_mb=memory_mb)]
