"""The one contract every evaluation task implements: the tiny testbed suites (``arith``, ``code``,
...) and the real benchmarks (GSM8K, MATH, HumanEval, MBPP) alike.

Why one contract: the bench runner, the demo's example prompts and the tests all iterate over
items, build a prompt, decode, and score, without caring where an item came from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EvalItem:
    """One problem.

    ``question`` is the bare problem text (no few-shot examples, no chat template);
    ``reference`` is the gold answer as the scorer compares it (a final number, a boxed
    expression, or reference code); ``tests`` holds executable checks for code tasks;
    ``target`` is the full reference response (for the tiny suites it is the training target).
    """

    task: str
    id: str
    question: str
    reference: str
    tests: tuple[str, ...] = ()
    entry_point: str | None = None
    target: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Score:
    """The verdict on one completion: whether it is right, and what was read out of it."""

    correct: bool
    extracted: str | None = None
    detail: str = ""


class Task(ABC):
    """A named set of items with a prompt format and a scorer."""

    name: str = ""
    #: "number" (final number), "math" (equivalence of expressions) or "code" (executed tests)
    kind: str = "number"
    #: a generation length that fits this task's answers
    default_gen_length: int = 256

    @abstractmethod
    def items(self, split: str = "test", limit: int | None = None) -> list[EvalItem]:
        """Items of a split, in a fixed order (so ``limit`` takes the same prefix every time)."""

    @abstractmethod
    def prompt(self, item: EvalItem, tokenizer: Any = None, chat: bool = True) -> str:
        """The whole text fed to the model (few-shot examples and chat template included)."""

    @abstractmethod
    def score(self, item: EvalItem, completion: str) -> Score:
        """Score a completion (the decoded new text only, special tokens removed)."""


def check_limit(task: str, limit: int | None) -> None:
    """Refuse a negative ``limit`` for :meth:`Task.items`: as a slice it would drop items from the end (and decode
    nearly all of them), and clamped to 0 it would return no item, in silence, where the caller asked for some."""
    if limit is not None and limit < 0:
        raise ValueError(f"{task}: limit must be >= 0 (or None: every item), got {limit}")


def apply_chat(text: str, tokenizer: Any = None, chat: bool = True) -> str:
    """Wrap ``text`` as one user turn with the tokenizer's chat template, when there is one.

    Why one user turn holding the whole few-shot text (rather than one turn per shot): it is
    how the instruct models' authors prompted them (LLaDA's chat template around the raw
    prompt), and it keeps base-model and chat-model prompts textually identical inside.
    """
    if not chat or tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
