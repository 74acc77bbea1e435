"""The synthetic suites: deterministic, leak-free, and scored right (every valid form, no wrong one)."""

from __future__ import annotations

import ast
import hashlib
import re

import pytest

from hf_blockbatch.tasks import SUITES, TEST_SIZE, ArithTask, CodeTask, ListsTask, get_suite, is_test_question
from hf_blockbatch.tasks.contract import EvalItem, Task
from hf_blockbatch.training.tokenizer import load_tokenizer

# sha256 of every test question + target, per suite. A change here means the test split
# changed: scores of trained checkpoints are no longer comparable, so change it on purpose only.
TEST_SPLIT_SHA = {
    "arith": "3f631c3bbf16190d",
    "code": "e57ea1fcdf50d90b",
    "lists": "961244eda7ccf9d3",
}


def _split_sha(items: list[EvalItem]) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(f"{it.question}\x00{it.target}\x01".encode())
    return h.hexdigest()[:16]


def test_registry():
    assert SUITES == ("arith", "code", "lists")
    for name in SUITES:
        suite = get_suite(name)
        assert isinstance(suite, Task) and suite.name == name
        assert get_suite(name) is suite
    with pytest.raises(KeyError):
        get_suite("nope")


@pytest.mark.parametrize("name", SUITES)
def test_test_split_fixed(name):
    items = get_suite(name).items("test")
    assert len(items) == TEST_SIZE
    assert len({it.question for it in items}) == TEST_SIZE
    assert len({it.id for it in items}) == TEST_SIZE
    assert all(is_test_question(name, it.question) for it in items)
    # a fresh instance regenerates the very same split; limit takes a prefix
    fresh = {"arith": ArithTask, "code": CodeTask, "lists": ListsTask}[name]()
    assert [(i.question, i.target) for i in fresh.items("test")] == [(i.question, i.target) for i in items]
    assert fresh.items("test", limit=7) == items[:7]
    assert _split_sha(items) == TEST_SPLIT_SHA[name]


@pytest.mark.parametrize("name", SUITES)
def test_train_deterministic_distinct_and_disjoint(name):
    suite = get_suite(name)
    a = suite.train_items(3000, seed=0)
    assert [(i.question, i.target) for i in a] == [
        (i.question, i.target) for i in suite.train_items(3000, seed=0)
    ]
    assert len({i.question for i in a}) == 3000
    other = suite.train_items(300, seed=1)
    assert [i.question for i in other] != [i.question for i in a[:300]]
    test_q = {i.question for i in suite.items("test")}
    assert not test_q & {i.question for i in a}
    assert not test_q & {i.question for i in other}
    assert suite.items("train", limit=50) == a[:50]
    assert suite.items("test", limit=0) == [] and suite.items("train", limit=0) == []  # 0: no item, not an error
    with pytest.raises(ValueError):
        suite.items("validation")


@pytest.mark.parametrize("name", ["arith", "lists"])
def test_every_form_of_every_test_item_scores_correct(name):
    suite = get_suite(name)
    items = suite.items("test")
    for it in items:
        forms = it.meta["forms"]
        assert it.target in forms
        for form in forms:
            assert suite.score(it, form).correct, (it.question, form)
    # several valid forms are common, not a corner case
    assert sum(len(it.meta["forms"]) > 1 for it in items) >= 0.4 * len(items)


def test_arith_shape_and_corruptions():
    suite = get_suite("arith")
    for it in suite.items("test", limit=100):
        lines = it.target.split("\n")
        assert lines[-1] == f"#### {it.reference}"
        assert sum(" = " in line for line in lines) >= 2  # at least two computed values
        wrong = it.target.rsplit("####", 1)[0] + f"#### {int(it.reference) + 1}"
        assert not suite.score(it, wrong).correct
        assert not suite.score(it, "I do not know.").correct
        # "#### 7" with extra text after it still reads the number (GSM8K extraction)
        assert suite.score(it, it.target + "\nDone.").correct
    # every number a solution computes stays small (the learnability constraint)
    for it in suite.items("test"):
        for line in (ln for ln in it.target.split("\n") if " = " in ln):
            result = int(line.rsplit("= ", 1)[1].split()[0].rstrip("."))
            assert 0 <= result <= 60


def test_lists_rules_and_mixed_forms():
    suite = get_suite("lists")
    items = suite.items("test")
    kinds = {it.meta["kind"] for it in items}
    assert kinds == {"filter", "pair", "sort"}
    for it in items:
        kind = it.meta["kind"]
        got = [int(x) for x in it.target.rsplit("#### ", 1)[1].split(", ")]
        if kind == "filter":
            assert not suite.score(it, "#### " + ", ".join(map(str, got[:-1]))).correct  # one missing
            assert not suite.score(it, "#### " + ", ".join(map(str, got + got[:1]))).correct  # a repeat
        elif kind == "pair":
            assert not suite.score(it, f"#### {got[0]}, {got[0]}").correct
            assert not suite.score(it, f"#### {got[0]}, {got[1] + 1}").correct
        else:
            assert not suite.score(it, "#### " + ", ".join(map(str, got[::-1]))).correct
        assert not suite.score(it, it.target.replace("####", "")).correct
    # splicing two valid forms (first number of one, second of another) is wrong: the failure
    # mode of committing many positions at once
    pair = next(it for it in items if it.meta["kind"] == "pair" and len(it.meta["forms"]) >= 4)
    answers = [f.rsplit("#### ", 1)[1].split(", ") for f in pair.meta["forms"]]
    spliced = {(a[0], b[1]) for a in answers for b in answers} - {tuple(a) for a in answers}
    assert spliced
    for a, b in spliced:
        assert not suite.score(pair, f"#### {a}, {b}").correct


def test_code_targets_pass_and_corruptions_fail():
    suite = get_suite("code")
    items = suite.items("test")
    assert len({it.entry_point for it in items}) == TEST_SIZE  # distinct names
    for it in items:
        assert it.question.startswith(f"Write a function `{it.entry_point}` ")
        assert f"def {it.entry_point}(" in it.target and it.tests
        assert all(t.startswith(f"assert {it.entry_point}(") for t in it.tests)
        assert 1 <= it.target.count("\n    ") <= 4  # 1-4 body lines
    sample = items[::17]  # 30 items, every template family represented over the split
    multi = [it for it in sample if len(it.meta["forms"]) > 1][:6]
    for it in sample:
        assert suite.score(it, it.target).correct, it.target
    for it in multi:
        for form in it.meta["forms"]:
            assert suite.score(it, form).correct, form
    for it in sample[:8]:
        renamed = it.target.replace(f"def {it.entry_point}(", f"def {it.entry_point}_v2(")
        assert not suite.score(it, renamed).correct
        head = it.target.split("\n")[1]
        assert not suite.score(it, f"```python\n{head}\n    return None\n```").correct
    # the code inside an unclosed fence (cut off by the generation length) still counts
    it = sample[0]
    assert suite.score(it, it.target[: -len("```")]).correct


def _hidden_cases(item: EvalItem) -> list[tuple[tuple, object]]:
    """``(arguments, expected)`` of each hidden ``assert f(args) == expected``, read without executing anything."""
    cases = []
    for test in item.tests:
        node = ast.parse(test).body[0].test
        cases.append((tuple(ast.literal_eval(a) for a in node.left.args), ast.literal_eval(node.comparators[0])))
    return cases


def _bound(question: str) -> int:
    """The ``k`` of a "greater than k" question."""
    return int(re.search(r"greater than (\d+)", question).group(1))


#: per code template (given its question), plausible wrong answers that its hidden asserts must reject
NEAR_MISSES = {
    "clamp": lambda q: (lambda x: x,),  # never clamps
    "max_min": lambda q: (lambda a, b: a, lambda a, b: b),  # one argument, whichever is larger
    "abs_diff": lambda q: (lambda a, b: a - b, lambda a, b: b - a),  # a signed difference, either way round
    # "greater than k" read as "at least k" (the random lists often miss k itself)
    "filter_gt": lambda q: (lambda xs: [x for x in xs if x >= _bound(q)],),
    "count_gt": lambda q: (lambda xs: sum(1 for x in xs if x >= _bound(q)),),
    "sum_gt": lambda q: (lambda xs: sum(x for x in xs if x >= _bound(q)),),
    "divisible": lambda q: (lambda n: True, lambda n: False),
    "first_last": lambda q: (lambda xs: xs[-1],) if "the first item" in q else (lambda xs: xs[0],),  # the other end
    "even_step": lambda q: (lambda x: x,),
}


def test_code_asserts_reject_near_misses():
    """The inputs of the hidden asserts tell the right function from its near misses on every test item and on
    2,000 training items: a clamp gets an input above its bound, max/min a pair in both orders and one with a clear
    winner, abs_diff both orders, a "greater than k" filter a list holding k (before: ``b - a`` passed 4 of the 12
    abs_diff test items, ``x >= k`` 37 of the 86 greater-than ones, and ``return a`` 1.8 % of generated max/min
    items)."""
    checked = 0
    code = get_suite("code")
    for it in code.items("test") + code.items("train", limit=2000):
        cases = _hidden_cases(it)
        for miss in NEAR_MISSES.get(it.meta["template"], lambda q: ())(it.question):
            assert not all(miss(*args) == expected for args, expected in cases), (it.question, it.tests)
            checked += 1
    assert checked >= 1000


@pytest.mark.parametrize("name", SUITES)
def test_prompt_and_lengths_fit(name):
    suite = get_suite(name)
    items = suite.items("test")
    assert suite.prompt(items[0], None) == items[0].question
    assert suite.prompt(items[0], object(), chat=False) == items[0].question
    tok = load_tokenizer("llada")
    assert suite.prompt(items[0], tok, chat=False) == items[0].question  # chat=False: the bare question
    p = suite.prompt(items[0], tok)
    assert p.startswith("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n" + items[0].question)
    assert p.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    # every reference response plus its end-of-text token fits the default generation length
    longest = max(len(tok(it.target, add_special_tokens=False)["input_ids"]) for it in items)
    assert longest + 1 <= suite.default_gen_length


def test_lists_and_code_scoring_edges():
    """A pair uses two different numbers of the list; the list answer is the last marker's line; a code answer must
    pass every hidden assert, not only the first."""
    lists = get_suite("lists")
    pair = EvalItem(task="lists", id="p", question="?", reference="3, 5",
                    meta={"kind": "pair", "numbers": (1, 3, 4, 5, 9), "total": 8})  # fmt: skip
    assert lists.score(pair, "#### 5, 3").correct
    assert not lists.score(pair, "#### 4, 4").correct  # one number twice
    assert not lists.score(pair, "#### 1, 7").correct  # 7 is not in the list
    sort = EvalItem(task="lists", id="s", question="?", reference="1, 2, 3",
                    meta={"kind": "sort", "numbers": (3, 1, 2), "answer": (1, 2, 3)})  # fmt: skip
    assert lists.score(sort, "#### 3, 2, 1\n#### 1, 2, 3").correct
    assert lists.score(sort, "#### 1, 2, 3\nand 4 more").correct
    code = get_suite("code")
    item = EvalItem(task="code", id="c", question="?", reference="", tests=("assert f(1) == 2", "assert f(2) == 3"),
                    entry_point="f")  # fmt: skip
    assert code.score(item, "def f(x):\n    return x + 1\n").correct
    assert not code.score(item, "def f(x):\n    return 2\n").correct
