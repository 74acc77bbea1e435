"""Evaluation: the real benchmarks' loaders (GSM8K, MATH, HumanEval, MBPP), the bench runner, the
lm-evaluation-harness adapter and Wilson intervals.

The task contract, answer scoring and the execution sandbox live one layer down, in
:mod:`hf_blockbatch.tasks` (which this package imports and which never imports it), so the tiny
suites and the real benchmarks implement and score against the same pieces without a cycle.
"""

from hf_blockbatch.tasks.contract import EvalItem, Score, Task

__all__ = ["EvalItem", "Score", "Task"]
