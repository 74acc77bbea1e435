"""Evaluation: task contract, benchmark loaders, scoring and sandboxed execution."""

from hf_blockbatch.eval.base import EvalItem, Score, Task

__all__ = ["EvalItem", "Score", "Task"]
