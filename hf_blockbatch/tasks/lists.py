"""``lists``: small list problems whose answers come in several equally valid forms.

Why this suite exists: the testbed has to show that committing many positions at once costs
accuracy, and the clearest cause in real dLLMs is *multi-modality*: when an answer has several
valid forms, each masked position's marginal mixes them, and filling positions independently
splices forms together. "Two numbers from 2, 5, 7, 3, 8 that add up to 10" has the answers
``2, 8``, ``8, 2``, ``7, 3`` and ``3, 7``; filling both positions in one step from their
marginals can give ``2, 3``, which is wrong. Left-to-right (small blocks, or a high confidence
threshold) conditions the second number on the first and gets it right.

The kinds:

* ``filter`` (even / odd / greater than k / less than k): the answer is a *set*; the target lists
  it in a random order, the scorer accepts any order (no repeats, nothing missing).
* ``pair``: any pair of distinct list entries with the asked sum, in either order; the lists are
  drawn so that there are usually two or more pairs.
* ``sort``: one valid form (ascending or descending); the contrast case, where every position
  is determined and parallel filling is safe once the model knows the answer.

All numbers are single digits (one token each), distinct within a list. Format: one sentence,
then ``#### a, b, c`` (GSM8K's marker, so the same answer-extraction habits apply).
"""

from __future__ import annotations

import itertools
import random
import re

from hf_blockbatch.tasks.base import Draft, SyntheticTask
from hf_blockbatch.tasks.contract import EvalItem, Score

_FILTERS = {
    "even": (
        "Which of these numbers are even: {nums}?",
        "The even numbers are {ans}.",
        lambda x, k: x % 2 == 0,
    ),
    "odd": ("Which of these numbers are odd: {nums}?", "The odd numbers are {ans}.", lambda x, k: x % 2 == 1),
    "gt": (
        "Which of these numbers are greater than {k}: {nums}?",
        "The numbers greater than {k} are {ans}.",
        lambda x, k: x > k,
    ),
    "lt": (
        "Which of these numbers are less than {k}: {nums}?",
        "The numbers less than {k} are {ans}.",
        lambda x, k: x < k,
    ),
}

_INT_RE = re.compile(r"-?\d+")


def _fmt(xs: list[int] | tuple[int, ...]) -> str:
    return ", ".join(map(str, xs))


def parse_list_answer(completion: str) -> list[int] | None:
    """The integers after the last ``####`` (``None`` when there is no marker).

    Only the line of the marker counts, so trailing junk after the answer line (a repeated
    sentence, say) is not read as part of the list.
    """
    if "####" not in completion:
        return None
    tail = completion[completion.rfind("####") + 4 :].strip().split("\n", 1)[0]
    return [int(x) for x in _INT_RE.findall(tail)]


class ListsTask(SyntheticTask):
    """Filter / pick-a-pair / sort over single digits; order-free or multi-form answers."""

    name = "lists"
    kind = "number"  # answers are read after "####" like GSM8K, but compared as lists
    default_gen_length = 64

    def generate(self, rng: random.Random) -> Draft:
        """:meth:`SyntheticTask.generate`: a filter, pair or sort problem (weights 4 : 4 : 2);
        ``meta["kind"]`` and the numbers in ``meta`` are what :meth:`score` checks against, not ``reference``."""
        kind = rng.choices(("filter", "pair", "sort"), weights=(4, 4, 2))[0]
        if kind == "filter":
            return self._filter(rng)
        if kind == "pair":
            return self._pair(rng)
        return self._sort(rng)

    def _filter(self, rng: random.Random) -> Draft:
        while True:
            which = rng.choice(tuple(_FILTERS))
            nums = rng.sample(range(10), rng.randint(5, 7))
            k = rng.randint(3, 6)
            q_tpl, a_tpl, keep = _FILTERS[which]
            answer = [x for x in nums if keep(x, k)]
            if 2 <= len(answer) <= 4:
                break
        # at most 24 orders: all of them are valid forms
        forms = [f"{a_tpl.format(k=k, ans=_fmt(p))}\n#### {_fmt(p)}" for p in itertools.permutations(answer)]
        return Draft(
            question=q_tpl.format(k=k, nums=_fmt(nums)),
            reference=_fmt(sorted(answer)),
            forms=forms,
            target=rng.choice(forms),
            meta={"kind": "filter", "numbers": tuple(nums), "answer": tuple(sorted(answer))},
        )

    def _pair(self, rng: random.Random) -> Draft:
        while True:
            nums = rng.sample(range(1, 10), rng.randint(5, 6))
            sums: dict[int, list[tuple[int, int]]] = {}
            for a, b in itertools.combinations(nums, 2):
                sums.setdefault(a + b, []).append((a, b))
            # prefer totals with two or more pairs (more valid forms to mix up)
            multi = [t for t, ps in sums.items() if len(ps) >= 2]
            total = rng.choice(multi) if multi and rng.random() < 0.85 else rng.choice(list(sums))
            if total >= 4:
                break
        pairs = sums[total]
        forms = [f"{a} + {b} = {total}.\n#### {a}, {b}" for x, y in pairs for a, b in ((x, y), (y, x))]
        return Draft(
            question=f"Pick two of these numbers that add up to {total}: {_fmt(nums)}.",
            reference=_fmt(pairs[0]),
            forms=forms,
            target=rng.choice(forms),
            meta={"kind": "pair", "numbers": tuple(nums), "total": total},
        )

    def _sort(self, rng: random.Random) -> Draft:
        nums = rng.sample(range(10), rng.randint(4, 6))
        desc = rng.random() < 0.3
        order = "largest to smallest" if desc else "smallest to largest"
        answer = sorted(nums, reverse=desc)
        form = f"From {order}: {_fmt(answer)}.\n#### {_fmt(answer)}"
        return Draft(
            question=f"Sort these numbers from {order}: {_fmt(nums)}.",
            reference=_fmt(answer),
            forms=[form],
            target=form,
            meta={"kind": "sort", "numbers": tuple(nums), "answer": tuple(answer)},
        )

    def score(self, item: EvalItem, completion: str) -> Score:
        """Check the list after ``####`` against the item's rule (any valid form is right)."""
        got = parse_list_answer(completion or "")  # no completion scores as an empty one, as the other suites do
        extracted = None if got is None else _fmt(got)
        kind = item.meta["kind"]
        if got is None:
            return Score(False, None, "no #### answer")
        if kind == "filter":
            ok = len(got) == len(set(got)) and sorted(got) == list(item.meta["answer"])
        elif kind == "pair":
            nums = item.meta["numbers"]
            ok = (
                len(got) == 2
                and got[0] != got[1]
                and all(x in nums for x in got)
                and sum(got) == item.meta["total"]
            )
        else:
            ok = got == list(item.meta["answer"])
        return Score(ok, extracted, f"{kind}; reference {item.reference}")
