"""``code``: MBPP-shaped tasks answered by a short Python function, scored by hidden asserts.

Why it looks like this:

* "Write a function `tally_goals` that takes x and returns ..." names the function in the
  prompt, and the answer must use that name verbatim. Names are drawn from 50 x 50 verb/noun
  halves, and the 500 test items all have different names: in a prior trial nearly every
  failure was a *guessed* name that shared a first letter with the right one, so the suite makes
  copying the name necessary, and measures it.
* Bodies are 1-4 lines of the most common Python idioms, so a ~1M-parameter model can learn
  them; constants come from the prompt (copied), not from reasoning.
* Many tasks have several valid bodies: ``x + 7`` / ``7 + x``, ``max(a, b)`` / ``max(b, a)``,
  ``len([...])`` / ``sum(1 for ...)``. The generator trains on one of them at random; a decoder
  that commits many tokens in one step can splice two into something that is not Python or
  computes the wrong thing (``len(1 for ...)``), which is how block size costs accuracy.
* Scoring executes the answer with hidden asserts in a sandboxed subprocess
  (:func:`hf_blockbatch.tasks.execution.run_program`), as MBPP does.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_blockbatch.tasks.base import Draft, SyntheticTask
from hf_blockbatch.tasks.contract import EvalItem, Score
from hf_blockbatch.tasks.scoring import extract_code
from hf_blockbatch.tasks.words import NAME_NOUNS, NAME_VERBS, WORDS


@dataclass
class _Spec:
    """One drawn task: prose, signature, valid bodies, and the behaviour the asserts check."""

    describe: str  # "takes x and returns x plus 7"
    args: str  # "x"
    bodies: list[str]  # each a complete indented body, possibly several lines
    fn: Callable[..., Any]  # the intended behaviour (computes the expected values)
    inputs: list[tuple[Any, ...]]  # argument tuples for the hidden asserts


def _ints(rng: random.Random, n: int = 3, lo: int = -5, hi: int = 20) -> list[tuple[int]]:
    return [(x,) for x in rng.sample(range(lo, hi + 1), n)]


def _lists(rng: random.Random, n: int = 3) -> list[tuple[list[int]]]:
    out = [([rng.randint(0, 12) for _ in range(rng.randint(3, 6))],) for _ in range(n - 1)]
    return [([],), *out] if rng.random() < 0.3 else out + [([rng.randint(0, 12) for _ in range(4)],)]


def _lists_around(rng: random.Random, k: int) -> list[tuple[list[int]]]:
    """``_lists`` and one list holding ``k`` and ``k + 1``: a "greater than k" spec whose random lists miss ``k``
    let ``x >= k`` pass (14 of 33 filter, 8 of 25 count and 15 of 28 sum items of the test split)."""
    return [*_lists(rng), ([k, k + 1],)]


def _ret(*exprs: str) -> list[str]:
    return [f"    return {e}" for e in exprs]


def _perm_sum(terms: list[str]) -> list[str]:
    return [" + ".join(p) for p in itertools.permutations(terms)]


# Each maker draws its constants with ``rng`` and returns a _Spec. Keep them small and varied.


def _add_const(rng: random.Random) -> _Spec:
    k = rng.randint(2, 9)
    return _Spec(
        f"takes x and returns x plus {k}", "x", _ret(f"x + {k}", f"{k} + x"), lambda x: x + k, _ints(rng)
    )


def _mul_const(rng: random.Random) -> _Spec:
    k = rng.randint(2, 9)
    return _Spec(
        f"takes x and returns x times {k}", "x", _ret(f"x * {k}", f"{k} * x"), lambda x: x * k, _ints(rng)
    )


def _sub_const(rng: random.Random) -> _Spec:
    k = rng.randint(2, 9)
    return _Spec(f"takes x and returns x minus {k}", "x", _ret(f"x - {k}"), lambda x: x - k, _ints(rng))


def _affine(rng: random.Random) -> _Spec:
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    forms = [f"x * {a} + {b}", f"{a} * x + {b}", f"{b} + x * {a}", f"{b} + {a} * x"]
    return _Spec(
        f"takes x and returns x times {a} plus {b}", "x", _ret(*forms), lambda x: x * a + b, _ints(rng)
    )


def _sum_two(rng: random.Random) -> _Spec:
    if rng.random() < 0.5:
        return _Spec(
            "takes a and b and returns their sum",
            "a, b",
            _ret("a + b", "b + a"),
            lambda a, b: a + b,
            [(rng.randint(-9, 20), rng.randint(-9, 20)) for _ in range(3)],
        )
    k = rng.randint(1, 9)
    return _Spec(
        f"takes a and b and returns a plus b plus {k}",
        "a, b",
        _ret(*_perm_sum(["a", "b", str(k)])),
        lambda a, b: a + b + k,
        [(rng.randint(-9, 20), rng.randint(-9, 20)) for _ in range(3)],
    )


def _product_two(rng: random.Random) -> _Spec:
    return _Spec(
        "takes a and b and returns their product",
        "a, b",
        _ret("a * b", "b * a"),
        lambda a, b: a * b,
        [(rng.randint(-5, 12), rng.randint(2, 12)) for _ in range(3)],
    )


def _max_min(rng: random.Random) -> _Spec:
    which = rng.choice(("max", "min"))
    word = "larger" if which == "max" else "smaller"
    fn = max if which == "max" else min
    pairs = [(rng.randint(-9, 20), rng.randint(-9, 20)) for _ in range(2)]
    pairs.append((pairs[0][1], pairs[0][0]))
    pairs.append((pairs[1][0] + 5, pairs[1][0]))
    pairs.append((pairs[1][0], pairs[1][0] + 5))  # with a tied first pair, `return a` passed every other pair
    return _Spec(
        f"takes a and b and returns the {word} of the two",
        "a, b",
        _ret(f"{which}(a, b)", f"{which}(b, a)"),
        fn,
        pairs,
    )


def _clamp(rng: random.Random) -> _Spec:
    k = rng.randint(3, 15)
    return _Spec(
        f"takes x and returns x, but never more than {k}",
        "x",
        _ret(f"min(x, {k})", f"min({k}, x)"),
        lambda x: min(x, k),
        [(k - 2,), (k,), (k + 3,)],
    )


def _abs_diff(rng: random.Random) -> _Spec:
    # both orders fixed: with two random pairs both a <= b (a quarter of the items), (3, 9) alone let b - a pass
    pairs = [(rng.randint(0, 20), rng.randint(0, 20)) for _ in range(2)] + [(3, 9), (9, 3)]
    return _Spec(
        "takes a and b and returns the absolute difference of a and b",
        "a, b",
        _ret("abs(a - b)", "abs(b - a)"),
        lambda a, b: abs(a - b),
        pairs,
    )


def _divisible(rng: random.Random) -> _Spec:
    k = rng.randint(2, 9)
    xs = [(k * rng.randint(1, 5),), (k * rng.randint(1, 5) + 1,), (0,), (k * 3 - 1,)]
    return _Spec(
        f"takes n and returns True if n is divisible by {k}, else False",
        "n",
        _ret(f"n % {k} == 0"),
        lambda n: n % k == 0,
        xs,
    )


def _even_odd_list(rng: random.Random) -> _Spec:
    which = rng.choice(("even", "odd"))
    cond = "x % 2 == 0" if which == "even" else "x % 2 == 1"
    return _Spec(
        f"takes a list xs and returns the {which} numbers in xs, in order",
        "xs",
        _ret(f"[x for x in xs if {cond}]"),
        lambda xs: [x for x in xs if (x % 2 == 0) == (which == "even")],
        _lists(rng),
    )


def _filter_gt(rng: random.Random) -> _Spec:
    k = rng.randint(2, 9)
    return _Spec(
        f"takes a list xs and returns the numbers in xs greater than {k}, in order",
        "xs",
        _ret(f"[x for x in xs if x > {k}]", f"[x for x in xs if {k} < x]"),
        lambda xs: [x for x in xs if x > k],
        _lists_around(rng, k),
    )


def _count_gt(rng: random.Random) -> _Spec:
    k = rng.randint(2, 9)
    return _Spec(
        f"takes a list xs and returns how many numbers in xs are greater than {k}",
        "xs",
        _ret(f"len([x for x in xs if x > {k}])", f"sum(1 for x in xs if x > {k})"),
        lambda xs: sum(1 for x in xs if x > k),
        _lists_around(rng, k),
    )


def _sum_gt(rng: random.Random) -> _Spec:
    k = rng.randint(2, 9)
    return _Spec(
        f"takes a list xs and returns the sum of the numbers in xs greater than {k}",
        "xs",
        _ret(f"sum(x for x in xs if x > {k})", f"sum([x for x in xs if x > {k}])"),
        lambda xs: sum(x for x in xs if x > k),
        _lists_around(rng, k),
    )


def _scale_list(rng: random.Random) -> _Spec:
    k = rng.randint(2, 9)
    return _Spec(
        f"takes a list xs and returns a new list with every number multiplied by {k}",
        "xs",
        _ret(f"[x * {k} for x in xs]", f"[{k} * x for x in xs]"),
        lambda xs: [x * k for x in xs],
        _lists(rng),
    )


def _list_agg(rng: random.Random) -> _Spec:
    which = rng.choice(("sum", "max", "min", "len"))
    prose = {
        "sum": "the sum of the numbers in xs",
        "max": "the largest number in xs",
        "min": "the smallest number in xs",
        "len": "how many items xs has",
    }[which]
    fn = {"sum": sum, "max": max, "min": min, "len": len}[which]
    inputs = _lists(rng)
    if which in ("max", "min"):
        inputs = [t for t in inputs if t[0]] or [([3, 1, 2],)]
    bodies = _ret(f"{which}(xs)")
    if which == "sum":  # a loop is as valid as the builtin, and much longer: a mixing hazard
        bodies.append("    total = 0\n    for x in xs:\n        total += x\n    return total")
    return _Spec(f"takes a list xs and returns {prose}", "xs", bodies, fn, inputs)


def _first_last(rng: random.Random) -> _Spec:
    which = rng.choice(("first", "last"))
    idx = "0" if which == "first" else "-1"
    inputs = [t for t in _lists(rng) if t[0]] + [([7, 8, 9],)]
    return _Spec(
        f"takes a list xs and returns the {which} item of xs",
        "xs",
        _ret(f"xs[{idx}]"),
        lambda xs: xs[int(idx)],
        inputs,
    )


def _string(rng: random.Random) -> _Spec:
    which = rng.choice(("upper", "reverse", "length", "repeat", "join"))
    words = [(w,) for w in rng.sample(WORDS, 3)]
    if which == "upper":
        return _Spec("takes a string s and returns s in upper case", "s", _ret("s.upper()"), str.upper, words)
    if which == "reverse":
        return _Spec(
            "takes a string s and returns s reversed", "s", _ret("s[::-1]"), lambda s: s[::-1], words
        )
    if which == "length":
        return _Spec(
            "takes a string s and returns the number of characters in s", "s", _ret("len(s)"), len, words
        )
    if which == "repeat":
        k = rng.randint(2, 5)
        return _Spec(
            f"takes a string s and returns s repeated {k} times",
            "s",
            _ret(f"s * {k}", f"{k} * s"),
            lambda s: s * k,
            words,
        )
    pairs = [tuple(rng.sample(WORDS, 2)) for _ in range(3)]
    sep = rng.choice((" ", "-", ""))
    expr = f"a + {sep!r} + b" if sep else "a + b"
    prose = {
        " ": "with a space between them",
        "-": "with a dash between them",
        "": "with nothing between them",
    }[sep]
    return _Spec(
        f"takes strings a and b and returns a followed by b, {prose}",
        "a, b",
        _ret(expr),
        lambda a, b: a + sep + b,
        pairs,
    )


def _even_step(rng: random.Random) -> _Spec:
    k = rng.randint(1, 9)
    bodies = [
        f"    if x % 2 == 0:\n        return x + {k}\n    return x",
        f"    if x % 2 == 0:\n        return {k} + x\n    return x",
    ]
    return _Spec(
        f"takes x and returns x plus {k} if x is even, else x unchanged",
        "x",
        bodies,
        lambda x: x + k if x % 2 == 0 else x,
        [(2,), (3,), (10,), (7,)],
    )


_MAKERS: tuple[tuple[Callable[[random.Random], _Spec], int], ...] = (
    (_add_const, 3),
    (_mul_const, 3),
    (_sub_const, 2),
    (_affine, 2),
    (_sum_two, 3),
    (_product_two, 1),
    (_max_min, 2),
    (_clamp, 1),
    (_abs_diff, 1),
    (_divisible, 2),
    (_even_odd_list, 2),
    (_filter_gt, 2),
    (_count_gt, 2),
    (_sum_gt, 2),
    (_scale_list, 2),
    (_list_agg, 2),
    (_first_last, 1),
    (_string, 3),
    (_even_step, 1),
)

class CodeTask(SyntheticTask):
    """Short functions named in the prompt; scored by executing hidden asserts (MBPP-style)."""

    name = "code"
    kind = "code"
    #: the tiny checkpoints are trained on canvases of 72-96 answer tokens (targets are <= 32)
    default_gen_length = 96
    distinct_test_key = "name"

    def generate(self, rng: random.Random) -> Draft:
        """:meth:`SyntheticTask.generate`: a function from one of the weighted templates, under a
        drawn ``verb_noun`` name; its forms are the template's bodies under the ``def`` line, fenced, its tests
        asserts of what the template's reference function returns on its inputs."""
        makers, weights = zip(*_MAKERS)
        maker = rng.choices(makers, weights=weights)[0]
        fname = f"{rng.choice(NAME_VERBS)}_{rng.choice(NAME_NOUNS)}"
        spec = maker(rng)
        head = f"def {fname}({spec.args}):\n"
        forms = [f"```python\n{head}{body}\n```" for body in dict.fromkeys(spec.bodies)]
        target = rng.choice(forms)
        tests = tuple(
            f"assert {fname}({', '.join(map(repr, args))}) == {spec.fn(*args)!r}" for args in spec.inputs
        )
        question = f"Write a function `{fname}` that {spec.describe}."
        return Draft(
            question=question,
            reference=forms[0],
            forms=forms,
            target=target,
            tests=tests,
            entry_point=fname,
            meta={"name": fname, "template": maker.__name__.lstrip("_")},
        )

    def program(self, item: EvalItem, completion: str) -> str:
        """The program that is executed: the answer's code, then the hidden asserts."""
        return extract_code(completion).rstrip() + "\n\n" + "\n".join(item.tests) + "\n"

    def score(self, item: EvalItem, completion: str) -> Score:
        """:meth:`Task.score`: right when :meth:`program` runs to its end in the sandbox; ``extracted`` is the
        answer's code."""
        from hf_blockbatch.tasks.execution import run_program

        completion = completion or ""  # no completion scores as an empty one, as the other suites do
        code = extract_code(completion)
        res = run_program(self.program(item, completion))
        # a timeout or a child that died without a verdict is not a failed assert: the detail says which (a sandbox
        # that could not start raises SandboxStartError: no item is scored without one)
        detail = "passed" if res.passed else "failed hidden asserts" if res.status == "failed" else f"{res.status}: {res.detail}"
        return Score(correct=res.passed, extracted=code, detail=detail)
