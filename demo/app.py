"""BlockBatch vs Fast-dLLM, side by side: a Gradio app for Hugging Face Spaces and local use.

One prompt is answered twice on the same model, by Fast-dLLM (dual cache, the paper's baseline)
and by BlockBatch. Both runs record a trace (``output_trace=True``); the app then replays the
traces in lock-step *by forward pass*, so that one frame is one NFE on both sides and the side
that needs fewer forwards visibly finishes first. Replaying instead of streaming the live run keeps
the measured latencies honest (no UI work inside the timed decode) and lets many visitors watch
while only ``--concurrency`` decodes run at once.

Run it with ``python demo/app.py`` or ``hf-blockbatch demo`` (``--model`` takes any LLaDA/Dream
checkpoint; the default is the embedded tiny LLaDA on CPU, the GPU is used when present).
Nothing here executes generated text: tokens are only decoded and HTML-escaped.
"""

from __future__ import annotations

import argparse
import functools
import html
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # a Space or a laptop offline: no phoning home

import gradio as gr  # noqa: E402
import torch  # noqa: E402


def _ensure_package() -> None:
    """Make ``hf_blockbatch`` importable when it is not installed: a Space that holds a copy of the
    package next to ``app.py`` (see demo/README.md), or a checkout run as ``python demo/app.py``."""
    try:
        import hf_blockbatch  # noqa: F401
    except ImportError:
        here = Path(__file__).resolve().parent
        for root in (here, here.parent):
            if (root / "hf_blockbatch" / "__init__.py").exists():
                sys.path.insert(0, str(root))
                return


_ensure_package()

import hf_blockbatch as hb  # noqa: E402
from hf_blockbatch.checks import check_positive_int  # noqa: E402
from hf_blockbatch.cli import DEMO_MIN_NEW_TOKENS as MIN_NEW_TOKENS  # noqa: E402  (the slider's start, and the CLI's)
from hf_blockbatch.cli import demo_max_new_tokens, port_number  # noqa: E402
from hf_blockbatch.eval.script_args import positive_int  # noqa: E402
from hf_blockbatch.generation.configs import DRAFTED, DRAFTED_CONTAINED, LEAN, LEAN_GUARDS  # noqa: E402
from hf_blockbatch.generation.outputs import answer_lengths  # noqa: E402
from hf_blockbatch.generation.trace import CommitEvent, MergeEvent, SyncEvent, TraceEvent  # noqa: E402

logger = logging.getLogger("hf_blockbatch.demo")

__all__ = [
    "BLOCK_CHOICES",
    "CSS",
    "InputError",
    "Limits",
    "LoadedModel",
    "Settings",
    "SideResult",
    "build_demo",
    "build_frames",
    "check_settings",
    "compare_once",
    "encode_prompt",
    "example_prompts",
    "launch_demo",
    "load_for_demo",
    "main",
    "random_tiny_llada",
    "warm_up",
]

BLOCK_CHOICES: tuple[int, ...] = (4, 8, 16, 32, 64, 128)
SPEEDS = {"slow": 14.0, "normal": 6.0, "fast": 2.0, "instant": 0.0}  # seconds a whole replay should take
MAX_FRAMES = 120  # longer runs replay several forwards per frame: a browser cannot show more usefully


@dataclass
class Limits:
    """What a public Space accepts. Larger requests are refused with a message, never truncated
    silently: a visitor should know why the answer is shorter than asked."""

    max_prompt_chars: int = 2000
    max_prompt_tokens: int = 512
    max_new_tokens: int = 256
    max_temperature: float = 2.0


class InputError(ValueError):
    """A setting or prompt the demo refuses; the message says what to change."""


# ----------------------------------------------------------------------------------------- model


@dataclass
class LoadedModel:
    """The model every request shares, its tokenizer, and what the page should say about it."""

    model: Any
    tokenizer: Any
    label: str
    notice: str = ""  # shown as a banner: e.g. the embedded weights are missing

    @property
    def device(self) -> torch.device:
        return self.model.device


def random_tiny_llada(tokenizer_dir: str) -> LoadedModel:
    """A randomly initialised 2-layer LLaDA with the embedded tokenizer, for when no trained weights
    exist: its output is noise and its confidences flat (so its branches rarely merge or sync), but
    the page and the whole decoding path still work, which is what the tests need."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.padding_side = "left"
    vocab = int(math.ceil(len(tokenizer) / 8) * 8)
    eos = tokenizer.eos_token_id
    config = hb.LLaDAConfig(
        d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=vocab, embedding_size=vocab,
        max_sequence_length=1024, mask_token_id=tokenizer.mask_token_id, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
        bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = hb.LLaDAModelLM(config).eval()
    return LoadedModel(model, tokenizer, "random tiny LLaDA (untrained)")


def warm_up(loaded: LoadedModel) -> None:
    """One short untimed decode of each strategy, so that the first visitor's Fast-dLLM run (it runs
    first) does not pay for lazy initialisation and look slower than it is."""
    ids = encode_prompt(loaded.tokenizer, "Hi")
    for cfg in (
        hb.FastDLLMConfig(max_new_tokens=8, block_length=4),
        hb.BlockBatchConfig(max_new_tokens=8, block_sizes=[4, 8]),
    ):
        loaded.model.generate(ids.to(loaded.device), generation_config=cfg)


def load_for_demo(name: str = "tiny-llada", device: str | None = None, warmup: bool = True) -> LoadedModel:
    """Load a model for the demo, with a short warm-up decode (see :func:`_load`)."""
    loaded = _load(name, device)
    if warmup:
        warm_up(loaded)
    return loaded


def _load(name: str, device: str | None) -> LoadedModel:
    """Load ``name`` (``tiny-llada``, ``tiny-dream``, a Hub id or a folder) for the demo.

    The embedded checkpoints may ship without weights (they are trained separately); then the demo
    still starts, on the other embedded checkpoint or on a random tiny LLaDA, and says so on the
    page, so that a Space never fails to boot over a missing file. An explicitly named checkpoint
    that fails to load is an error: falling back would hide the user's mistake.
    """
    aliases = {"tiny-llada": hb.TINY_LLADA, "tiny-dream": hb.TINY_DREAM}
    if name not in aliases:
        model, tokenizer = hb.load_model(name, device=device)
        label = Path(name).name if Path(name).is_dir() else name  # a local folder: its name, not the path
        return LoadedModel(model, tokenizer, label)
    for candidate in [name] + [a for a in aliases if a != name]:
        if (Path(aliases[candidate]) / "config.json").exists():
            model, tokenizer = hb.load_model(candidate, device=device)
            notice = "" if candidate == name else (
                f"The embedded checkpoint <b>{name}</b> has no weights in this installation; "
                f"showing <b>{candidate}</b> instead."
            )  # fmt: skip
            return LoadedModel(model, tokenizer, candidate, notice)
    loaded = random_tiny_llada(aliases["tiny-llada"])
    if device is not None or torch.cuda.is_available():
        loaded.model.to(device or "cuda")
    loaded.notice = (
        f"The embedded checkpoint <b>{name}</b> has no weights in this installation (they are trained "
        "separately), so this demo runs a <b>randomly initialised</b> tiny LLaDA: the text is noise, but "
        "every decoding mechanism is real. Start it with <code>--model</code> to use a trained checkpoint."
    )
    logger.warning("embedded weights for %s are absent; using a random tiny LLaDA", name)
    return loaded


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = True) -> torch.Tensor:
    """``[1, Lp]`` ids: through the chat template when the tokenizer has one (instruct models),
    as plain text otherwise, always without extra special tokens, as the CLI does."""
    from hf_blockbatch.tasks.contract import apply_chat

    return tokenizer(apply_chat(prompt, tokenizer, chat), add_special_tokens=False, return_tensors="pt").input_ids


#: Test items of the tiny suites shown as examples (suite, index in the test split): ones the embedded
#: tiny-llada answers right with both strategies at the page's default settings (a test checks it),
#: so a first visit shows the comparison rather than two wrong answers. The tiny models answer only
#: the suites' kinds of question (arith word problems, small Python functions, list questions).
EXAMPLE_ITEMS: tuple[tuple[str, int], ...] = (("arith", 1), ("code", 0), ("lists", 3), ("arith", 4), ("code", 1),
                                               ("lists", 7))  # fmt: skip


def example_prompts(items: tuple[tuple[str, int], ...] = EXAMPLE_ITEMS) -> list[str]:
    """Test questions of the tiny suites: what the embedded checkpoints were trained to answer."""
    try:
        from hf_blockbatch.tasks import get_suite
    except ImportError:  # a trimmed copy of the package without the testbed
        return ["Mia has 3 apples. She buys 4 more apples. How many apples does she have now?"]
    return [get_suite(suite).items("test", index + 1)[index].question for suite, index in items]


@functools.lru_cache(maxsize=1)
def _suite_questions() -> dict[str, tuple[Any, Any]]:
    """Every test question of the tiny suites -> (its suite, its item), to mark answers."""
    try:
        from hf_blockbatch.tasks import SUITES, get_suite
    except ImportError:
        return {}
    return {item.question.strip(): (get_suite(name), item) for name in SUITES for item in get_suite(name).items("test")}


def suite_verdict(prompt: str, answer: str) -> dict[str, Any] | None:
    """When ``prompt`` is a suite's test question: whether ``answer`` is right by that suite's own
    scorer (what the bench counts), with the reference; ``None`` for any other prompt."""
    found = _suite_questions().get(prompt.strip())
    if found is None:
        return None
    task, item = found
    score = task.score(item, answer)
    # a code answer is judged by running the suite's tests, so its reference is that, not a text to compare
    reference = "its tests" if task.kind == "code" else item.reference
    return {"suite": task.name, "correct": bool(score.correct), "reference": reference, "extracted": score.extracted}


# -------------------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """One comparison's inputs after validation."""

    prompt: str
    max_new_tokens: int = 64
    fast_block: int = 32
    block_sizes: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64])
    threshold: float = 0.9
    merge_threshold: float = 0.5
    temperature: float = 0.0
    seed: int = 0
    sync_threshold: int = 8
    refresh_interval: int = 32
    chat: bool = True
    speed: str = "normal"
    #: Fast-dLLM stops at EOS too (as BlockBatch does): on short answers early stop alone explains
    #: much of BlockBatch's saving, so the visitor chooses which baseline to compare with
    fast_early_stop: bool = False
    #: both strategies query only a window's masks and stale positions (``window_queries="sparse"``):
    #: the same NFE, about half the positions through the model
    sparse: bool = False
    #: BlockBatch's guards beyond the paper (benchmarks/RESULTS.md §11): merges only where both rows
    #: agree within 2 positions and the source holds its token at >= 0.7, the widest EOS hitter wins,
    #: a branch retires once synced; with sparse queries, the re-query radius 6 of that configuration
    guarded: bool = False
    #: Fast-dLLM with exact lookahead drafts (benchmarks/RESULTS.md §12-14, ``FastDLLMConfig.drafted``):
    #: draft rows run its likely next step in the same forward; the same tokens in fewer forwards (sampled, with
    #: the seed's keyed noise: the same sample with sparse queries; with dense ones almost always, §38-§39)
    fast_drafts: bool = False
    #: ... also adopted when the step committed their tokens and more (benchmarks/RESULTS.md §16,
    #: ``FastDLLMConfig.drafted(exact=False)``): fewer forwards again, not the same tokens
    fast_contained: bool = False

    def fast_config(self) -> hb.FastDLLMConfig:
        # the preset's draft options; its early stop and queries are the visitor's own switches
        preset = DRAFTED_CONTAINED if self.fast_contained else DRAFTED
        drafts = {k: v for k, v in preset.items() if k.startswith("lookahead")} if self.fast_drafts else {}
        if not self.sparse:  # the drafts' own re-query radius is a sparse step's: dense drafts query their window
            drafts.pop("lookahead_draft_radius", None)
        return hb.FastDLLMConfig(
            max_new_tokens=self.max_new_tokens, block_length=self.fast_block, threshold=self.threshold, cache="dual",
            temperature=self.temperature, early_stop=self.fast_early_stop, output_trace=True,
            window_queries="sparse" if self.sparse else "all", seed=self.seed, **drafts,
        )  # fmt: skip

    def blockbatch_config(self) -> hb.BlockBatchConfig:
        guards = ({**LEAN_GUARDS, **({"requery_radius": LEAN["requery_radius"]} if self.sparse else {})}
                  if self.guarded else {})  # fmt: skip
        if len(self.block_sizes) < 2:  # one branch: nothing to sync, so nothing to retire
            guards.pop("prune_after_syncs", None)
        return hb.BlockBatchConfig(
            max_new_tokens=self.max_new_tokens, block_sizes=self.block_sizes, threshold=self.threshold,
            merge_threshold=self.merge_threshold, temperature=self.temperature, sync_threshold=self.sync_threshold,
            refresh_interval=self.refresh_interval, output_trace=True, window_queries="sparse" if self.sparse else "all",
            seed=self.seed, **guards,
        )  # fmt: skip


def _number(name: str, value: Any, lo: float, hi: float, integer: bool = False) -> float | int:
    """Parse one setting (the API can send anything) and check its range, with a message that
    names the setting and the allowed range."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number, got {value!r}.") from None
    if not math.isfinite(number) or not lo <= number <= hi:
        raise InputError(f"{name} must be between {lo:g} and {hi:g}, got {value!r}.")
    if integer:
        if number != int(number):
            raise InputError(f"{name} must be a whole number, got {value!r}.")
        return int(number)
    return number


def _block_list(value: Any) -> list[int]:
    if value is None:
        value = []
    if isinstance(value, (str, int)):
        value = [value]
    try:
        sizes = sorted({int(v) for v in value})
    except (TypeError, ValueError):
        raise InputError(
            f"BlockBatch block sizes must be chosen among {list(BLOCK_CHOICES)}, got {value!r}."
        ) from None
    if not sizes:
        raise InputError("Pick at least one BlockBatch block size (the paper uses 4, 8, 16, 32, 64).")
    bad = [s for s in sizes if s not in BLOCK_CHOICES]
    if bad:
        raise InputError(f"BlockBatch block sizes must be among {list(BLOCK_CHOICES)}, got {bad}.")
    return sizes


def check_settings(
    prompt: Any,
    max_new_tokens: Any = 64,
    fast_block: Any = 32,
    block_sizes: Any = (4, 8, 16, 32, 64),
    threshold: Any = 0.9,
    merge_threshold: Any = 0.5,
    temperature: Any = 0.0,
    seed: Any = 0,
    sync_threshold: Any = 8,
    refresh_interval: Any = 32,
    chat: Any = True,
    speed: Any = "normal",
    fast_early_stop: Any = False,
    limits: Limits | None = None,
    sparse: Any = False,
    guarded: Any = False,
    fast_drafts: Any = False,
    fast_contained: Any = False,
) -> Settings:
    """Validate raw UI/API values into :class:`Settings`, or raise :class:`InputError` saying what
    to change. An empty prompt is an :class:`InputError` too; the UI turns it into a warning."""
    limits = limits or Limits()
    text = "" if prompt is None else str(prompt)
    if not text.strip():
        raise InputError("Type a prompt (or pick an example below) first.")
    if len(text) > limits.max_prompt_chars:
        raise InputError(
            f"The prompt has {len(text)} characters; this demo accepts at most {limits.max_prompt_chars}."
        )
    if speed not in SPEEDS:
        raise InputError(f"Replay speed must be one of {list(SPEEDS)}, got {speed!r}.")
    fast = int(_number("Fast-dLLM block length", fast_block, 1, max(BLOCK_CHOICES), integer=True))
    if fast not in BLOCK_CHOICES:
        raise InputError(f"Fast-dLLM block length must be one of {list(BLOCK_CHOICES)}, got {fast}.")
    temperature = float(_number("Temperature", temperature, 0.0, limits.max_temperature))
    if fast_contained and not fast_drafts:
        raise InputError("Contained drafts are a kind of Fast-dLLM draft: tick the drafts too, or untick contained.")
    return Settings(
        prompt=text,
        max_new_tokens=int(_number("Max new tokens", max_new_tokens, MIN_NEW_TOKENS, limits.max_new_tokens, integer=True)),
        fast_block=fast,
        block_sizes=_block_list(block_sizes),
        threshold=float(_number("Confidence threshold τ", threshold, 0.05, 1.0)),
        merge_threshold=float(_number("Merge threshold", merge_threshold, 0.05, 1.0)),
        temperature=temperature,
        seed=int(_number("Seed", seed, 0, 2**31 - 1, integer=True)),
        sync_threshold=int(_number("Sync threshold", sync_threshold, 0, 256, integer=True)),
        refresh_interval=int(_number("Refresh interval", refresh_interval, 1, 1024, integer=True)),
        chat=bool(chat),
        speed=str(speed),
        fast_early_stop=bool(fast_early_stop),
        sparse=bool(sparse),
        guarded=bool(guarded),
        fast_drafts=bool(fast_drafts),
        fast_contained=bool(fast_contained),
    )


# ---------------------------------------------------------------------------------------- replay


@dataclass
class BranchView:
    """One branch after one forward: what it has decoded, where its window is, what changed."""

    block_size: int
    decoded: frozenset[int] = frozenset()
    window: tuple[int, int] | None = None
    new: frozenset[int] = frozenset()
    merged_now: frozenset[int] = frozenset()
    copied_now: frozenset[int] = frozenset()
    merged_ever: frozenset[int] = frozenset()
    badges: tuple[str, ...] = ()


@dataclass
class Frame:
    """The state of every branch after forward ``step`` (0: nothing decoded yet)."""

    step: int
    branches: list[BranchView]


@dataclass
class LogLine:
    step: int
    kind: str  # init | refresh | merge | sync | stop | draft
    text: str


def _first_window(decoded: frozenset[int], block: int, length: int) -> tuple[int, int] | None:
    """The window a branch re-derives after a sync: its own block holding its first mask."""
    first = next((p for p in range(length) if p not in decoded), None)
    if first is None:
        return None
    start = first // block * block
    return start, min(start + block, length)


def _eos_stop_line(stats: dict) -> str:
    """Who stopped the request at EOS, and, when several branches hit it, why the winner won."""
    winner = stats["winner_block_size"]
    hitters = [b for b in stats.get("branches", []) if b.get("eos_hit")]
    if len(hitters) < 2:
        return f"b={winner} finished a block holding EOS: the request stops, that branch wins"
    if any(b.get("eos_probability") is None for b in hitters):  # the guards' widest-wins rule reads no probability
        sizes = ", ".join(f"b={b['block_size']}" for b in hitters)
        return f"{len(hitters)} branches finished a block holding EOS ({sizes}): the request stops, the widest, b={winner}, wins"
    ranked = sorted(hitters, key=lambda b: -b["eos_probability"])
    probs = ", ".join(f"b={b['block_size']} {b['eos_probability']:.2f}" for b in ranked)
    return f"{len(hitters)} branches finished a block holding EOS (p(EOS): {probs}): the request stops, b={winner} wins"


def build_frames(
    trace: Sequence[TraceEvent], block_sizes: Sequence[int], length: int, drafts: bool = False,
    contained: bool = False,
) -> tuple[list[Frame], list[LogLine]]:
    """Turn a ``stats["trace"]`` into one :class:`Frame` per forward and a log of merges, syncs and
    refreshes. Frame ``k`` is the state after every event of step ``k``; its ``new``/``merged_now``/
    ``copied_now`` sets are what step ``k`` changed, which the page highlights.

    ``drafts``: Fast-dLLM with lookahead drafts (``block_sizes`` names its main row only): a sync of
    the main row is an adopted draft, whose tokens follow as an "adopt" commit; ``contained``: drafts
    are also adopted when the step committed their tokens and more (the log says so)."""
    n = len(block_sizes)
    decoded: list[set[int]] = [set() for _ in range(n)]
    windows: list[tuple[int, int] | None] = [(0, min(b, length)) for b in block_sizes]
    merged_ever: list[set[int]] = [set() for _ in range(n)]
    frames = [Frame(0, [BranchView(b, window=windows[i]) for i, b in enumerate(block_sizes)])]
    log: list[LogLine] = []
    by_step: dict[int, list[TraceEvent]] = {}
    for event in trace:
        by_step.setdefault(event.step, []).append(event)
    last = max(by_step, default=0)
    for step in range(1, last + 1):
        new = [set() for _ in range(n)]
        merged = [set() for _ in range(n)]
        copied = [set() for _ in range(n)]
        badges: list[list[str]] = [[] for _ in range(n)]
        refreshed: list[int] = []
        merges: list[str] = []
        syncs: dict[int, list[str]] = {}
        for event in by_step.get(step, []):
            b = event.branch
            if b >= n:
                continue
            if isinstance(event, CommitEvent):
                positions = set(event.committed)
                new[b] |= positions - decoded[b]
                decoded[b] |= positions
                windows[b] = tuple(event.window)  # type: ignore[assignment]
                if event.phase in ("init", "refresh"):
                    badges[b].append(event.phase)
                    refreshed.append(b)
                elif event.phase == "adopt":
                    badges[b].append(f"draft +{len(positions)}")
            elif isinstance(event, MergeEvent):
                positions = set(event.positions)
                merged[b] |= positions
                merged_ever[b] |= positions
                decoded[b] |= positions
                badges[b].append(f"merge +{len(positions)}")
                merges.append(
                    f"b={block_sizes[b]} +{len(positions)} token{'s' if len(positions) != 1 else ''}"
                )
            elif isinstance(event, SyncEvent) and drafts:
                guessed = ("held tokens this step committed: its forward stands for the next step (this step's "
                           "own commits kept)") if contained else "had guessed this step's commit: its forward was the next step"
                log.append(LogLine(step, "draft", f"draft {event.leader} {guessed}, one forward saved"))
            elif isinstance(event, SyncEvent):
                leader = event.leader
                gained = decoded[leader] - decoded[b]
                copied[b] |= gained
                decoded[b] = set(decoded[leader])
                merged_ever[b] = set(merged_ever[leader])
                windows[b] = _first_window(frozenset(decoded[b]), block_sizes[b], length)
                badges[b].append(f"sync ← b={block_sizes[leader]}")
                syncs.setdefault(block_sizes[leader], []).append(f"b={block_sizes[b]}")
        if refreshed:
            kind = "init" if step == 1 else "refresh"
            names = ", ".join(f"b={block_sizes[b]}" for b in sorted(set(refreshed)))
            what = "initial full forward" if kind == "init" else "full-sequence refresh"
            log.append(LogLine(step, kind, f"{what} for {names}" if n > 1 else what))
        if merges:
            log.append(LogLine(step, "merge", f"{', '.join(merges)} from compatible branches"))
        for leader_size, followers in syncs.items():
            log.append(LogLine(step, "sync", f"{', '.join(followers)} fell behind: copied leader b={leader_size}'s "
                               "canvas and KV cache"))  # fmt: skip
        views = [
            BranchView(
                block_sizes[i], frozenset(decoded[i]), windows[i], frozenset(new[i]), frozenset(merged[i]),
                frozenset(copied[i]), frozenset(merged_ever[i]), tuple(badges[i]),
            )
            for i in range(n)
        ]  # fmt: skip
        frames.append(Frame(step, views))
    return frames, log


# --------------------------------------------------------------------------------------- running


@dataclass
class SideResult:
    """One strategy's run: the measured numbers, the answer and its replay."""

    key: str
    title: str
    subtitle: str
    nfe: int
    seconds: float
    text: str
    tokens: list[tuple[str, str]]  # (label, kind) for every generated position of the output
    answer_tokens: int
    stats: dict[str, Any]
    block_sizes: list[int]
    winner: int
    frames: list[Frame]
    log: list[LogLine]
    verdict: dict[str, Any] | None = None  # right or wrong, when the prompt is a suite's test question

    @property
    def tokens_per_second(self) -> float:
        return self.answer_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        out = {
            "nfe": self.nfe, "seconds": round(self.seconds, 4), "answer_tokens": self.answer_tokens,
            "tokens_per_second": round(self.tokens_per_second, 2), "winner_block_size": self.stats.get("winner_block_size"),
            "stopped_by": self.stats.get("stopped_by"), "text": self.text,
        }  # fmt: skip
        if self.key == "blockbatch":
            out.update(merged=self.stats.get("merged"), syncs=self.stats.get("syncs"),
                       refreshes=self.stats.get("nfe_refresh"))  # fmt: skip
        if "lookahead_adopted" in self.stats:  # forwards the drafts saved
            out.update(drafts_adopted=self.stats["lookahead_adopted"])
        if self.verdict is not None:
            out.update(correct=self.verdict["correct"], reference=self.verdict["reference"])
        return out


def _token_labels(tokenizer: Any, ids: list[int], mask_id: int | None, end_ids: list[int]) -> list[tuple[str, str]]:
    """A short printable label and a kind (tok, eos, eot, mask) per generated id."""
    ends = set(end_ids)
    labels: list[tuple[str, str]] = []
    for t in ids:
        if t in ends:
            labels.append(("EOS" if t == tokenizer.eos_token_id else "EOT", "eos"))
            continue
        if mask_id is not None and t == mask_id:
            labels.append(("", "mask"))
            continue
        text = tokenizer.decode([t]).replace("\n", "↵").replace("\t", "⇥")
        text = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in text)
        if not text.strip():
            text = "␣" * max(1, len(text))
        labels.append((text[:18], "tok"))
    return labels


def _printable(text: str) -> str:
    """Control characters (an untrained model emits them) as U+FFFD, so the answer box stays readable."""
    return "".join(ch if ch.isprintable() or ch in "\n\t" else "\ufffd" for ch in text)


def run_side(loaded: LoadedModel, ids: torch.Tensor, config: Any, key: str, settings: Settings) -> SideResult:
    """Decode once with ``config`` and package the result with its replay frames."""
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = ids.to(model.device)
    start = time.perf_counter()
    # the configs carry the seed: keyed noise, so a sample does not change with the drafts switch (sparse queries)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                         return_dict_in_generate=True)  # fmt: skip
    seconds = time.perf_counter() - start
    stats = dict(out.stats[0])
    gen = out.sequences[0, ids.shape[1] :].tolist()
    mask_id = (
        config.mask_token_id
        if config.mask_token_id is not None
        else getattr(model.config, "mask_token_id", None)
    )
    # the answer ends at the first end token; tokens/s counts only it: the strategies decode
    # different amounts of padding after the answer, so counting that would flatter the slower one
    end_ids = hb.end_token_ids(tokenizer, model.config)
    labels = _token_labels(tokenizer, gen, mask_id, end_ids)
    new = out.sequences[:1, ids.shape[1] :]
    answer = int(answer_lengths(new, end_ids)[0])
    text = _printable(hb.answer_texts(tokenizer, new, end_ids)[0].strip())
    drafts = key != "blockbatch" and settings.fast_drafts
    # BlockBatch's branches; Fast-dLLM's one row (its lookahead draft rows are not shown)
    block_sizes = [int(b["block_size"]) for b in stats["branches"]] if key == "blockbatch" else [settings.fast_block]
    frames, log = build_frames(stats.get("trace", []), block_sizes, len(gen), drafts=drafts,
                               contained=drafts and settings.fast_contained)  # fmt: skip
    if key == "blockbatch":
        title = "BlockBatch"
        subtitle = f"blocks {'·'.join(map(str, block_sizes))} · τ {settings.threshold:g} · merge {settings.merge_threshold:g}"
        if stats.get("stopped_by") == "eos":
            log.append(LogLine(len(frames) - 1, "stop", _eos_stop_line(stats)))
    else:
        title = "Fast-dLLM"
        subtitle = f"dual cache · block {settings.fast_block} · τ {settings.threshold:g}" + (
            " · early stop" if settings.fast_early_stop else " · no early stop"
        )
        if drafts:
            subtitle += f" · {DRAFTED['lookahead']} drafts" + (" (contained)" if settings.fast_contained else "")
    if key == "blockbatch" and settings.guarded:
        subtitle += " · guarded merges"
    if settings.sparse:
        subtitle += " · sparse queries"
    return SideResult(
        key=key, title=title, subtitle=subtitle, nfe=int(out.nfe[0]), seconds=seconds, text=text, tokens=labels,
        answer_tokens=answer, stats=stats, block_sizes=block_sizes, winner=int(stats.get("winner_branch", 0)),
        frames=frames, log=log,
    )  # fmt: skip


def compare_once(
    loaded: LoadedModel, settings: Settings, limits: Limits | None = None
) -> tuple[SideResult, SideResult]:
    """Run Fast-dLLM and BlockBatch on the same prompt (the part of a request that needs the model)."""
    limits = limits or Limits()
    ids = encode_prompt(loaded.tokenizer, settings.prompt, chat=settings.chat)
    if ids.shape[1] > limits.max_prompt_tokens:
        raise InputError(
            f"The prompt is {ids.shape[1]} tokens long; this demo accepts at most {limits.max_prompt_tokens}."
        )
    context = getattr(loaded.model.config, "context_length", None) or getattr(
        loaded.model.config, "max_position_embeddings", None
    )
    if context and ids.shape[1] + settings.max_new_tokens > context:
        raise InputError(f"Prompt ({ids.shape[1]} tokens) + max new tokens ({settings.max_new_tokens}) exceeds this "
                         f"model's context of {context}: shorten the prompt or ask for fewer tokens.")  # fmt: skip
    fast = run_side(loaded, ids, settings.fast_config(), "fast_dllm", settings)
    block = run_side(loaded, ids, settings.blockbatch_config(), "blockbatch", settings)
    for side in (fast, block):
        side.verdict = suite_verdict(settings.prompt, side.text)
    return fast, block


# ------------------------------------------------------------------------------------- rendering

CSS = """
:root { --bb-mask:#e7e5e4; --bb-mask-ink:#a8a29e; --bb-done:#e0e7ff; --bb-done-ink:#312e81; --bb-new:#fbbf24;
        --bb-new-ink:#451a03; --bb-merge:#f0abfc; --bb-merge-ink:#4a044e; --bb-copy:#99f6e4; --bb-copy-ink:#134e4a;
        --bb-eos:#f5f5f4; --bb-fd:#6366f1; --bb-bb:#db2777; }
.bb-hero h1 { font-size: 1.9rem; margin: 0 0 .2rem 0; letter-spacing: -.02em; }
.bb-hero h1 .fd { color: var(--bb-fd); } .bb-hero h1 .bb { color: var(--bb-bb); }
.bb-hero p { margin: .1rem 0; color: #57534e; font-size: .95rem; }
.bb-notice { background:#fff7ed; border:1px solid #fdba74; color:#7c2d12; border-radius:10px; padding:.55rem .8rem;
             margin:.4rem 0; font-size:.9rem; }
.bb-legend { display:flex; flex-wrap:wrap; gap:.35rem 1.1rem; font-size:.8rem; color:#57534e; align-items:center; margin:.3rem 0; }
.bb-legend .item { white-space:nowrap; display:inline-flex; align-items:center; gap:.35rem; }
.bb-banner { border-radius:14px; padding:.7rem 1rem; background:linear-gradient(90deg,#eef2ff,#fdf2f8);
             border:1px solid #e7e5e4; font-size:1rem; color:#292524; display:flex; gap:1.2rem; align-items:center;
             flex-wrap:wrap; min-height:3.1rem; }
.bb-banner .big { font-size:1.5rem; font-weight:800; color:var(--bb-bb); letter-spacing:-.02em; }
.bb-banner .muted { color:#78716c; font-size:.82rem; }
.bb-banner .notes { display:flex; flex-direction:column; gap:.1rem; flex-basis:100%; }
.bb-side { border-radius:16px; border:1px solid #e7e5e4; background:#fff; padding:.8rem .9rem 1rem .9rem;
           box-shadow:0 1px 3px rgb(0 0 0 / .05); min-height:14rem; }
.bb-side.fd { border-top:5px solid var(--bb-fd); } .bb-side.bb { border-top:5px solid var(--bb-bb); }
.bb-head { display:flex; flex-direction:column; gap:.45rem; }
.bb-title { font-weight:800; font-size:1.15rem; color:#1c1917; }
.bb-sub { display:block; font-weight:500; font-size:.78rem; color:#78716c; font-family:ui-monospace,monospace; }
.bb-stats { display:grid; grid-template-columns:repeat(auto-fit, minmax(4.8rem, 1fr)); gap:.45rem; }
.bb-stat { background:#fafaf9; border:1px solid #f5f5f4; border-radius:10px; padding:.25rem .6rem; min-width:4.2rem;
           text-align:right; }
.bb-stat .v { display:block; font-size:1.25rem; font-weight:800; font-variant-numeric:tabular-nums; color:#1c1917;
              font-family:ui-monospace,monospace; }
.bb-stat .l { display:block; font-size:.66rem; text-transform:uppercase; letter-spacing:.06em; color:#a8a29e; }
.bb-side.fd .bb-stat.nfe .v { color:var(--bb-fd); } .bb-side.bb .bb-stat.nfe .v { color:var(--bb-bb); }
.bb-bar { height:6px; background:#f5f5f4; border-radius:3px; margin:.55rem 0 .6rem 0; overflow:hidden; }
.bb-bar div { height:100%; border-radius:3px; transition:width .12s linear; }
.bb-side.fd .bb-bar div { background:var(--bb-fd); } .bb-side.bb .bb-bar div { background:var(--bb-bb); }
.bb-caption { font-size:.72rem; color:#a8a29e; text-transform:uppercase; letter-spacing:.06em; margin:.2rem 0 .3rem 0; }
.bb-canvas { display:flex; flex-wrap:wrap; gap:3px; line-height:1; font-family:ui-monospace,SFMono-Regular,Menlo,monospace; }
.bb-chip { display:inline-block; font-family:ui-monospace,SFMono-Regular,Menlo,monospace; font-size:.78rem;
           padding:3px 4px; border-radius:5px; min-width:1.1rem; text-align:center; white-space:pre;
           background:var(--bb-done); color:var(--bb-done-ink); border:1px solid transparent; }
.bb-chip.mask { background:repeating-linear-gradient(135deg,var(--bb-mask) 0 4px,#f5f5f4 4px 8px); color:transparent;
                min-width:1.3rem; }
.bb-chip.win { border-color:#a8a29e; border-style:dashed; }
.bb-side.fd .bb-chip.win { border-color:var(--bb-fd); } .bb-side.bb .bb-chip.win { border-color:var(--bb-bb); }
.bb-chip.new { background:var(--bb-new); color:var(--bb-new-ink); font-weight:700; box-shadow:0 0 0 2px #fde68a;
               animation:bbpop .35s ease-out; }
.bb-chip.merged { background:var(--bb-merge); color:var(--bb-merge-ink); font-weight:700; animation:bbpop .35s ease-out; }
.bb-chip.copied { background:var(--bb-copy); color:var(--bb-copy-ink); }
.bb-chip.wasmerged { text-decoration:underline dotted #c026d3 2px; text-underline-offset:3px; }
.bb-chip.eos { background:var(--bb-eos); color:#a8a29e; font-size:.6rem; padding:4px 3px; }
.bb-chip.fill { background:#fafaf9; color:#d6d3d1; font-size:.6rem; padding:4px 3px; }
@keyframes bbpop { 0% { transform:scale(1.35); } 100% { transform:scale(1); } }
.bb-lanes { margin-top:.8rem; display:flex; flex-direction:column; gap:5px; }
.bb-lane { display:grid; grid-template-columns:3.3rem 1fr 3.4rem 8.5rem; gap:.5rem; align-items:center; font-size:.75rem; }
.bb-lane .name { font-family:ui-monospace,monospace; font-weight:700; color:#44403c; }
.bb-lane.win .name { color:var(--bb-bb); }
.bb-lane .count { font-family:ui-monospace,monospace; color:#57534e; text-align:right; font-variant-numeric:tabular-nums; }
.bb-track { position:relative; height:14px; background:#f5f5f4; border-radius:4px; display:flex; overflow:hidden; }
.bb-track span { height:100%; }
.bb-track .d { background:#fbcfe8; } .bb-track .n { background:var(--bb-new); } .bb-track .g { background:#c026d3; }
.bb-track .c { background:#14b8a6; } .bb-track .m { background:transparent; }
.bb-lane.win .bb-track .d { background:#f472b6; }
.bb-track .wf { position:absolute; top:0; bottom:0; border:2px solid #1c1917; border-radius:4px; box-sizing:border-box; }
.bb-badges { display:flex; gap:3px; flex-wrap:wrap; }
.bb-badge { font-size:.64rem; padding:1px 5px; border-radius:999px; font-weight:700; white-space:nowrap; }
.bb-badge.merge { background:#fae8ff; color:#86198f; } .bb-badge.sync { background:#ccfbf1; color:#115e59; }
.bb-badge.refresh, .bb-badge.init { background:#e0f2fe; color:#075985; } .bb-badge.win { background:#fce7f3; color:#9d174d; }
.bb-log { margin-top:.7rem; font-size:.74rem; color:#57534e; font-family:ui-monospace,monospace; display:flex;
          flex-direction:column; gap:2px; min-height:6.2rem; }
.bb-log > div { display:grid; grid-template-columns:3.8rem 3.9rem 1fr; align-items:baseline; }
.bb-log .s { color:#a8a29e; }
.bb-log .k { font-weight:700; }
.bb-log .merge .k { color:#a21caf; } .bb-log .sync .k { color:#0f766e; } .bb-log .refresh .k, .bb-log .init .k { color:#0369a1; }
.bb-log .stop .k { color:var(--bb-bb); } .bb-log .draft .k { color:var(--bb-fd); }
.bb-badge.draft { background:#e0e7ff; color:#3730a3; }
.bb-verdict { display:inline-block; margin-top:.25rem; font-size:.78rem; font-weight:700; padding:1px 8px;
              border-radius:999px; }
.bb-verdict.right { background:#dcfce7; color:#166534; } .bb-verdict.wrong { background:#fee2e2; color:#991b1b; }
.bb-banner.error { background:#fef2f2; border-color:#fca5a5; color:#991b1b; }
@media (max-width: 640px) { .bb-prompt textarea { min-height: 9em; } }
.bb-answer textarea { font-family:ui-monospace,SFMono-Regular,Menlo,monospace !important; font-size:.85rem !important; }
footer { display:none !important; }
"""


def _chip(label: str, cls: str) -> str:
    return f'<span class="bb-chip {cls}">{html.escape(label)}</span>'


def render_canvas(side: SideResult, frame: Frame, final: bool) -> str:
    """The output row as chips: masked, in the window, new this forward, merged, copied, EOS."""
    view = frame.branches[min(side.winner, len(frame.branches) - 1)]
    window = view.window or (0, 0)
    chips: list[str] = []
    eos_run = 0  # consecutive settled end tokens, drawn as one "EOS ×n" chip: they are most of a long canvas

    def flush() -> None:
        nonlocal eos_run
        if eos_run:
            chips.append(_chip("EOS" if eos_run == 1 else f"EOS ×{eos_run}", "eos"))
            eos_run = 0

    for p, (label, kind) in enumerate(side.tokens):
        if p in view.decoded or (final and kind != "mask"):
            if p not in view.decoded:
                flush()
                chips.append(_chip("·", "fill"))  # after the EOS that stopped the request
                continue
            settled = p not in view.new and p not in view.merged_now and p not in view.copied_now
            if kind == "eos" and label == "EOS" and settled:
                eos_run += 1
                continue
            flush()
            cls = "eos" if kind == "eos" else ""
            if p in view.new:
                cls += " new"
            elif p in view.merged_now:
                cls += " merged"
            elif p in view.copied_now:
                cls += " copied"
            if p in view.merged_ever and p not in view.merged_now:
                cls += " wasmerged"
            chips.append(_chip(label, cls.strip()))
        else:
            flush()
            chips.append(_chip("▒", "mask win" if window[0] <= p < window[1] and not final else "mask"))
    flush()
    return '<div class="bb-canvas">' + "".join(chips) + "</div>"


def render_lanes(side: SideResult, frame: Frame, final: bool) -> str:
    """One lane per BlockBatch branch: decoded positions, the window frame, this forward's events."""
    length = max(1, len(side.tokens))
    lead = max(range(len(frame.branches)), key=lambda i: len(frame.branches[i].decoded))
    rows = []
    for i, view in enumerate(frame.branches):
        kinds = []
        for p in range(length):
            if p in view.new:
                kinds.append("n")
            elif p in view.merged_now:
                kinds.append("g")
            elif p in view.copied_now:
                kinds.append("c")
            elif p in view.decoded:
                kinds.append("d")
            else:
                kinds.append("m")
        runs, start = [], 0
        for p in range(1, length + 1):
            if p == length or kinds[p] != kinds[start]:
                runs.append(f'<span class="{kinds[start]}" style="flex-grow:{p - start}"></span>')
                start = p
        if view.window and not final:
            s, e = view.window
            runs.append(
                f'<div class="wf" style="left:{100 * s / length:.3f}%;width:{100 * (e - s) / length:.3f}%"></div>'
            )
        badges = []
        for badge in view.badges:
            kind = badge.split()[0]
            badges.append(f'<span class="bb-badge {kind}">{html.escape(badge)}</span>')
        if final and i == side.winner:
            badges.append('<span class="bb-badge win">★ winner</span>')
        elif not final and i == lead and len(frame.branches) > 1:
            badges.append('<span class="bb-badge win">leader</span>')
        cls = "bb-lane win" if final and i == side.winner else "bb-lane"
        rows.append(
            f'<div class="{cls}"><span class="name">b={view.block_size}</span><div class="bb-track">{"".join(runs)}</div>'
            f'<span class="count">{len(view.decoded)}/{length}</span><div class="bb-badges">{"".join(badges)}</div></div>'
        )
    return (
        '<div class="bb-caption">branches (one lane per block size; frame = current window)</div><div class="bb-lanes">'
        + "".join(rows)
        + "</div>"
    )


def render_log(side: SideResult, step: int) -> str:
    lines = [line for line in side.log if line.step <= step][-6:]
    body = "".join(
        f'<div class="{line.kind}"><span class="s">step {line.step}</span><span class="k">{line.kind}</span>'
        f"<span>{html.escape(line.text)}</span></div>"
        for line in reversed(lines)
    )
    return f'<div class="bb-caption" style="margin-top:.7rem">events</div><div class="bb-log">{body}</div>'


def render_side(side: SideResult, step: int) -> str:
    """One column: counters, progress, the canvas, and for BlockBatch its lanes and event log."""
    final = step >= side.nfe
    frame = side.frames[min(step, len(side.frames) - 1)]
    cls = "bb" if side.key == "blockbatch" else "fd"
    done = min(step, side.nfe)
    seconds = side.seconds * done / max(side.nfe, 1)
    latency = f"{side.seconds:.2f}s" if final else f"{seconds:.2f}s"
    tps = f"{side.tokens_per_second:.0f}" if final else "…"
    winner = f"b={side.stats.get('winner_block_size')}" if final else "…"
    stats = [("nfe", f"{done}", "NFE"), ("lat", latency, "latency"), ("tps", tps, "tokens/s")]
    if side.key == "blockbatch":
        stats.append(("win", winner, "winner"))
    if "lookahead_adopted" in side.stats:  # Fast-dLLM's drafts: the forwards they saved
        stats.append(("draft", f"{side.stats['lookahead_adopted']}" if final else "…", "saved"))
    stat_html = "".join(f'<div class="bb-stat {k}"><span class="v">{v}</span><span class="l">{label}</span></div>'
                        for k, v, label in stats)  # fmt: skip
    caption = (
        "output canvas"
        if side.key != "blockbatch"
        else f"output canvas (branch b={side.block_sizes[side.winner]}, the winner)"
    )
    verdict = ""
    if final and side.verdict is not None:
        v = side.verdict
        verdict = (f'<span class="bb-verdict {"right" if v["correct"] else "wrong"}">'
                   f'{"✓ right" if v["correct"] else "✗ wrong"} · {html.escape(v["suite"])} reference: '
                   f'{html.escape(str(v["reference"]))}</span>')  # fmt: skip
    body = [
        f'<div class="bb-side {cls}"><div class="bb-head"><div class="bb-title">{side.title}'
        f'<span class="bb-sub">{html.escape(side.subtitle)}</span>{verdict}</div>'
        f'<div class="bb-stats">{stat_html}</div></div>',
        f'<div class="bb-bar"><div style="width:{100 * done / max(side.nfe, 1):.1f}%"></div></div>',
        f'<div class="bb-caption">{caption}</div>',
        render_canvas(side, frame, final),
    ]
    if side.key == "blockbatch":
        body.append(render_lanes(side, frame, final))
        body.append(render_log(side, done))
    elif "lookahead_adopted" in side.stats:  # Fast-dLLM's drafts: when one was adopted
        body.append(render_log(side, done))
    body.append("</div>")
    return "".join(body)


def render_placeholder(title: str, key: str, message: str, length: int = 64) -> str:
    cls = "bb" if key == "blockbatch" else "fd"
    chips = "".join(_chip("▒", "mask") for _ in range(length))
    return (f'<div class="bb-side {cls}"><div class="bb-head"><div class="bb-title">{title}<span class="bb-sub">'
            f'{html.escape(message)}</span></div></div><div class="bb-bar"><div style="width:0%"></div></div>'
            f'<div class="bb-canvas">{chips}</div></div>')  # fmt: skip


def render_banner(
    fast: SideResult | None, block: SideResult | None, step: int | None, message: str = ""
) -> str:
    """The headline: the NFE saving and the speed-up once both replays are done."""
    if fast is None or block is None:
        return f'<div class="bb-banner"><span class="muted">{html.escape(message)}</span></div>'
    if step is not None and step < max(fast.nfe, block.nfe):
        return (f'<div class="bb-banner"><span class="muted">replaying forward pass <b>{step}</b> of '
                f"{max(fast.nfe, block.nfe)} — one frame is one forward on both sides</span></div>")  # fmt: skip
    saving = 100.0 * (1 - block.nfe / fast.nfe) if fast.nfe else 0.0
    speedup = fast.seconds / block.seconds if block.seconds > 0 else float("nan")
    verb = "fewer" if saving >= 0 else "more"
    slow_note = ""
    if saving > 0 and speedup < 1:
        slow_note = ('<span class="muted">fewer forwards but more time: here a packed step of all branches costs more '
                     "than one window; on a GPU with a large model it should cost about as much</span>")  # fmt: skip
    queries = ""
    if "query_tokens" in block.stats and "query_tokens" in fast.stats:  # the compute, next to the forwards
        queries = (f"<span>query tokens <b>{block.stats['query_tokens']}</b> vs "
                   f"<b>{fast.stats['query_tokens']}</b></span>")  # fmt: skip
    if "branches" in block.stats and "branches" in fast.stats:  # and the memory: a K/V cache row per branch
        queries += (f"<span>K/V rows per request <b>{len(block.stats['branches'])}</b> vs "
                    f"<b>{len(fast.stats['branches'])}</b></span>")  # fmt: skip
    return (
        f'<div class="bb-banner"><span class="big">{abs(saving):.1f}% {verb} forward passes</span>'
        f"<span>BlockBatch <b>{block.nfe}</b> NFE vs Fast-dLLM <b>{fast.nfe}</b></span>{queries}"
        f"<span>wall-clock <b>{speedup:.2f}×</b> ({block.seconds:.2f}s vs {fast.seconds:.2f}s)</span>"
        f'<div class="notes">{slow_note}'
        f'<span class="muted">paper, LLaDA/Dream 7-8B at 256 tokens: −26.6% NFE, 1.33× on average</span></div></div>'
    )


LEGEND = '<div class="bb-legend">' + "".join(
    f'<span class="item">{_chip(label, cls)}{text}</span>'
    for label, cls, text in (
        ("▒", "mask", "masked"), ("▒", "mask win", "current window"), ("new", "new", "committed by this forward"),
        ("tok", "", "committed earlier"), ("mrg", "merged", "merged from a branch"),
        ("cpy", "copied", "copied by a sync"), ("EOS", "eos", "end of text"),
    )
) + "</div>"  # fmt: skip


# ----------------------------------------------------------------------------------------- the UI


def render_error_banner(message: str) -> str:
    """The banner after a refused request: the error, never the previous run's numbers."""
    return f'<div class="bb-banner error"><span>⚠ {html.escape(message)}</span></div>'


def _frame_steps(total: int) -> list[int]:
    stride = max(1, math.ceil(total / MAX_FRAMES))
    steps = list(range(0, total + 1, stride))
    if steps[-1] != total:
        steps.append(total)
    return steps


def _answer_box(label: str) -> gr.Textbox:
    """The read-only text box under a strategy's canvas (the two columns share its look)."""
    return gr.Textbox(label=label, lines=2, max_lines=6, interactive=False, elem_classes="bb-answer")


def build_demo(
    loaded: LoadedModel, limits: Limits | None = None, concurrency: int = 1, examples: list[str] | None = None
) -> gr.Blocks:
    """The Blocks app around one loaded model. ``concurrency`` decodes run at once (a semaphore:
    replays stream without holding the model, so watching never blocks the next visitor's run)."""
    limits = limits or Limits()
    check_positive_int("concurrency", concurrency)  # 0 or less read as 1 before, in silence
    gate = threading.Semaphore(concurrency)
    examples = example_prompts() if examples is None else examples
    device = str(loaded.device)

    def refuse(err: Exception) -> Iterator[tuple]:
        """A refused request: one log line (no traceback: it is the visitor's input, not a fault),
        the error in the banner, and a gr.Error so an API client gets it as an error too."""
        logger.info("input refused: %s", err)
        yield (render_error_banner(str(err)), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip())
        raise gr.Error(str(err), print_exception=False)

    def compare(prompt, max_new_tokens, fast_block, block_sizes, threshold, merge_threshold, temperature, seed,
                sync_threshold, refresh_interval, chat, speed, fast_early_stop=False, sparse=False,
                guarded=False, fast_drafts=False, fast_contained=False) -> Iterator[tuple]:  # fmt: skip
        """Validate, decode with both strategies, then replay both traces frame by frame."""
        try:
            settings = check_settings(prompt, max_new_tokens, fast_block, block_sizes, threshold, merge_threshold,
                                      temperature, seed, sync_threshold, refresh_interval, chat, speed,
                                      fast_early_stop, limits, sparse, guarded, fast_drafts, fast_contained)  # fmt: skip
        except InputError as err:
            if prompt is None or not str(prompt).strip():
                logger.info("input refused: %s", err)
                gr.Warning(str(err))
                yield (render_error_banner(str(err)), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip())
                return
            yield from refuse(err)
            return
        g = settings.max_new_tokens
        yield (render_banner(None, None, None, f"decoding on {device}…"),
               render_placeholder("Fast-dLLM", "fast_dllm", "decoding…", g),
               render_placeholder("BlockBatch", "blockbatch", "waiting…", g), "", "", None)  # fmt: skip
        try:
            with gate:  # never held across a yield: a visitor who stops reading there would hold every other decode
                fast, block = compare_once(loaded, settings, limits)
        except (InputError, ValueError) as err:
            yield from refuse(err)
            return
        except Exception as err:  # a fault, not the visitor's input: said on the page, its traceback in the log
            logger.exception("decode failed")
            message = f"The decode failed ({type(err).__name__}: {err})."
            yield (render_error_banner(message), render_placeholder("Fast-dLLM", "fast_dllm", "failed", g),
                   render_placeholder("BlockBatch", "blockbatch", "failed", g), "", "", None)  # fmt: skip
            raise gr.Error(message, print_exception=False) from err
        stats = {"model": loaded.label, "device": device, "fast_dllm": fast.summary(), "blockbatch": block.summary(),
                 "nfe_saving_percent": round(100.0 * (1 - block.nfe / fast.nfe), 2) if fast.nfe else None}  # fmt: skip
        total = max(fast.nfe, block.nfe)
        steps = _frame_steps(total) if settings.speed != "instant" else [total]
        delay = min(0.3, SPEEDS[settings.speed] / max(len(steps), 1))
        for i, step in enumerate(steps):
            last = i == len(steps) - 1
            yield (render_banner(fast, block, None if last else step), render_side(fast, step), render_side(block, step),
                   fast.text if step >= fast.nfe else "", block.text if step >= block.nfe else "",
                   stats if last else None)  # fmt: skip
            if not last and delay:
                time.sleep(delay)

    with gr.Blocks(title="BlockBatch vs Fast-dLLM", analytics_enabled=False) as demo:
        gr.HTML(
            '<div class="bb-hero"><h1><span class="bb">BlockBatch</span> vs <span class="fd">Fast-dLLM</span></h1>'
            "<p>A masked-diffusion LLM writes its whole answer at once, unmasking tokens in parallel. "
            "Fast-dLLM decodes one block size; BlockBatch runs one branch per block size in a single packed "
            "forward and lets them merge and sync, so it needs fewer forward passes (NFE).</p>"
            f"<p>Model: <b>{html.escape(loaded.label)}</b> on <b>{html.escape(device)}</b>.</p></div>"
            + (f'<div class="bb-notice">{loaded.notice}</div>' if loaded.notice else "")
        )
        with gr.Row(equal_height=False):
            with gr.Column(scale=5):
                # lines=3: at phone width the example prompts wrap to 3-5 lines, and the CSS gives the box
                # room for them there (an unedited value does not grow the box)
                prompt = gr.Textbox(label="Prompt", lines=3, max_lines=12, placeholder="Ask something…",
                                    value=examples[0] if examples else "", max_length=limits.max_prompt_chars,
                                    elem_classes="bb-prompt")  # fmt: skip
            with gr.Column(scale=3, min_width=380):
                run = gr.Button("Decode both ▶", variant="primary", size="lg")
                speed = gr.Radio(list(SPEEDS), value="normal", label="Replay speed")
        with gr.Accordion("Settings", open=False):
            with gr.Row():
                max_new_tokens = gr.Slider(MIN_NEW_TOKENS, limits.max_new_tokens, value=min(64, limits.max_new_tokens), step=MIN_NEW_TOKENS,
                                           label="Max new tokens")  # fmt: skip
                threshold = gr.Slider(0.05, 1.0, value=0.9, step=0.01, label="Confidence threshold τ (both)")
                temperature = gr.Slider(
                    0.0, limits.max_temperature, value=0.0, step=0.05, label="Temperature (0 = greedy)"
                )
                seed = gr.Number(value=0, precision=0, minimum=0, label="Seed")
            with gr.Row():
                fast_block = gr.Dropdown(
                    [str(b) for b in BLOCK_CHOICES], value="32", label="Fast-dLLM block length"
                )
                fast_early_stop = gr.Checkbox(value=False, label="Fast-dLLM stops at EOS (early stop, as BlockBatch)")
                fast_drafts = gr.Checkbox(value=False, label="Fast-dLLM drafts its next step (3 exact lookahead rows: "
                                                             "its own tokens in fewer forwards; sampled, its own "
                                                             "distribution)")  # fmt: skip
                fast_contained = gr.Checkbox(value=False, label="… contained drafts: also adopted when the step "
                                                                "committed more (fewer forwards, not the same tokens)")  # fmt: skip
                block_sizes = gr.CheckboxGroup([str(b) for b in BLOCK_CHOICES], value=["4", "8", "16", "32", "64"],
                                               label="BlockBatch block sizes (one branch each)")  # fmt: skip
            with gr.Row():
                merge_threshold = gr.Slider(0.05, 1.0, value=0.5, step=0.01, label="Merge threshold")
                sync_threshold = gr.Slider(
                    0, 64, value=8, step=1, label="Sync threshold (tokens behind the leader)"
                )
                refresh_interval = gr.Slider(4, 128, value=32, step=4, label="Refresh interval (tokens)")
                chat = gr.Checkbox(value=True, label="Apply the chat template")
                sparse = gr.Checkbox(value=False, label="Sparse window queries (both): only masks and stale positions")
                guarded = gr.Checkbox(value=False, label="BlockBatch beyond the paper: guarded merges, widest EOS "
                                                         "winner, synced branches retire")  # fmt: skip
        banner = gr.HTML(render_banner(None, None, None, "Press “Decode both” to run the two strategies."))
        gr.HTML(LEGEND)
        # the answers in a row of their own, so they line up whatever height each replay column has
        with gr.Row(equal_height=False):
            with gr.Column():
                fast_view = gr.HTML(render_placeholder("Fast-dLLM", "fast_dllm", "dual cache, block 32"))
            with gr.Column():
                block_view = gr.HTML(render_placeholder("BlockBatch", "blockbatch", "blocks 4…64"))
        with gr.Row(equal_height=True):
            fast_text = _answer_box("Fast-dLLM answer")
            block_text = _answer_box("BlockBatch answer")
        with gr.Accordion("Raw numbers", open=False):
            raw = gr.JSON(label="stats")
        if examples:
            gr.Examples(
                examples=[[e] for e in examples], inputs=[prompt], label="Examples from the tiny suites"
            )
        inputs = [prompt, max_new_tokens, fast_block, block_sizes, threshold, merge_threshold, temperature, seed,
                  sync_threshold, refresh_interval, chat, speed, fast_early_stop, sparse, guarded,
                  fast_drafts, fast_contained]  # fmt: skip
        outputs = [banner, fast_view, block_view, fast_text, block_text, raw]
        # the banner and the replay are the progress display: Gradio's own overlay would hide them
        run.click(compare, inputs, outputs, api_name="compare", show_progress="hidden")
        prompt.submit(compare, inputs, outputs, api_name=False, show_progress="hidden")
        gr.Markdown(
            "Counting: **NFE** is the number of forward calls per request (one packed forward counts once). "
            "Latency is measured around `model.generate` alone; tokens/s counts answer tokens up to the first "
            "end token. The replay is rebuilt from `output_trace=True`; tokens are shown as they stand in the "
            "final output. Generated text is only displayed, never executed."
        )
    return demo


def launch_demo(demo: gr.Blocks, concurrency: int = 8, **kwargs: Any):
    """Queue and launch with the page's CSS and theme (Gradio 6 takes them at launch). The queue's
    limit bounds concurrent *replays*; decodes are bounded separately in :func:`build_demo`."""
    demo.queue(default_concurrency_limit=concurrency, max_size=64)
    theme = gr.themes.Soft(primary_hue="pink", secondary_hue="indigo", neutral_hue="stone")
    return demo.launch(css=CSS, theme=theme, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-blockbatch demo", description="BlockBatch vs Fast-dLLM, live in the browser."
    )
    parser.add_argument("--model", default=os.environ.get("BLOCKBATCH_MODEL", "tiny-llada"),
                        help="tiny-llada, tiny-dream, a Hub id or a local LLaDA/Dream folder")  # fmt: skip
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument(
        "--host", default=None, help="interface to bind (default 127.0.0.1; 0.0.0.0 on a Space)"
    )
    parser.add_argument("--port", type=port_number, default=None, help="port (default 7860 or the next free one)")
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    parser.add_argument("--concurrency", type=positive_int, default=1, help="decodes at once (the model is shared)")
    parser.add_argument(
        "--max-new-tokens", type=demo_max_new_tokens, default=None,
        help=f"upper limit of the slider (256; 512 on GPU; at least {MIN_NEW_TOKENS}, where it starts)"
    )
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Load the model and serve the app until interrupted."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own health checks, one line per request
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        loaded = load_for_demo(args.model, device=args.device)
    except (ValueError, FileNotFoundError) as err:  # a bad --model / --device: one line, as the CLI does
        print(f"error: {err}", file=sys.stderr)
        return 2
    limits = Limits()
    limits.max_new_tokens = args.max_new_tokens or (512 if loaded.device.type == "cuda" else 256)
    demo = build_demo(loaded, limits=limits, concurrency=args.concurrency)
    launch_demo(demo, server_name=args.host, server_port=args.port, share=args.share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
