"""What the benchmark scripts (``benchmarks/*.py``) and the command line share to refuse bad input in one line.

Why one module: a count of 0 or -3, an output path under a file, a JSON file of the wrong shape were each met by
some script with a hang, an empty table that exits 0 or a traceback from deep inside torch. Each check is written
once here and called by every script that needs it, so that the same mistake gets the same message everywhere:

* argparse types for counts and sizes (:func:`positive_int`, :func:`nonnegative_int`), numbers, rates and probabilities
  (:func:`finite_float`, :func:`positive_float`, :func:`nonnegative_float`, :func:`probability`), devices (:func:`torch_device`) and output
  paths (:func:`out_folder`, :func:`out_file`): argparse turns their refusal into its own ``error:`` line, before any model loads;
* :func:`read_json`, a JSON file of the expected shape, or a ``ValueError`` that names the file;
* :func:`run_main`, a script's ``main`` with its bad-input exceptions turned into ``error: <message>`` on stderr and
  exit status 2, as :func:`hf_blockbatch.cli.main` does for the package's command line; a Ctrl-C or a closed pipe
  ends either in one line or none (:func:`stopped_status`), and stdout escapes what its encoding cannot write
  (:func:`tolerant_stdout`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "finite_float",
    "folder_problem",
    "nonnegative_float",
    "nonnegative_int",
    "out_file",
    "out_folder",
    "positive_float",
    "positive_int",
    "probability",
    "read_json",
    "run_main",
    "refused_status",
    "stopped_status",
    "tolerant_stdout",
    "torch_device",
]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def finite_float(text: str) -> float:
    """Any finite number (a threshold whose range the config it goes to checks, in its own words)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _bounded(name: str, parse: Callable[[str], Any], holds: Callable[[Any], bool], rule: str, doc: str) -> Callable[[str], Any]:
    """An argparse type named ``name``: ``parse`` the text (:func:`_int` or :func:`finite_float`), then refuse a value
    for which ``holds`` is false with "must be ``rule``, got <value>" (a float shown with ``:g``). The four bounded
    types below are made here, so that they parse, refuse and word their refusal one way."""

    def check(text: str) -> Any:
        value = parse(text)
        if not holds(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value:g}" if isinstance(value, float)
                                             else f"must be {rule}, got {value}")  # fmt: skip
        return value

    check.__name__ = check.__qualname__ = name
    check.__doc__ = doc
    return check


positive_int = _bounded("positive_int", _int, lambda v: v >= 1, ">= 1",
                        "A count or a size of at least 1 (items, rows, repeats, a block, threads).")
nonnegative_int = _bounded("nonnegative_int", _int, lambda v: v >= 0, ">= 0",
                           "A count where 0 means none (warm-up passes, callers listed).")
positive_float = _bounded("positive_float", finite_float, lambda v: v > 0, "> 0",
                          "A finite rate or size above 0 (a bandwidth, a temperature that samples).")
nonnegative_float = _bounded("nonnegative_float", finite_float, lambda v: v >= 0, ">= 0",
                             "A finite number where 0 means none (a temperature, where 0 is greedy; a host time per "
                             "operation).")
probability = _bounded("probability", finite_float, lambda v: 0 < v <= 1, "in (0, 1]",
                       "A threshold or an efficiency in (0, 1]: 0 would commit (or do) nothing, above 1 nothing ever "
                       "reaches it.")


def torch_device(text: str) -> str:
    """A device torch knows (``cpu``, ``cuda``, ``cuda:1``, ``mps``): a misspelt one is said here, not as torch's
    error from inside the model's loading."""
    import torch

    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (e.g. cpu, cuda, cuda:1)") from None
    return text


def folder_problem(folder: str | os.PathLike[str]) -> str | None:
    """Why files cannot be written into ``folder`` (created where missing), or None: the folder, or the nearest of
    its parents that exists, is a file, or a folder this process cannot write into (its permissions, a read-only
    file system). Said before a run's work, not when its report is written after it."""
    folder = Path(folder)
    for at in (folder, *folder.parents):
        if at.exists():
            if not at.is_dir():
                return f"{at} is a file, not a folder: name a folder for {folder}"
            if not os.access(at, os.W_OK | os.X_OK):  # access(2) says EROFS on a read-only file system, root too
                return f"{at} is not writable here: name a folder you can write into for {folder}"
            return None
    return None


def out_folder(text: str) -> Path:
    """An argparse type: a folder to write into, created if missing (:func:`folder_problem`)."""
    problem = folder_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return Path(text)


def out_file(text: str) -> Path:
    """An argparse type: a file (or a file stem, ``<stem>.json`` and ``.md``) to write, its folder created if
    missing; not an existing folder, nor under a file."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder: name a file to write (in it, or elsewhere)")
    problem = folder_problem(path.parent)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path


def read_json(path: str | os.PathLike[str], expect: type = dict, what: str = "a JSON file") -> Any:
    """The JSON value in ``path``, which must be of type ``expect`` (``dict``: an object; ``list``: an array).
    Raises ``ValueError`` naming the file and ``what`` it should be when it is missing, unreadable, not JSON or of
    another shape, so that a script says it in one line (:func:`run_main`) rather than failing further on."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (expected {what})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read it ({err.strerror if isinstance(err, OSError) else err}); expected {what}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err}); expected {what}") from None
    if not isinstance(value, expect):
        kinds = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
        raise ValueError(f"{path}: holds {kinds.get(type(value), 'null')}, expected {what}")
    return value


#: what the operating system or the user does to a running command, said in one line (:func:`stopped_status`)
STOPPED = (KeyboardInterrupt, BrokenPipeError)


def stopped_status(err: BaseException) -> int:
    """The exit status of a command stopped by ``err``, one of :data:`STOPPED`: a Ctrl-C says ``interrupted`` on
    stderr (130, as a shell reports SIGINT); a reader that closed the pipe (``| head``) ends it quietly (141, as
    SIGPIPE), with stdout pointed at /dev/null so that the exit's own flush does not fail again. Each was a
    traceback of the frame the event happened to land in."""
    if isinstance(err, BrokenPipeError):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    print("interrupted", file=sys.stderr)
    return 130


def refused_status(err: OSError) -> int:
    """The exit status of a command the operating system stopped with ``err`` (a full disk or a file-size limit
    writing results, a code sandbox that stopped starting): ``error: <err>`` on stderr, naming the file where the
    error has one, and status 1 (2 is for bad input); the traceback goes to the log at INFO level."""
    logging.getLogger(__name__).info("the operating system refused", exc_info=err)
    print(f"error: {err}", file=sys.stderr)
    return 1


def tolerant_stdout() -> None:
    """Write what stdout's encoding cannot (``PYTHONIOENCODING=ascii``: the tables' ``×``, ``—`` and ``τ``, a model's
    answer) as backslash escapes: it failed the print with a ``UnicodeEncodeError``, said as bad input."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if callable(reconfigure):
        reconfigure(errors="backslashreplace")


def run_main(main: Callable[[], Any]) -> int:
    """Run a script's ``main`` and return its exit status: the int it returns, else 0 (a script's ``main`` may return
    its report, for the tests that call it). Bad input it raises,
    ``ValueError``, ``OSError`` (a missing file, a folder under a file, ...) or ``KeyError`` (an unknown name), is
    said as ``error: <message>`` on stderr with status 2, as argparse says a bad option, instead of a traceback;
    the traceback goes to the log at DEBUG level. A Ctrl-C or a closed pipe: :func:`stopped_status`."""
    tolerant_stdout()
    try:
        result = main()
    except STOPPED as err:
        return stopped_status(err)
    except (ValueError, OSError, KeyError) as err:
        logging.getLogger(__name__).debug("bad input", exc_info=True)
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"error: {message}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
