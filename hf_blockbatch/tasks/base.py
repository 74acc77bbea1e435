"""Shared machinery of the synthetic suites: deterministic generation and a leak-free split.

Why synthetic suites at all: no model weights can be downloaded here, so the project trains
tiny masked-diffusion models itself, and those only learn tasks whose per-token facts are small
and regular. The suites keep the *shape* of the real benchmarks (GSM8K, MBPP) so that prompts,
generation lengths and scorers behave as they do there, while keeping the values learnable.

Why a hash-based split: the test split must never share a question with the training data,
however many training items are drawn and from whichever seed. Assigning every *question text*
to a bucket by a stable hash makes that a property of the text itself: a test-bucket question is
never emitted by :meth:`SyntheticTask.train_items`, so no later regeneration can leak.
"""

from __future__ import annotations

import hashlib
import logging
import random
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

from hf_blockbatch.tasks.contract import EvalItem, Task, apply_chat, check_limit

logger = logging.getLogger(__name__)

#: size of every test split (fixed, so reported accuracies are comparable across runs)
TEST_SIZE = 500
#: default number of training items ``items("train")`` returns
DEFAULT_TRAIN_SIZE = 50_000
#: one question in ``TEST_BUCKETS`` lands in the test bucket
TEST_BUCKETS = 16


def is_test_question(task: str, question: str) -> bool:
    """Whether ``question`` belongs to the held-out bucket of ``task`` (stable across runs).

    sha256 rather than ``hash()``: Python salts ``hash`` per process, which would make the split
    change between runs.
    """
    digest = hashlib.sha256(f"{task}\x00{question}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0


@dataclass
class Draft:
    """One generated problem before it becomes an :class:`EvalItem`.

    ``forms`` lists every valid reference response; ``target`` is the one the generator's RNG
    picked for training. Keeping all forms lets tests check that each scores correct, and lets
    analysis tell a mixed-up answer (parts of two forms) from a plain wrong one.
    """

    question: str
    reference: str
    forms: list[str]
    target: str
    tests: tuple[str, ...] = ()
    entry_point: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class SyntheticTask(Task):
    """A :class:`Task` whose items come from a seeded generator (see module docstring)."""

    #: test items must also be distinct in this ``meta`` key (e.g. function names), if set
    distinct_test_key: str | None = None

    @abstractmethod
    def generate(self, rng: random.Random) -> Draft:
        """Draw one problem with ``rng`` (the only source of randomness, for determinism)."""

    # ------------------------------------------------------------------ items

    def _item(self, draft: Draft, item_id: str) -> EvalItem:
        meta = dict(draft.meta)
        meta["forms"] = tuple(draft.forms)
        return EvalItem(
            task=self.name,
            id=item_id,
            question=draft.question,
            reference=draft.reference,
            tests=draft.tests,
            entry_point=draft.entry_point,
            target=draft.target,
            meta=meta,
        )

    def test_items(self) -> list[EvalItem]:
        """The fixed test split: the first ``TEST_SIZE`` distinct test-bucket questions."""
        cached = getattr(self, "_test_cache", None)
        if cached is not None:
            return cached
        rng = random.Random(f"{self.name}:test")
        seen: set[str] = set()
        seen_keys: set[Any] = set()
        out: list[EvalItem] = []
        draws = 0
        while len(out) < TEST_SIZE:
            draws += 1
            if draws > TEST_SIZE * TEST_BUCKETS * 50:
                raise RuntimeError(f"{self.name}: question space too small for a test split")
            draft = self.generate(rng)
            if draft.question in seen or not is_test_question(self.name, draft.question):
                continue
            if self.distinct_test_key is not None:
                key = draft.meta[self.distinct_test_key]
                if key in seen_keys:
                    continue
                seen_keys.add(key)
            seen.add(draft.question)
            out.append(self._item(draft, f"{self.name}/test/{len(out)}"))
        self._test_cache = out
        return out

    def train_items(self, n: int = DEFAULT_TRAIN_SIZE, seed: int = 0) -> list[EvalItem]:
        """``n`` distinct training items, none of which is (or could ever be) a test question.

        Different seeds give different (possibly overlapping) training sets; the same seed
        always gives the same list, so training runs are reproducible.
        """
        rng = random.Random(f"{self.name}:train:{seed}")
        seen: set[str] = set()
        out: list[EvalItem] = []
        draws = 0
        while len(out) < n:
            draws += 1
            if draws > n * 50 + 10_000:
                raise RuntimeError(f"{self.name}: cannot draw {n} distinct training items")
            draft = self.generate(rng)
            if draft.question in seen or is_test_question(self.name, draft.question):
                continue
            seen.add(draft.question)
            out.append(self._item(draft, f"{self.name}/train/{seed}/{len(out)}"))
        logger.debug("%s: %d training items from %d draws", self.name, n, draws)
        return out

    def items(self, split: str = "test", limit: int | None = None) -> list[EvalItem]:
        """``test`` (500 fixed items) or ``train`` (``DEFAULT_TRAIN_SIZE`` unless ``limit``): the first ``limit``
        items (0: none). A negative ``limit`` is refused: as a slice it would drop items from the end and decode
        nearly all of them."""
        check_limit(self.name, limit)
        if split == "test":
            out = self.test_items()
            return list(out if limit is None else out[:limit])
        if split == "train":
            return self.train_items(DEFAULT_TRAIN_SIZE if limit is None else limit, seed=0)
        raise ValueError(f"{self.name}: unknown split {split!r} (use 'train' or 'test')")

    # ------------------------------------------------------------------ prompt

    def prompt(self, item: EvalItem, tokenizer: Any = None, chat: bool = True) -> str:
        """The question, wrapped in the tokenizer's chat template when ``chat`` (zero-shot).

        Zero-shot because the tiny models are trained on exactly this prompt: few-shot
        examples would only spend context on text they never saw in training.
        """
        return apply_chat(item.question, tokenizer, chat)

