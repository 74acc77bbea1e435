"""Tasks: the contract every evaluated task implements, how answers are scored, and the tiny suites.

* :mod:`~hf_blockbatch.tasks.contract` — :class:`Task`, :class:`EvalItem`, :class:`Score`: what the
  bench runner, the demo and the tests iterate over (the real benchmarks in
  :mod:`hf_blockbatch.eval.benchmarks` implement it too);
* :mod:`~hf_blockbatch.tasks.scoring` — answer extraction and comparison (GSM8K, MATH, code blocks);
* :mod:`~hf_blockbatch.tasks.execution` — the sandbox that runs generated programs;
* the synthetic suites for training and evaluating tiny masked-diffusion models (below).

Why here and not in :mod:`hf_blockbatch.eval`: the suites need the contract and the scorers, and
the bench in ``eval`` needs the suites; with the shared pieces in ``eval`` the two packages imported
each other. Now ``eval`` depends on ``tasks`` and never the other way round.

``arith`` (GSM8K-shaped word problems), ``code`` (MBPP-shaped functions, executed) and
``lists`` (answers with several valid forms). Every suite has a fixed 500-item test split and
can draw any number of training items that never repeat a test question.
"""

from __future__ import annotations

from hf_blockbatch.tasks.arith import ArithTask
from hf_blockbatch.tasks.base import TEST_SIZE, SyntheticTask, is_test_question
from hf_blockbatch.tasks.code import CodeTask
from hf_blockbatch.tasks.contract import EvalItem, Score, Task
from hf_blockbatch.tasks.lists import ListsTask

_REGISTRY: dict[str, type[SyntheticTask]] = {"arith": ArithTask, "code": CodeTask, "lists": ListsTask}
#: names of the suites, in a fixed order
SUITES: tuple[str, ...] = tuple(_REGISTRY)
_INSTANCES: dict[str, SyntheticTask] = {}


def get_suite(name: str) -> SyntheticTask:
    """The suite called ``name`` (one shared instance, so its test split is generated once)."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    if name not in _INSTANCES:
        _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]


__all__ = [
    "SUITES",
    "TEST_SIZE",
    "ArithTask",
    "CodeTask",
    "EvalItem",
    "ListsTask",
    "Score",
    "SyntheticTask",
    "Task",
    "get_suite",
    "is_test_question",
]
