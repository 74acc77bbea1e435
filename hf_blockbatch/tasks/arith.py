"""``arith``: GSM8K-shaped word problems whose arithmetic a ~1M-parameter model can learn.

Why these limits: a prior trial with numbers up to 15 and ``+ - *`` taught a tiny model the
format and the copying (~97 % right) but not the sums (6-17 % per equation), so answers were
right ~8 % of the time and no decoder comparison could be read off them. Here every equation is
a small fact from a closed set: ``v + k`` and ``v - k`` with ``k <= 9`` and ``v <= 20``, or
``v <= 25`` where ``v`` is a product (a chain that starts from ``a x b``, or a shop's bill: up to
``25 + 9 = 34``), a times table up to ``5 x 5`` (plus doubling up to 10 and halving/thirding),
and totals of two values up to 20. The *chain* still matters: each line's first operand is a value
computed on an earlier line, so a decoder that fills a later line before the earlier one has
settled gets it wrong, as on GSM8K.

Shape (GSM8K): question in prose, solution as short lines "..., so 3 + 4 = 7." and a final
``#### N``. Several valid forms: totals ("together they have 5 + 3") list their terms in
any order and products ("3 boxes of 4") may be written ``3 * 4`` or ``4 * 3``; the generator
picks one form per item with its RNG, the scorer reads only the final number. A decoder that
commits many positions at once can splice two orders into ``5 + 5``, then the sum is wrong:
that is the failure mode of large blocks and low thresholds in real dLLMs.
"""

from __future__ import annotations

import itertools
import random

from hf_blockbatch.tasks.base import Draft, SyntheticTask
from hf_blockbatch.tasks.contract import EvalItem, Score
from hf_blockbatch.tasks.words import CONTAINERS, PEOPLE, PRICED, THINGS

#: the largest value a gain, a doubling or a comparison's total reaches (the facts stay a small closed set); a
#: product reaches MAX_FACTOR ** 2 = 25, which a chain may start from and a shop's bill adds one digit to (34)
MAX_VALUE = 20
#: the second operand of + and - (one digit)
MAX_STEP = 9
#: factors of the times table
MIN_FACTOR, MAX_FACTOR = 2, 5


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _sum_forms(terms: list[int], template: str) -> list[str]:
    """Every ordering of a sum, rendered into ``template`` (``{expr}`` and ``{total}``)."""
    total = sum(terms)
    return [template.format(expr=" + ".join(map(str, p)), total=total) for p in itertools.permutations(terms)]


def _product_forms(a: int, b: int, template: str) -> list[str]:
    return [template.format(expr=f"{x} * {y}", total=a * b) for x, y in ((a, b), (b, a))]


class _Solution:
    """A solution under construction: lines, each with its alternative forms."""

    def __init__(self) -> None:
        self.lines: list[list[str]] = []

    def add(self, *forms: str) -> None:
        self.lines.append(list(dict.fromkeys(forms)))

    def render(self, rng: random.Random, answer: int) -> tuple[str, list[str]]:
        """The picked target and every valid form (the product of the per-line choices)."""
        chosen = [rng.choice(alts) for alts in self.lines]
        target = "\n".join(chosen) + f"\n#### {answer}"
        forms = ["\n".join(c) + f"\n#### {answer}" for c in itertools.product(*self.lines)]
        return target, forms


class ArithTask(SyntheticTask):
    """Word problems with a step-by-step solution; scored by the final number (GSM8K-style)."""

    name = "arith"
    kind = "number"
    #: the tiny checkpoints are trained on canvases of 72-96 answer tokens (targets are <= 68)
    default_gen_length = 96

    # ------------------------------------------------------------------ generation

    def generate(self, rng: random.Random) -> Draft:
        """:meth:`SyntheticTask.generate`: a chain, compare or shop problem (weights 5 : 4 : 2); its
        ``forms`` are every combination of each line's valid forms, its ``target`` one of them picked by ``rng``."""
        scenario = rng.choices(("chain", "compare", "shop"), weights=(5, 4, 2))[0]
        if scenario == "chain":
            question, sol, answer = self._chain(rng)
        elif scenario == "compare":
            question, sol, answer = self._compare(rng)
        else:
            question, sol, answer = self._shop(rng)
        target, forms = sol.render(rng, answer)
        return Draft(
            question=question,
            reference=str(answer),
            forms=forms,
            target=target,
            meta={"scenario": scenario, "lines": len(sol.lines)},
        )

    def _chain(self, rng: random.Random) -> tuple[str, _Solution, int]:
        """One person, a starting amount, then 2-3 changes: "Tom has 3 apples. He buys 4 more."""
        name, he, his = rng.choice(PEOPLE)
        other = rng.choice([p for p in PEOPLE if p[0] != name])[0]
        thing = rng.choice(THINGS)
        sol = _Solution()
        q: list[str] = []
        if rng.random() < 0.35:
            box = rng.choice(CONTAINERS)
            a, b = rng.randint(MIN_FACTOR, MAX_FACTOR), rng.randint(MIN_FACTOR, MAX_FACTOR)
            v = a * b
            q.append(f"{name} has {a} {box} with {b} {thing} in each.")
            sol.add(*_product_forms(a, b, f"{name} has {a} {box} of {b}, so {{expr}} = {{total}}."))
        else:
            v = rng.randint(2, 12)
            q.append(f"{name} has {v} {thing}.")
            sol.add(f"{name} has {v} {thing}.")
        n_ops = rng.randint(2, 3)
        final_q = f"How many {thing} does {name} have now?"
        for i in range(n_ops):
            last = i == n_ops - 1
            ops = []
            if v < MAX_VALUE:
                ops += ["gain", "gain"]
            if v >= 2:
                ops += ["lose", "lose"]
            if 1 <= v <= MAX_VALUE // 2:
                ops.append("double")
            if last and v >= 4 and (v % 2 == 0 or v % 3 == 0):
                ops.append("split")
            op = rng.choice(ops)
            lead = he if i == 0 else rng.choice((he, f"then {he}"))
            if op == "gain":
                k = rng.randint(1, min(MAX_STEP, MAX_VALUE - v))
                verb = rng.choice(("buys", "finds", "gets", "makes", "wins"))
                q.append(f"{_cap(lead)} {verb} {k} more.")
                sol.add(f"{_cap(he)} {verb} {k} more, so {v} + {k} = {v + k}.")
                v += k
            elif op == "lose":
                k = rng.randint(1, min(MAX_STEP, v - 1))
                if rng.random() < 0.5:
                    q.append(f"{_cap(lead)} gives {k} to {other}.")
                    sol.add(f"{_cap(he)} gives {k} to {other}, so {v} - {k} = {v - k}.")
                else:
                    verb = rng.choice(("loses", "sells", "uses", "breaks"))
                    q.append(f"{_cap(lead)} {verb} {k} of them.")
                    sol.add(f"{_cap(he)} {verb} {k}, so {v} - {k} = {v - k}.")
                v -= k
            elif op == "double":
                q.append(f"{_cap(lead)} doubles {his} {thing}.")
                sol.add(f"{_cap(he)} doubles them, so {v} * 2 = {v * 2}.")
                v *= 2
            else:  # split, always last: the question changes to "in each"
                k = 2 if v % 2 == 0 else 3
                if v % 2 == 0 and v % 3 == 0:
                    k = rng.choice((2, 3))
                box = rng.choice(CONTAINERS)
                q.append(f"{_cap(lead)} puts them into {k} {box} equally.")
                sol.add(f"{_cap(he)} puts {v} into {k} {box}, so {v} / {k} = {v // k}.")
                v //= k
                final_q = f"How many {thing} are in each of the {box}?"
        q.append(final_q)
        return " ".join(q), sol, v

    def _compare(self, rng: random.Random) -> tuple[str, _Solution, int]:
        """Two or three people whose amounts are defined from each other, then a look-up or total."""
        while True:
            drawn = self._compare_once(rng)
            if drawn is not None:
                return drawn

    def _compare_once(self, rng: random.Random) -> tuple[str, _Solution, int] | None:
        n_people = rng.choice((2, 3, 3))
        people = rng.sample(PEOPLE, n_people)
        thing = rng.choice(THINGS)
        sol = _Solution()
        a = rng.randint(2, 12)
        values = [a]
        q = [f"{people[0][0]} has {a} {thing}."]
        sol.add(f"{people[0][0]} has {a} {thing}.")
        for i in range(1, n_people):
            prev_name, prev = people[i - 1][0], values[-1]
            name = people[i][0]
            rels = []
            if prev < MAX_VALUE:
                rels += ["more", "more"]
            if prev >= 3:
                rels += ["fewer", "fewer"]
            if prev <= MAX_VALUE // 2:
                rels.append("twice")
            rel = rng.choice(rels)
            if rel == "more":
                k = rng.randint(1, min(MAX_STEP, MAX_VALUE - prev))
                q.append(f"{name} has {k} more {thing} than {prev_name}.")
                sol.add(f"{name} has {k} more than {prev_name}, so {prev} + {k} = {prev + k}.")
                values.append(prev + k)
            elif rel == "fewer":
                k = rng.randint(1, min(MAX_STEP, prev - 1))
                q.append(f"{name} has {k} fewer {thing} than {prev_name}.")
                sol.add(f"{name} has {k} fewer than {prev_name}, so {prev} - {k} = {prev - k}.")
                values.append(prev - k)
            else:
                q.append(f"{name} has twice as many {thing} as {prev_name}.")
                sol.add(f"{name} has twice as many as {prev_name}, so {prev} * 2 = {prev * 2}.")
                values.append(prev * 2)
        names = [p[0] for p in people]
        # totals only of two people whose sum stays <= MAX_VALUE, so that the sum is one small
        # fact too (sums of three, or of two values near 20, were most of the distinct facts)
        pairs = [
            (i, j)
            for i, j in itertools.combinations(range(n_people), 2)
            if values[i] + values[j] <= MAX_VALUE
        ]
        # a look-up of the last person needs two relations, so that every item has 2+ equations
        asks = (["last"] if n_people == 3 else []) + (["total", "total"] if pairs else [])
        if not asks:
            return None
        if rng.choice(asks) == "last":
            q.append(f"How many {thing} does {names[-1]} have?")
            answer = values[-1]  # the last relation already computed it: the solution ends there
        else:
            i, j = rng.choice(pairs)
            q.append(f"How many {thing} do {names[i]} and {names[j]} have together?")
            sol.add(*_sum_forms([values[i], values[j]], "Together they have {expr} = {total}."))
            answer = values[i] + values[j]
        return " ".join(q), sol, answer

    def _shop(self, rng: random.Random) -> tuple[str, _Solution, int]:
        """Buying several priced things and one extra: a product, then a sum in either order."""
        name, he, _ = rng.choice(PEOPLE)
        (one, many), (extra, _) = rng.sample(PRICED, 2)
        p, n = rng.randint(MIN_FACTOR, MAX_FACTOR), rng.randint(MIN_FACTOR, MAX_FACTOR)
        r = rng.randint(1, MAX_STEP)
        q = (
            f"A {one} costs {p} dollars and a {extra} costs {r} dollars. "
            f"{name} buys {n} {many} and one {extra}. How many dollars does {he} spend?"
        )
        sol = _Solution()
        sol.add(
            f"The {many} cost {n} * {p} = {n * p} dollars.", f"The {many} cost {p} * {n} = {n * p} dollars."
        )
        sol.add(f"The {extra} costs {r} dollars.")
        sol.add(*_sum_forms([n * p, r], f"{_cap(he)} spends {{expr}} = {{total}} dollars."))
        return q, sol, n * p + r

    # ------------------------------------------------------------------ scoring

    def score(self, item: EvalItem, completion: str) -> Score:
        """GSM8K scoring: the number after ``####`` (else the last number) against the answer."""
        from hf_blockbatch.tasks.scoring import extract_gsm8k_answer, numbers_equal

        pred = extract_gsm8k_answer(completion)
        return Score(
            correct=numbers_equal(pred, item.reference), extracted=pred, detail=f"gold={item.reference}"
        )
