"""Synthetic task suites for training and evaluating tiny masked-diffusion models.

``arith`` (GSM8K-shaped word problems), ``code`` (MBPP-shaped functions, executed) and
``lists`` (answers with several valid forms). Every suite has a fixed 500-item test split and
can draw any number of training items that never repeat a test question.
"""

from __future__ import annotations

from hf_blockbatch.tasks.arith import ArithTask
from hf_blockbatch.tasks.base import TEST_SIZE, SyntheticTask, is_test_question
from hf_blockbatch.tasks.code import CodeTask
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
    "ListsTask",
    "SyntheticTask",
    "get_suite",
    "is_test_question",
]
