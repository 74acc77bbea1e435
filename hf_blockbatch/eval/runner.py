"""The bench runner: every method on every task, one JSONL row per sample, a Markdown table, plots.

``hf-blockbatch bench`` is a thin shell over :func:`run_bench`. What it reproduces is the *shape*
of the paper's Table 1: per task and method, mean latency, mean NFE and accuracy, with reductions
relative to vanilla LLaDA and to Fast-dLLM (dual cache, block 32, τ 0.9), plus the NFE ratio
BlockBatch / Fast-dLLM with and without Fast-dLLM's early stop (the paper's Fast-dLLM decodes to
the end of the canvas; BlockBatch stops at EOS, so both comparisons are needed to see which part
of the saving is early stopping and which is block-size diversity).

Why a Fast-dLLM block-size sweep: the paper's claim is that block-size *diversity* beats any
single fixed block size, not only block 32. ``sweep_blocks`` runs Fast-dLLM at each block size and
the accuracy plots draw those points as a frontier line; the summary says whether BlockBatch's
point is dominated by any of them, and its headline table compares every method with the *tuned*
Fast-dLLM (the most accurate run with early stop), not only with the paper's untuned baseline.

Why compute and latency next to NFE: one BlockBatch forward carries six windows, so fewer forwards
need not mean less work. Each method reports NFE as we count it (every forward carrying a request)
and as the BlockBatch authors count it (``stats["nfe_authors"]``: the winning branch's forwards),
query tokens per request (``stats["query_tokens"]``: positions fed through the model), latency per
item at the run's batch size and at batch 1 (``latency_batch_1`` items re-timed alone), and answer
tokens per second.

Several processes (data parallel): every process decodes a contiguous shard of each task's items
(``accelerate launch``/``torchrun`` set ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), writes its rows to
``shards/``, and after a barrier process 0 merges the shards in item order and writes the table and
plots, so the merged results equal a single-process run's (with greedy decoding and batch size 1
exactly; padded batches give the same tokens too, as the decoding core guarantees). Methods run at the
tuned block (``at_tuned_block``) decode last: before them the processes meet once more, and each reads
every shard's results, so all of them pick the same block.

Files written to ``output_dir`` (:data:`DEFAULT_OUTPUT_DIR` unless named): ``samples.jsonl`` (one row per task × method × item),
``summary.md``, ``summary.json``, ``run.json`` (settings, configs, versions),
``accuracy_vs_nfe.png``, ``accuracy_vs_query_tokens.png`` and ``nfe_distribution.png``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from hf_blockbatch.eval.stats import paired_difference, wilson_interval
from hf_blockbatch.generation.configs import (
    DRAFTED,
    DRAFTED_CONTAINED,
    BlockBatchConfig,
    FastDLLMConfig,
    VanillaDiffusionConfig,
    config_from_dict,
)
from hf_blockbatch.generation.memory import is_out_of_memory
from hf_blockbatch.generation.mixin import check_context
from hf_blockbatch.generation.noise import draws_noise
from hf_blockbatch.generation.outputs import answer_lengths, answer_texts, end_token_ids
from hf_blockbatch.tasks.contract import EvalItem, Task

logger = logging.getLogger(__name__)

__all__ = [
    "ALL_TASKS",
    "BASE_METHODS",
    "METHODS",
    "Method",
    "BenchSettings",
    "ShardInfo",
    "accuracy_plots",
    "build_method_configs",
    "check_scoring",
    "headline_markdown",
    "headline_table",
    "load_for_benchmark",
    "load_task",
    "make_plots",
    "merge_shards",
    "paired_points",
    "parse_overrides",
    "partial_state",
    "read_jsonl",
    "read_samples",
    "render_markdown",
    "run_bench",
    "shard_info",
    "shard_range",
    "summarize",
    "write_report",
]

TINY_TASKS: tuple[str, ...] = ("arith", "code", "lists")
REAL_TASKS: tuple[str, ...] = ("gsm8k", "math", "humaneval", "mbpp")
ALL_TASKS: tuple[str, ...] = TINY_TASKS + REAL_TASKS


@dataclass(frozen=True)
class Method:
    """A named method of the bench: its display name and how its config is built for one task.

    ``build(gen_length, fast_base, own)`` returns the config; ``fast_base`` is the paper's Fast-dLLM
    baseline (dual cache, block 32) with ``fast_dllm``'s overrides, ``own`` the method's own
    overrides (applied last). ``fast_family``: the method builds on ``fast_base``, so
    ``fast_dllm``'s overrides reach it. A new method is one entry of :data:`METHODS`.
    """

    label: str
    build: Callable[[int, dict[str, Any], dict[str, Any]], Any]
    fast_family: bool = False


def _vanilla(gen_length: int, fast_base: dict[str, Any], own: dict[str, Any]) -> VanillaDiffusionConfig:
    steps, block = _vanilla_schedule(gen_length, int(own.get("block_length", BASELINE_BLOCK)))
    return VanillaDiffusionConfig(**{"max_new_tokens": gen_length, "steps": steps, "block_length": block, **own})


#: the authors' harness block sizes; their code asserts that each divides the generation length
REFERENCE_BLOCK_SIZES: tuple[int, ...] = (4, 8, 16, 32, 64)


def _reference_sizes(gen_length: int) -> list[int]:
    """The authors' block sizes that divide ``gen_length`` (all of them if none does, for the
    config to refuse with its one-line error)."""
    return [b for b in REFERENCE_BLOCK_SIZES if gen_length % b == 0] or list(REFERENCE_BLOCK_SIZES)


#: every built-in method, in table order (``fast_dllm``: the paper's baseline, dual, block 32, τ 0.9)
METHODS: dict[str, Method] = {
    "vanilla": Method("Vanilla", _vanilla),
    "fast_dllm": Method("Fast-dLLM", lambda g, fast, own: FastDLLMConfig(max_new_tokens=g, **fast), True),
    "fast_dllm_early_stop": Method(
        "Fast-dLLM + early stop",
        lambda g, fast, own: FastDLLMConfig(**{"max_new_tokens": g, **fast, "early_stop": True, **own}), True,
    ),
    # LocalLeap (Kong et al. 2025) at the paper's Fast-dLLM setting, its relaxed commits around anchors
    "localleap": Method(
        "LocalLeap", lambda g, fast, own: FastDLLMConfig(**{"max_new_tokens": g, **fast, "rule": "localleap", **own}), True,
    ),
    "localleap_early_stop": Method(
        "LocalLeap + early stop",
        lambda g, fast, own: FastDLLMConfig(**{"max_new_tokens": g, **fast, "rule": "localleap", "early_stop": True, **own}),
        True,
    ),
    "blockbatch": Method("BlockBatch", lambda g, fast, own: BlockBatchConfig(**{"max_new_tokens": g, **own})),
    # the authors' bulk BlockBatch step for step, at their harness's block sizes (those dividing g)
    "blockbatch_reference": Method(
        "BlockBatch (reference)", lambda g, fast, own: BlockBatchConfig(**{
            "max_new_tokens": g, "variant": "reference", "block_sizes": _reference_sizes(g), **own}),
    ),
    # LocalLeap's rule inside every BlockBatch branch
    "blockbatch_localleap": Method(
        "BlockBatch + LocalLeap", lambda g, fast, own: BlockBatchConfig(**{"max_new_tokens": g, "rule": "localleap", **own}),
    ),
    # the beyond-the-paper points of issue 16, as users build them (README, "Which decoder to pick"): the
    # preset's own fields over the baseline's (fast_dllm's overrides, e.g. a threshold, still reach them),
    # at the baseline's block unless given theirs (--set fast_dllm_drafted_contained.block_length=64)
    "fast_dllm_sparse": Method(
        "Fast-dLLM + early stop, sparse queries (r 6)",
        lambda g, fast, own: FastDLLMConfig(**{"max_new_tokens": g, **fast, "early_stop": True, "window_queries": "sparse",
                                               "requery_radius": 6, **own}), True,
    ),  # fmt: skip
    "fast_dllm_drafted": Method(
        "FastDLLMConfig.drafted()", lambda g, fast, own: FastDLLMConfig(**{"max_new_tokens": g, **fast, **DRAFTED, **own}), True,
    ),
    "fast_dllm_drafted_contained": Method(
        "FastDLLMConfig.drafted(exact=False)",
        lambda g, fast, own: FastDLLMConfig(**{"max_new_tokens": g, **fast, **DRAFTED_CONTAINED, **own}), True,
    ),
    "blockbatch_lean": Method("BlockBatchConfig.lean()", lambda g, fast, own: BlockBatchConfig.lean(**{"max_new_tokens": g, **own})),
}
#: the methods a bench runs unless told otherwise: the paper's comparison
BASE_METHODS: tuple[str, ...] = ("vanilla", "fast_dllm", "fast_dllm_early_stop", "blockbatch")
#: the baseline of the paper: Fast-dLLM dual cache, block 32, τ 0.9
BASELINE_BLOCK = 32
SWEEP_PREFIX = "fast_dllm_b"
#: overrides under this name apply to every sweep point (e.g. ``fast_dllm_sweep.early_stop=false``)
SWEEP_KEY = "fast_dllm_sweep"
#: ``sweep_blocks="auto"``: every multiple of this block size up to the generation length
SWEEP_AUTO_STEP = 16
#: stats keys that are large or per step, never written per sample
_DROP_STATS = ("trace",)
#: row fields that differ between two runs of the same decoding (timings, process)
TIMING_FIELDS = ("latency_s", "batch_seconds", "rank", "latency_b1_s")
TIMING_STATS = ("seconds", "forward_seconds", "sample_seconds")


# ------------------------------------------------------------------------------------------ tasks


def load_task(name: str, data_path: str | os.PathLike[str] | None = None) -> Task:
    """A tiny suite (``arith``, ``code``, ``lists``) or a real benchmark (``gsm8k``, ``math``,
    ``humaneval``, ``mbpp``) by name; both implement the same :class:`Task` contract."""
    if name in TINY_TASKS:
        from hf_blockbatch.tasks import get_suite

        return get_suite(name)
    from hf_blockbatch.eval.benchmarks import get_benchmark

    try:
        return get_benchmark(name, data_path=data_path)
    except KeyError as e:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(ALL_TASKS)}") from e


def check_scoring(tasks: Iterable[Task]) -> None:
    """Raise a one-line ``ValueError`` when one of ``tasks`` scores by running the answer's code and the sandbox
    cannot run a program here (:func:`~hf_blockbatch.tasks.execution.check_sandbox`): its every item would score
    wrong, a 0 % read as the model's. Called once before the first decode by whatever scores code: the bench, the
    training's held-out decodes, the benchmark scripts."""
    if any(getattr(task, "kind", None) == "code" for task in tasks):
        from hf_blockbatch.tasks.execution import check_sandbox

        check_sandbox()


# ---------------------------------------------------------------------------------------- methods


def _parse_value(text: str) -> Any:
    """``--set`` values: JSON when it parses (numbers, true/false, null, lists, strings in
    quotes), a list when there are commas (``4,8,16``), a plain string otherwise (``dual``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    if "," in text:
        return [_parse_value(p.strip()) for p in text.split(",") if p.strip()]
    return text


def parse_overrides(
    assignments: Iterable[str] = (), config_file: str | os.PathLike[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Per-method config overrides from a JSON file (``{"blockbatch": {"block_sizes": [4, 8]}}``)
    and ``method.field=value`` assignments (applied after the file, so the command line wins).

    A JSON entry under a new name with a ``"strategy"`` (``vanilla``/``fast_dllm``/``blockbatch``)
    defines an extra method, e.g. ``{"bb_nomerge": {"strategy": "blockbatch", "merge": false}}``;
    name it in ``methods`` to run it.
    """
    out: dict[str, dict[str, Any]] = {}
    if config_file is not None:
        if not Path(config_file).is_file():
            raise FileNotFoundError(f"--configs {str(config_file)!r}: no such file.")
        try:
            data = json.loads(Path(config_file).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"--configs {str(config_file)!r} is not valid JSON: {err}.") from err
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise ValueError(f"{config_file}: expected a JSON object of method -> {{field: value}}")
        for method, fields in data.items():
            out.setdefault(method, {}).update(fields)
    for item in assignments:
        key, sep, value = item.partition("=")
        method, dot, fname = key.strip().partition(".")
        if not sep or not dot or not method or not fname:
            raise ValueError(f"--set expects method.field=value (e.g. blockbatch.block_sizes=4,8,16), got {item!r}")
        out.setdefault(method, {})[fname] = _parse_value(value.strip())
    return out


def _vanilla_schedule(gen_length: int, block: int) -> tuple[int, int]:
    """(steps, block) for vanilla with one step per token where the block count allows it.

    Why round: LLaDA's sampler needs ``steps`` to be a multiple of the number of blocks; for a
    generation length that is not a multiple of the block we take the smallest such ``steps``
    ≥ ``gen_length`` (one token per step on average, as the paper's ``steps = gen length``): the
    config's own default (``VanillaDiffusionConfig.resolved``), for a block no wider than the length.
    """
    return VanillaDiffusionConfig(max_new_tokens=gen_length, block_length=min(block, gen_length)).resolved()


def sweep_block_sizes(spec: Sequence[int] | str, gen_length: int) -> list[int]:
    """The block sizes of a Fast-dLLM sweep for one task: ``spec`` itself, or for ``"auto"`` / ``"auto:S"`` every
    multiple of S (:data:`SWEEP_AUTO_STEP`) up to the generation length, and the generation length itself (one
    block over the whole canvas).

    Why "auto": the tuned baseline is the sweep's most accurate point, so a sweep that stops short of the
    generation length can leave the best block out. On the tiny suites a sweep to 64 missed blocks 48, 80 and 96,
    the most accurate on four of six test splits (benchmarks/RESULTS.md §35)."""
    if not isinstance(spec, str):
        return [int(b) for b in spec]
    name, _, step = spec.partition(":")
    if name != "auto" or (step and not (step.isdigit() and int(step) > 0)):
        raise ValueError(f"sweep blocks {spec!r}: give block sizes (e.g. [16, 32, 64]), 'auto' or 'auto:S' with S >= 1.")
    step_size = int(step) if step else SWEEP_AUTO_STEP
    return sorted({*range(step_size, gen_length + 1, step_size), gen_length})


def build_method_configs(
    methods: Sequence[str],
    gen_length: int,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    sweep_blocks: Sequence[int] | str = (),
) -> dict[str, Any]:
    """Name -> generation config for one task's generation length (``sweep_blocks``: see :func:`sweep_block_sizes`).

    Defaults (the paper's setup): vanilla = ``steps = gen length``, block 32; ``fast_dllm`` = dual
    cache, block 32, τ 0.9, no early stop; ``fast_dllm_early_stop`` = the same with early stop;
    ``blockbatch`` = :class:`BlockBatchConfig` defaults. ``fast_dllm_early_stop`` and the sweep
    points ``fast_dllm_b{N}`` inherit ``fast_dllm``'s overrides (then their own), so a changed
    baseline threshold moves all Fast-dLLM variants together.

    The sweep points decode *with* early stop (``fast_dllm_sweep.early_stop=false`` turns it off):
    BlockBatch stops at EOS, so a frontier without early stop would credit block-size diversity
    with savings that are only early stopping.
    """
    overrides = {k: dict(v) for k, v in (overrides or {}).items()}
    # threshold 0.9 is FastDLLMConfig's own default, so a factor or steps override replaces it
    fast_base = {"cache": "dual", "block_length": BASELINE_BLOCK, **overrides.get("fast_dllm", {})}

    def make(name: str) -> Any:
        own = overrides.get(name, {})
        if name in METHODS:
            return METHODS[name].build(gen_length, fast_base, own)
        if name.startswith(SWEEP_PREFIX) and name[len(SWEEP_PREFIX) :].isdigit():
            block = int(name[len(SWEEP_PREFIX) :])
            kw = {"max_new_tokens": gen_length, **fast_base, "early_stop": True, **overrides.get(SWEEP_KEY, {})}
            return FastDLLMConfig(**{**kw, "block_length": block, **own})
        if "strategy" in own:
            return config_from_dict({"max_new_tokens": gen_length, **own})
        raise ValueError(
            f"unknown method {name!r}; known: {', '.join(METHODS)} (or define one in the config file "
            'with a "strategy")'
        )

    names = list(dict.fromkeys(list(methods) + [f"{SWEEP_PREFIX}{b}" for b in sweep_block_sizes(sweep_blocks, gen_length)]))
    _check_overrides(overrides, names)
    configs = {}
    for name in names:
        try:  # GenerationConfig validates in __init__ too
            cfg = make(name)
            cfg.validate()
        except (TypeError, ValueError) as err:  # our message names the field and what to change; add the method
            raise ValueError(f"{name}: {err}") from err
        if (cfg.num_return_sequences or 1) != 1:  # scoring reads one answer per item, in item order
            raise ValueError(
                f"{name}: num_return_sequences={cfg.num_return_sequences} is not supported by the benchmarks, which "
                "score one answer per item; remove it."
            )
        configs[name] = cfg
    return configs


def _check_overrides(overrides: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> None:
    """Refuse overrides that would be ignored: a misspelt or unselected method (a config file may
    still define methods with a ``"strategy"`` that this run does not select), and
    ``max_new_tokens``, which is the run's generation length (``--gen-length``)."""
    fast = any(_sweep_block(n) is not None or (n in METHODS and METHODS[n].fast_family) for n in names)
    ignored = sorted(
        m for m, fields in overrides.items()
        if m not in names and "strategy" not in fields and not (fast and m in ("fast_dllm", SWEEP_KEY))
    )  # fmt: skip
    if ignored:
        raise ValueError(
            f"Overrides for {', '.join(map(repr, ignored))} would be ignored: this run decodes {', '.join(names)} "
            f"(fast_dllm's and {SWEEP_KEY}'s overrides reach every Fast-dLLM variant). Fix the method name, or "
            "add the method to --methods."
        )
    for m, fields in overrides.items():
        if "max_new_tokens" in fields:
            raise ValueError(f"{m}.max_new_tokens: the generation length is set for all methods by --gen-length.")


def method_label(name: str) -> str:
    """Display name of a method (sweep points read ``Fast-dLLM b=N (sweep)``)."""
    if name in METHODS:
        return METHODS[name].label
    if name.startswith(SWEEP_PREFIX) and name[len(SWEEP_PREFIX) :].isdigit():
        return f"Fast-dLLM b={name[len(SWEEP_PREFIX) :]} (sweep)"
    return name


def tuned_candidate(name: str) -> bool:
    """Whether a method's runs compete for the tuned Fast-dLLM (:func:`tuned_fast_dllm`): the sweep's points and
    ``fast_dllm_early_stop``."""
    return _sweep_block(name) is not None or name == "fast_dllm_early_stop"


def in_tuned_pool(name: str, cell: Mapping[str, Any]) -> bool:
    """Whether a summary cell is one the tuned Fast-dLLM is picked from (:func:`tuned_fast_dllm`), which is also the
    fixed-block frontier the scorecard draws: a :func:`tuned_candidate` whose run did not turn early stop off (a cell
    of a summary that does not record it counts, as it did for the pick; the frontier once left it out)."""
    return tuned_candidate(name) and cell.get("early_stop") is not False


def _sweep_block(name: str) -> int | None:
    rest = name[len(SWEEP_PREFIX) :]
    return int(rest) if name.startswith(SWEEP_PREFIX) and rest.isdigit() else None


def _config_key(cfg: Any) -> str:
    return json.dumps(cfg.to_diff_dict() if hasattr(cfg, "to_diff_dict") else cfg.to_dict(), sort_keys=True)


# ---------------------------------------------------------------------------------------- sharding


@dataclass(frozen=True)
class ShardInfo:
    """Which process this is: ``rank`` of ``world_size``, on node-local GPU ``local_rank``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that shows the progress bar and merges the shards into the results."""
        return self.rank == 0


def shard_info() -> ShardInfo:
    """Read the launcher's environment (``accelerate launch`` and ``torchrun`` set ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``); a plain ``python`` run is rank 0 of 1."""
    env = {}
    for name, default in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", os.environ.get("RANK", "0"))):
        value = os.environ.get(name, default)
        try:
            env[name] = int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer: the launcher (torchrun, accelerate launch) sets it.") from None
    world, rank, local = env["WORLD_SIZE"], env["RANK"], env["LOCAL_RANK"]
    if world > 1 and "RANK" not in os.environ:  # every process would take rank 0 and wait for the others for days
        raise ValueError(
            f"WORLD_SIZE={world} but RANK is unset: start the processes with torchrun --nproc_per_node {world} (or, on "
            f"GPUs, accelerate launch --num_processes {world}), which set both, or unset WORLD_SIZE for one process."
        )
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return ShardInfo(rank=rank, world_size=world, local_rank=local)


def shard_range(n: int, rank: int, world_size: int) -> range:
    """The contiguous slice of ``n`` items that process ``rank`` decodes.

    Same split as ``accelerate``'s ``split_between_processes``: the first ``n % world_size``
    processes take one extra item; every item goes to exactly one process.
    """
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def partial_state(shard: ShardInfo) -> Any:
    """accelerate's process state for a multi-process launch, checked against ``shard``.

    Why ``cpu=`` on machines without a GPU: accelerate then only joins the launched processes
    (gloo) when told it runs on CPUs; otherwise it would silently act as a single process and its
    barrier would not wait for anyone.
    """
    from accelerate import PartialState

    # shards of a large model can take long: a short collective timeout would kill the waiting rank 0
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=_dt.timedelta(days=2))
    if state.num_processes != shard.world_size:
        raise RuntimeError(
            f"accelerate sees {state.num_processes} process(es) but WORLD_SIZE={shard.world_size}; "
            "launch with `accelerate launch --num_processes N` or `torchrun --nproc_per_node N`"
        )
    return state


def default_barrier(shard: ShardInfo) -> Callable[[], None]:
    """A barrier over the launched processes (a no-op for one process)."""
    if shard.world_size == 1:
        return lambda: None
    return partial_state(shard).wait_for_everyone


# ------------------------------------------------------------------------------------------ io


def _jsonable(obj: Any) -> Any:
    """``obj`` as strict JSON holds it: a non-finite number becomes null (``json.dumps`` would write ``NaN``, which
    JSON readers other than Python's refuse), also inside a tensor or as a NumPy scalar."""
    if isinstance(obj, torch.Tensor):
        return _jsonable(obj.tolist())
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if hasattr(obj, "item"):
        return _jsonable(obj.item())
    return str(obj)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a line that is not JSON (a file cut short by a copy or a full disk) is a ``ValueError``
    naming the file and the line, not a bare ``JSONDecodeError`` that names neither."""
    from hf_blockbatch.eval.benchmarks import _read_jsonl

    return _read_jsonl(path)


#: the per-sample rows of a bench folder; not kept in git (see ``benchmarks/RESULTS.md``)
SAMPLES_FILE = "samples.jsonl"
#: where a run writes without ``output_dir`` / ``--output-dir``, relative to the working folder: under bench_out/
#: (gitignored, where the notebook and model cards write theirs), not benchmarks/results/, which put a stray
#: ``benchmarks/`` tree in whatever folder an installed package ran from and untracked files in a clone's records
DEFAULT_OUTPUT_DIR = "bench_out/bench"


def read_samples(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The per-sample rows a bench run wrote into ``folder``.

    Why a reader with its own message: the committed result folders keep their summaries, tables
    and plots but not the raw rows (tens of MB per run), so a folder from a fresh checkout has no
    ``samples.jsonl`` until its bench command is re-run; say so instead of a bare ``FileNotFoundError``.
    """
    path = Path(folder) / SAMPLES_FILE
    if not path.is_file():
        settings = Path(folder) / "run.json"
        how = f"its settings are in {settings}" if settings.is_file() else "benchmarks/RESULTS.md lists the commands"
        raise FileNotFoundError(
            f"{path} is absent: raw per-sample outputs are not kept in git. Re-run the bench command that "
            f"wrote {folder} ({how}; benchmarks/RESULTS.md gives each result folder's command)."
        )
    return read_jsonl(path)


def _jsonl_text(rows: Iterable[Mapping[str, Any]]) -> str:
    """``rows`` as JSONL text, one strict-JSON object a line."""
    return "".join(json.dumps(_jsonable(row), ensure_ascii=False) + "\n" for row in rows)


def _replace_files(texts: Mapping[Path, str]) -> None:
    """Write each file's text beside it (``<name>.tmp``), then move them all into place. A write that fails (a full
    disk, a file-size limit) or a run stopped during the writes leaves the files that were there whole: none half
    written, and none of them beside a file of another run (a bench rerun into its folder that failed writing
    ``summary.json`` left the new ``samples.jsonl``, a cut ``summary.json`` and the earlier run's ``summary.md``)."""
    written: list[Path] = []
    try:
        for path, text in texts.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            written.append(path.with_name(path.name + ".tmp"))
            written[-1].write_text(text, encoding="utf-8")
    except BaseException as err:
        for tmp in written:
            tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:  # a write's EFBIG or ENOSPC names no file
            err.filename = str(written[-1])
        raise
    for path, tmp in zip(texts, written):
        tmp.replace(path)


def _write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    _replace_files({path: _jsonl_text(rows)})


def load_for_benchmark(name: str, threads: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """A benchmark script's start: timestamped INFO logging, ``threads`` torch threads (the figures in
    ``benchmarks/RESULTS.md`` are measured on one), and the model and tokenizer (:func:`hub.load_model`)."""
    from hf_blockbatch.hub import load_model

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        # torch.set_num_threads(0) fails deep inside torch, and a negative count is an error it words its own way
        raise ValueError(f"threads must be >= 1 (torch CPU threads), got {threads!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(threads)
    return load_model(name, device=device, dtype=dtype)


def write_report(stem: str | os.PathLike[str], result: Mapping[str, Any], markdown: str) -> Path:
    """Write a benchmark script's result as ``<stem>.json`` (every figure, for tables and later
    reads) beside ``<stem>.md`` (the table a reader quotes), creating the folder; returns the
    stem. One writer, so that every script's pair of files has the same form. A folder under a file is refused
    with a ``NotADirectoryError`` that names it (the scripts check their ``--out`` before their work, with the same
    :func:`~hf_blockbatch.eval.script_args.folder_problem`)."""
    from hf_blockbatch.eval.script_args import folder_problem

    stem = Path(stem)
    if problem := folder_problem(stem.parent):
        raise NotADirectoryError(problem)
    _replace_files({stem.with_name(stem.name + ".json"): json.dumps(_jsonable(result), indent=1) + "\n",
                    stem.with_name(stem.name + ".md"): markdown.rstrip("\n") + "\n"})  # fmt: skip
    logger.info("wrote %s.{json,md}", stem)
    return stem


def _shard_path(out_dir: Path, rank: int, world: int) -> Path:
    return out_dir / "shards" / f"samples.rank{rank}-of-{world}.jsonl"


def merge_shards(
    out_dir: str | os.PathLike[str], world_size: int, task_order: Sequence[str], method_order: Sequence[str]
) -> list[dict[str, Any]]:
    """Read every process's shard and return the rows in single-process order
    (task, method, item index), so a sharded run's ``samples.jsonl`` equals an unsharded one's."""
    out_dir = Path(out_dir)
    rows: list[dict[str, Any]] = []
    for rank in range(world_size):
        path = _shard_path(out_dir, rank, world_size)
        if not path.is_file():
            raise FileNotFoundError(f"shard of process {rank} is missing: {path}")
        rows.extend(read_jsonl(path))
    rows.sort(key=_row_order(task_order, method_order))
    return rows


def _row_order(task_order: Sequence[str], method_order: Sequence[str]) -> Callable[[Mapping[str, Any]], tuple]:
    """The sort key of a run's rows: task, method, item index, in the run's orders (unknown names last)."""
    t_ix = {t: i for i, t in enumerate(task_order)}
    m_ix = {m: i for i, m in enumerate(method_order)}
    return lambda r: (t_ix.get(r["task"], len(t_ix)), m_ix.get(r["method"], len(m_ix)), r["index"])


def _remove_stale_shards(out_dir: Path) -> None:
    """Remove what an earlier, interrupted run into ``out_dir`` left in ``shards/`` (its rows and picks, under
    another process count, which this run's merge does not read), and the folder when it is empty: this run's
    ``samples.jsonl`` and summary replace that run's, and its shards would otherwise sit beside them as if they
    belonged to it."""
    folder = out_dir / "shards"
    if not folder.is_dir():
        return
    for path in sorted([*folder.glob("samples.rank*-of-*.jsonl"), *folder.glob("pick.rank*-of-*.jsonl")]):
        logger.warning("removing %s, left by an earlier run into this folder that did not finish", path)
        path.unlink(missing_ok=True)
    if not any(folder.iterdir()):
        folder.rmdir()


def _pick_path(out_dir: Path, rank: int, world: int) -> Path:
    return out_dir / "shards" / f"pick.rank{rank}-of-{world}.jsonl"


def _gather_pick_rows(out_dir: Path, shard: ShardInfo, rows: Sequence[Mapping[str, Any]],
                      barrier: Callable[[], None]) -> list[dict[str, Any]]:  # fmt: skip
    """Every process's rows so far (what :func:`_tuned_block` reads of them), for a pick that needs every
    item's result: each process writes its own, waits for the others, and reads them all. Removed with the
    shards, after the last barrier, when every process has read them."""
    keep = ("task", "method", "correct", "nfe")
    path = _pick_path(out_dir, shard.rank, shard.world_size)
    _write_jsonl(path, ({k: r[k] for k in keep} for r in rows))
    barrier()
    pool: list[dict[str, Any]] = []
    for rank in range(shard.world_size):
        pool.extend(read_jsonl(_pick_path(out_dir, rank, shard.world_size)))
    return pool


# ----------------------------------------------------------------------------------------- run


@dataclass
class BenchSettings:
    """Everything that determines a bench run (saved to ``run.json``)."""

    model: str = "tiny-llada"
    tasks: list[str] = field(default_factory=lambda: list(TINY_TASKS))
    methods: list[str] = field(default_factory=lambda: list(BASE_METHODS))
    #: method -> {config field: value}, see :func:`parse_overrides`
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Fast-dLLM block sizes to sweep (the fixed-block frontier), e.g. [4, 8, 16, 32, 64], or "auto" / "auto:S"
    #: (every multiple of S, 16 by default, up to each task's generation length: :func:`sweep_block_sizes`)
    sweep_blocks: list[int] | str = field(default_factory=list)
    limit: int | None = None
    batch_size: int = 1
    #: the sampling configs' ``seed`` when they name none (keyed noise: :func:`key_sampling_noise`)
    seed: int = 0
    #: None: each task's ``default_gen_length``
    gen_length: int | None = None
    output_dir: str = DEFAULT_OUTPUT_DIR
    #: None: the GPU of this process when present, else the CPU
    device: str | None = None
    #: "auto" (bf16 on GPU, float32 on CPU), "float32", "bfloat16", "float16"
    dtype: str = "auto"
    #: accelerate device map ("auto" spreads a model larger than one GPU over the visible GPUs)
    device_map: str | None = None
    #: None: use the chat template when the tokenizer has one (instruct/chat models)
    chat: bool | None = None
    #: local data files for the real benchmarks, task -> path
    data_paths: dict[str, str] = field(default_factory=dict)
    #: one small untimed decode first, so the first timed batch does not pay for kernel setup
    warmup: bool = True
    progress: bool = True
    #: write the PNG plots (needs matplotlib, the ``eval`` extra)
    plots: bool = True
    #: with batch_size > 1: decode the first N items of each task and method again alone, to report
    #: latency at batch 1 next to the run's batch size (0: off; at batch size 1 every item is alone).
    #: Several processes: each re-times those of the first N items its shard holds (the same N items in all)
    latency_batch_1: int = 0
    #: methods (of ``methods``, each with a ``block_length``) decoded last, at each task's tuned Fast-dLLM block: the
    #: most accurate of this run's sweep points and ``fast_dllm_early_stop`` (:func:`tuned_fast_dllm`), as issue 16
    #: compares its presets. The pick needs every item's result: with several processes each reads all shards' rows
    at_tuned_block: list[str] = field(default_factory=list)


def _check_output_files(out_dir: Path, plots: bool, shard: ShardInfo) -> None:
    """Refuse, before the model loads, what would stop the run only once every item is decoded: a folder where the
    run writes (or, plots off, removes) one of its files, ``shards`` a file where several processes write their rows,
    and plots asked for without matplotlib. Each was a traceback after the last decode."""
    import importlib.util

    names = [SAMPLES_FILE, "run.json", "summary.json", "summary.md", *PLOT_FILES]
    if blocked := [n for n in names if (out_dir / n).is_dir()]:
        raise ValueError(f"output_dir {str(out_dir)!r} holds a folder {blocked[0]!r} where the run writes its file: "
                         "move it away or name another folder for the results.")  # fmt: skip
    if shard.world_size > 1 and (out_dir / "shards").exists() and not (out_dir / "shards").is_dir():
        raise ValueError(f"output_dir {str(out_dir)!r} holds a file 'shards' where the processes write their rows: "
                         "move it away or name another folder for the results.")  # fmt: skip
    if plots and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("the plots need matplotlib, which is not installed: pip install 'hf-blockbatch[eval]', or "
                         "skip them (bench --no-plots, BenchSettings(plots=False)).")  # fmt: skip


def _resolve_dtype(name: str) -> torch.dtype | None:
    """``auto`` leaves the choice to :func:`~hf_blockbatch.hub.load_model` (bf16 on GPU); any other name is read,
    or refused, as load_model reads it (:func:`~hf_blockbatch.hub.checked_dtype`), said before the model loads."""
    from hf_blockbatch.hub import checked_dtype

    return None if name == "auto" else checked_dtype(name)


def _check_methods_fit(model: Any, plans: list[tuple[str, Task, list[EvalItem], int, dict[str, Any]]]) -> None:
    """Refuse, once the model is loaded and before the first decode, a method the model cannot run (``generate``'s own
    check, :func:`~hf_blockbatch.generation.plans.check_model`): ``blockbatch_reference`` on Dream was refused only
    when its turn came, after every method before it had decoded."""
    from hf_blockbatch.generation.plans import check_config_model

    for name, _task, _items, _gen_length, configs in plans:
        for method, cfg in configs.items():
            try:
                check_config_model(cfg, model)
            except ValueError as err:
                raise ValueError(f"{name} / {method}: {err}") from None


def _load(settings: BenchSettings, shard: ShardInfo) -> tuple[Any, Any]:
    """The bench's model and tokenizer. Where the bench shows no progress bar (``--no-progress``, a process other
    than the first), transformers' "Loading weights" and download bars are off too while it loads: they were the
    one bar on stderr of a ``--no-progress`` run."""
    from transformers.utils import logging as transformers_logging

    if settings.progress and shard.is_main or not transformers_logging.is_progress_bar_enabled():
        return _load_model(settings, shard)
    transformers_logging.disable_progress_bar()
    try:
        return _load_model(settings, shard)
    finally:
        transformers_logging.enable_progress_bar()


def _load_model(settings: BenchSettings, shard: ShardInfo) -> tuple[Any, Any]:
    from hf_blockbatch.hub import load_model

    if settings.device_map is not None:
        # the model spans devices: accelerate places it (one model per process, so combine
        # device_map with several processes only when each process sees its own GPUs)
        dtype = _resolve_dtype(settings.dtype)
        return load_model(settings.model, dtype=dtype, device_map=settings.device_map)
    device = settings.device
    if device is None:
        device = f"cuda:{shard.local_rank}" if torch.cuda.is_available() else "cpu"
    return load_model(settings.model, device=device, dtype=_resolve_dtype(settings.dtype))


def _input_device(model: Any) -> torch.device:
    """Where the prompts go: the embedding's device (the first GPU of a ``device_map``), or, when
    accelerate has offloaded it to ``meta``, or when its ``weight`` is no tensor (a quantized embedding's is a
    method: ``torch.ao.quantization.quantize_dynamic`` with ``nn.Embedding``), the device the model says it computes
    on."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    return model.device


def _encode(tokenizer: Any, texts: Sequence[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask; no special tokens added (the chat template already holds BOS)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(list(texts), add_special_tokens=False, return_tensors="pt", padding=True)
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def _check_prompts_fit(model: Any, tokenizer: Any, task: str, prompts: Sequence[str], gen_length: int) -> None:
    """Before any decode: the longest prompt of a task plus the generation length must fit the
    model's context (otherwise the warm-up decode would be the first to fail, naming its own length)."""
    longest = max(len(ids) for ids in tokenizer(list(prompts), add_special_tokens=False).input_ids)
    try:
        check_context(model.config, longest, gen_length)
    except ValueError as err:
        raise ValueError(f"Task {task!r}: its longest prompt does not fit. {err} (--limit, --gen-length)") from err


def _score_all(task: Task, items: Sequence[EvalItem], completions: Sequence[str]) -> list[Any]:
    score_batch = getattr(task, "score_batch", None)
    if callable(score_batch):
        return list(score_batch(items, completions))
    return [task.score(it, c) for it, c in zip(items, completions)]


def _release_memory(device: torch.device) -> None:
    """After an out-of-memory error: hand the unwound decode's cached blocks back, so the smaller batch finds them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warmup(model: Any, tokenizer: Any, prompt: str, device: torch.device) -> None:
    ids, mask = _encode(tokenizer, [prompt], device)
    for cfg in (FastDLLMConfig(max_new_tokens=8, block_length=4), BlockBatchConfig(max_new_tokens=8, block_sizes=[4, 8])):
        model.generate(ids, mask, generation_config=cfg, return_dict_in_generate=True)
    _synchronize(device)


def samples(cfg: Any) -> bool:
    """Whether a config draws random numbers (a temperature, or random remasking)."""
    return draws_noise(float(cfg.temperature or 0.0), getattr(cfg, "remasking", "low_confidence"))


def key_sampling_noise(configs: Mapping[str, Any], seed: int) -> None:
    """Give every sampling config without a ``seed`` of its own the run's: keyed noise (generation/noise.py), so
    that an item samples the same answer whatever the batch size, the process count, an out-of-memory halving or
    a re-decode alone, and a run repeats with the same seed."""
    for cfg in configs.values():
        if samples(cfg) and cfg.seed is None:
            cfg.seed = seed


def _decode(
    model: Any, tokenizer: Any, cfg: Any, prompts: Sequence[str], device: torch.device, end_ids: list[int]
) -> tuple[Any, list[str], list[int], float]:
    """One timed ``generate`` over ``prompts`` (left-padded into one batch): ``(output, answer texts,
    answer token counts, wall seconds)``. The clock covers only the call (synchronized on a GPU). A sampling
    config carries its seed (:func:`key_sampling_noise`)."""
    ids, mask = _encode(tokenizer, prompts, device)
    _synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, mask, generation_config=cfg, return_dict_in_generate=True)
    _synchronize(device)
    seconds = time.perf_counter() - t0
    new = out.sequences[:, ids.shape[1] :]
    return out, answer_texts(tokenizer, new, end_ids), answer_lengths(new, end_ids).tolist(), seconds


def _count_timed(mine: range, retimed: int) -> int:
    """Decodes of one method on the shard ``mine``: every item, plus those of the first ``retimed`` items of the
    task that the shard holds, again alone."""
    return len(mine) + len(range(mine.start, min(mine.stop, retimed)))


def _method_order(orders: Sequence[Sequence[str]]) -> list[str]:
    """Every task's methods in one order, for the summary and the rows: a method an earlier task lacks (an extra
    sweep point of a longer task, e.g. block 96 under ``--sweep-blocks auto``) goes right after the one before it
    in its own task's order. The first task's order alone dropped the other tasks' extra points from the summary."""
    order: list[str] = []
    for methods in orders:
        before = -1
        for m in methods:
            if m not in order:
                order.insert(before + 1, m)
            before = order.index(m)
    return order


def _time_alone(
    model: Any, tokenizer: Any, cfg: Any, rows: Sequence[dict[str, Any]], device: torch.device, end_ids: list[int]
) -> None:
    """Decode each of ``rows``' items again, alone (batch 1), and record its wall time in the row.

    Why re-time a few items rather than run the whole split twice: batch-1 latency is what the
    paper reports and what an interactive user sees, while the run's batch size is what makes a
    full split affordable; the first N items of each method, decoded right after that method's
    batched pass (so the model and the allocator are warm), give the batch-1 figure at the cost of
    N decodes. ``same_output_b1`` says whether the lone decode gave the batched answer, as it must (a padded
    batch decodes each prompt as alone; sampled ones too, with keyed noise); ``None`` when a sampling config's
    noise comes from elsewhere than a seed.
    """
    same = not samples(cfg) or cfg.seed is not None
    for row in rows:
        _, texts, _, seconds = _decode(model, tokenizer, cfg, [row["prompt"]], device, end_ids)
        row["latency_b1_s"] = seconds
        row["same_output_b1"] = texts[0] == row["output"] if same else None


def _config_at_block(settings: BenchSettings, method: str, gen_length: int, block: int) -> Any:
    """``method``'s config at ``block`` (``at_tuned_block``): its own overrides with that block length, and the
    ``fast_dllm`` overrides, which reach a Fast-dLLM preset."""
    own = {**settings.overrides.get(method, {}), "block_length": block}
    reach = {k: v for k, v in settings.overrides.items() if k == "fast_dllm"}
    return build_method_configs([method], gen_length, {**reach, method: own})[method]


def _check_at_tuned_block(settings: BenchSettings, configs: Mapping[str, Any], gen_length: int) -> None:
    """Refuse, before any model loads, an ``at_tuned_block`` request the run cannot honour: also one whose pool of
    runs all turn early stop off (no tuned block to pick: a ``KeyError`` once they had decoded) or a method that is no
    valid config at one of the blocks the pick may give (refused once the runs before it had decoded)."""
    deferred = settings.at_tuned_block
    if not deferred:
        return
    candidates = [m for m in configs if tuned_candidate(m)]
    for m in deferred:
        if m not in configs:
            raise ValueError(f"--at-tuned-block {m}: not a method of this run; add it to --methods.")
        if m in candidates:
            raise ValueError(f"--at-tuned-block {m}: it is one of the runs the tuned block is picked from.")
        if not hasattr(configs[m], "block_length"):
            raise ValueError(f"--at-tuned-block {m}: a {type(configs[m]).__name__} has no single block length.")
        if "block_length" in settings.overrides.get(m, {}):
            raise ValueError(f"--at-tuned-block {m}: it also sets {m}.block_length; drop one of the two.")
    if not candidates:
        raise ValueError("--at-tuned-block needs runs to pick the tuned block from: add --sweep-blocks (e.g. auto) "
                         "or fast_dllm_early_stop to --methods.")  # fmt: skip
    # the pick is among the candidates that decode with early stop (in_tuned_pool, as tuned_fast_dllm reads them)
    pool = [m for m in candidates if in_tuned_pool(m, {"early_stop": configs[m].early_stop})]
    if not pool:
        raise ValueError(f"--at-tuned-block needs runs with early stop to pick the tuned block from: "
                         f"it is off in {', '.join(candidates)} (early_stop=false); drop that override.")  # fmt: skip
    for m in deferred:
        for block in sorted({configs[c].block_length for c in pool}):
            try:
                _config_at_block(settings, m, gen_length, block)
            except ValueError as err:
                raise ValueError(f"--at-tuned-block {m}: at block {block}, which the tuned block may be, {err}") from None


def _tuned_block(rows: Sequence[Mapping[str, Any]], task: str, configs: Mapping[str, Any], aliases: Mapping[str, str]) -> int:
    """The block of ``task``'s tuned Fast-dLLM (:func:`tuned_fast_dllm`) among the decoded rows."""
    cells = {}
    for m, cfg in configs.items():
        if not tuned_candidate(m):
            continue
        mine = [r for r in rows if r["task"] == task and r["method"] == aliases.get(m, m)]
        if mine:
            cells[m] = {"accuracy": _mean([float(r["correct"]) for r in mine]), "nfe_mean": _mean([r["nfe"] for r in mine]),
                        "sweep_block": _sweep_block(m), "early_stop": cfg.early_stop, "block": cfg.block_length}  # fmt: skip
    return int(cells[tuned_fast_dllm(cells)]["block"])


def _checked_tasks(settings: BenchSettings) -> BenchSettings:
    """The settings with each task once (a repeat would decode and count its items twice, as methods are
    de-duplicated too), refusing an empty task or method list and data files no task reads."""
    if not settings.tasks:
        raise ValueError(f"No task to run: name one or more of {', '.join(ALL_TASKS)}.")
    if not settings.methods:
        raise ValueError(f"No method to run: name one or more of {', '.join(METHODS)}, or one defined in --configs.")
    unknown = sorted(set(settings.data_paths) - set(settings.tasks))
    if unknown:
        raise ValueError(
            f"--data names {', '.join(unknown)}, which --task does not run ({', '.join(settings.tasks)})."
        )
    built_in = sorted(set(settings.data_paths) & set(TINY_TASKS))
    if built_in:
        raise ValueError(
            f"--data names {', '.join(built_in)}, a built-in suite generated in code: data files are for "
            f"{', '.join(REAL_TASKS)}."
        )
    tasks = list(dict.fromkeys(settings.tasks))
    return settings if tasks == list(settings.tasks) else replace(settings, tasks=tasks)


def run_bench(
    settings: BenchSettings,
    model: Any = None,
    tokenizer: Any = None,
    shard: ShardInfo | None = None,
    barrier: Callable[[], None] | None = None,
) -> dict[str, Any] | None:
    """Run the bench; process 0 returns the summary (see :func:`summarize`), others ``None``.

    ``model``/``tokenizer`` skip loading (tests, notebooks). ``shard`` and ``barrier`` default to
    the launcher's environment and accelerate's barrier; tests pass them to run the shards of a
    multi-process run one after another in one process.
    """
    from hf_blockbatch.eval.script_args import folder_problem

    shard = shard or shard_info()
    barrier = barrier or default_barrier(shard)
    n_alone = settings.latency_batch_1
    if not isinstance(n_alone, int) or isinstance(n_alone, bool) or n_alone < 0:
        raise ValueError(f"latency_batch_1 must be an integer >= 0 (items re-timed alone; 0: off), got {n_alone!r}.")
    settings = _checked_tasks(settings)
    out_dir = Path(settings.output_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"output_dir {str(out_dir)!r} is a file: name a folder for the results.")
    if problem := folder_problem(out_dir):  # the first write is after every decode
        raise ValueError(f"output_dir: {problem}.")
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_output_files(out_dir, settings.plots, shard)
    # tasks, items and configs first: a misspelt task or method is said before minutes of loading an 8B model
    plans: list[tuple[str, Task, list[EvalItem], int, dict[str, Any]]] = []
    for name in settings.tasks:
        task = load_task(name, settings.data_paths.get(name))
        items = task.items("test", limit=settings.limit)
        gen_length = int(settings.gen_length or task.default_gen_length)
        configs = build_method_configs(settings.methods, gen_length, settings.overrides, settings.sweep_blocks)
        key_sampling_noise(configs, settings.seed)
        _check_at_tuned_block(settings, configs, gen_length)
        plans.append((name, task, items, gen_length, configs))
    check_scoring([task for _n, task, _i, _g, _c in plans])  # before the model loads

    if model is None or tokenizer is None:
        model, tokenizer = _load(settings, shard)
    _check_methods_fit(model, plans)
    end_ids = end_token_ids(tokenizer, model.config)
    device = _input_device(model)
    chat = settings.chat if settings.chat is not None else bool(getattr(tokenizer, "chat_template", None))

    # a sweep point identical to the baseline (b=32 with the default fast_dllm) is not decoded twice
    aliases: dict[str, dict[str, str]] = {}
    for name, _task, _items, _g, configs in plans:
        seen: dict[str, str] = {}
        aliases[name] = {}
        for m, cfg in configs.items():
            key = _config_key(cfg)
            if key in seen and _sweep_block(m) is not None:
                aliases[name][m] = seen[key]
            else:
                seen.setdefault(key, m)

    retimed = settings.latency_batch_1 if settings.batch_size > 1 else 0
    total = sum(_count_timed(shard_range(len(items), shard.rank, shard.world_size), retimed)
                * (len(cfgs) - len(aliases[n])) for n, _t, items, _g, cfgs in plans)  # fmt: skip
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=f"bench (process {shard.rank})" if shard.world_size > 1 else "bench",
               unit="sample", disable=not settings.progress or not shard.is_main, dynamic_ncols=True)  # fmt: skip
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    # each task's shard of the items and their prompts, all checked before the first decode
    work: list[tuple[str, Task, list[EvalItem], int, dict[str, Any], range, dict[int, str]]] = []
    for name, task, items, gen_length, configs in plans:
        mine = shard_range(len(items), shard.rank, shard.world_size)
        if len(mine):
            prompts = {i: task.prompt(items[i], tokenizer, chat=chat) for i in mine}
            _check_prompts_fit(model, tokenizer, name, list(prompts.values()), gen_length)
            work.append((name, task, items, gen_length, configs, mine, prompts))
    if work and settings.warmup:
        name, _t, _i, _g, _c, mine, prompts = work[0]
        _warmup(model, tokenizer, prompts[mine[0]], device)

    def decode(name: str, task: Task, items: list[EvalItem], gen_length: int, method: str, cfg: Any, mine: range,
               prompts: dict[int, str]) -> None:  # fmt: skip
        """Decode the shard's items of one task with one method, in batches, and append their rows."""
        bar.set_postfix_str(f"{name} / {method}")
        first_row, size, b0 = len(rows), settings.batch_size, mine.start
        while b0 < mine.stop:
            idx = list(range(b0, min(b0 + size, mine.stop)))
            try:
                out, texts, lengths, seconds = _decode(model, tokenizer, cfg, [prompts[i] for i in idx], device, end_ids)
            except RuntimeError as err:
                if len(idx) == 1 or not is_out_of_memory(err):
                    raise
                # a padded batch decodes each request as alone, so a smaller batch gives the same rows; the method
                # keeps the smaller size (a drafted or BlockBatch request holds 4-6 cache rows where Fast-dLLM holds 1)
                size = len(idx) // 2
                logger.warning("%s / %s: a batch of %d ran out of memory; this method goes on at batch %d (rows record "
                               "their batch_size). %s", name, method, len(idx), size, err)  # fmt: skip
                _release_memory(device)
                continue
            b0 += len(idx)
            batch_items = [items[i] for i in idx]
            scores = _score_all(task, batch_items, texts)
            for j, (i, item, text, score) in enumerate(zip(idx, batch_items, texts, scores)):
                stats = {k: v for k, v in (out.stats[j] if out.stats else {}).items() if k not in _DROP_STATS}
                rows.append({
                    "task": name, "index": i, "id": item.id, "method": method, "strategy": cfg.strategy,
                    "gen_length": gen_length, "prompt": prompts[i], "output": text,
                    "reference": item.reference, "extracted": score.extracted, "correct": bool(score.correct),
                    "detail": score.detail, "nfe": int(out.nfe[j]), "latency_s": seconds / len(idx),
                    "batch_seconds": seconds, "batch_size": len(idx), "rank": shard.rank, "stats": stats,
                    "answer_tokens": lengths[j], "latency_b1_s": seconds if settings.batch_size == 1 else None,
                    "same_output_b1": None, "batch_reduced": size < settings.batch_size,
                })  # fmt: skip
            bar.update(len(idx))
        if retimed:  # the task's first N items, whichever shards hold them: as one process re-times them
            _time_alone(model, tokenizer, cfg, [r for r in rows[first_row:] if r["index"] < retimed], device, end_ids)
            bar.update(_count_timed(mine, retimed) - len(mine))

    deferred = set(settings.at_tuned_block)
    for name, task, items, gen_length, configs, mine, prompts in work:
        for method, cfg in configs.items():
            if method not in aliases[name] and method not in deferred:
                decode(name, task, items, gen_length, method, cfg, mine, prompts)
    if deferred:
        # the methods at the tuned block go last, once the runs that pick it are decoded, on every shard: each
        # process picks from every process's rows (the same pick everywhere)
        pool = rows if shard.world_size == 1 else _gather_pick_rows(out_dir, shard, rows, barrier)
        for name, task, items, gen_length, configs, mine, prompts in work:
            for method in configs:
                if method not in deferred or method in aliases[name]:
                    continue
                block = _tuned_block(pool, name, configs, aliases[name])
                configs[method] = _config_at_block(settings, method, gen_length, block)
                key_sampling_noise({method: configs[method]}, settings.seed)
                logger.info("%s: %s at the tuned block %d", name, method, block)
                decode(name, task, items, gen_length, method, configs[method], mine, prompts)
    bar.close()
    logger.info("process %d: %d rows in %.1f s", shard.rank, len(rows), time.perf_counter() - started)

    method_order = _method_order([list(cfgs) for _n, _t, _i, _g, cfgs in plans]) if plans else list(settings.methods)
    if shard.world_size > 1:
        _write_jsonl(_shard_path(out_dir, shard.rank, shard.world_size), rows)
        barrier()
        if not shard.is_main:
            return None
        rows = merge_shards(out_dir, shard.world_size, settings.tasks, method_order)
        for rank in range(shard.world_size):
            _shard_path(out_dir, rank, shard.world_size).unlink(missing_ok=True)
            _pick_path(out_dir, rank, shard.world_size).unlink(missing_ok=True)
    else:  # the order a merge gives (methods at the tuned block were decoded last)
        rows.sort(key=_row_order(settings.tasks, method_order))
    _remove_stale_shards(out_dir)

    summary = summarize(rows, settings.tasks, method_order, aliases, {n: cfgs for n, _t, _i, _g, cfgs in plans})
    summary["meta"] = _run_meta(settings, shard, model, plans, chat)
    # all four written before any replaces the earlier run's: a failed write leaves that run's files as they were
    texts = {out_dir / SAMPLES_FILE: _jsonl_text(rows),
             out_dir / "run.json": json.dumps(_jsonable(summary["meta"]), indent=2) + "\n",
             out_dir / "summary.json": json.dumps(_jsonable(summary), indent=2) + "\n",
             out_dir / "summary.md": render_markdown(summary)}  # fmt: skip
    _replace_files(texts)
    # a folder's files all describe one run: no plot of an earlier run next to this summary (plots off, or a plot
    # this run fails to write)
    for stale in (out_dir / name for name in PLOT_FILES):
        if stale.exists():
            stale.unlink()
            logger.info("removed %s of an earlier run", stale)
    if settings.plots:
        summary["plots"] = [str(p) for p in make_plots(summary, rows, out_dir)]
    logger.info("results in %s", out_dir)
    return summary


def _run_meta(
    settings: BenchSettings, shard: ShardInfo, model: Any, plans: Sequence[tuple], chat: bool
) -> dict[str, Any]:
    import transformers

    import hf_blockbatch

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": asdict(settings),
        "model_class": type(model).__name__,
        "device": str(_input_device(model)),
        "dtype": str(next(model.parameters()).dtype),
        "chat_template": chat,
        "processes": shard.world_size,
        "torch_threads": torch.get_num_threads(),
        "versions": {"hf_blockbatch": hf_blockbatch.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},  # fmt: skip
        "tasks": {name: {"items": len(items), "gen_length": g,
                         "configs": {m: c.to_diff_dict() for m, c in cfgs.items()}}
                  for name, _t, items, g, cfgs in plans},  # fmt: skip
    }


# -------------------------------------------------------------------------------------- summary


def _mean(xs: Sequence[float]) -> float | None:
    return float(statistics.fmean(xs)) if xs else None


def _mean_stat(stats: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Mean of a per-request statistic; ``None`` unless every request reports it (a decoder, or an
    older result file, that does not count it gives no figure rather than a mean over some rows)."""
    values = [s.get(key) for s in stats]
    return None if any(v is None for v in values) else _mean([float(v) for v in values])


def _throughput(rs: Sequence[Mapping[str, Any]], seconds_key: str) -> tuple[float | None, float | None, int]:
    """``(mean seconds per item, answer tokens per second, items)`` over the rows timed by ``seconds_key``.

    Tokens per second is total answer tokens (up to each answer's first end token, what a user
    reads) over total decode time, so a batch's items share its wall time as they did on the clock."""
    timed = [r for r in rs if r.get(seconds_key) is not None]
    if not timed:
        return None, None, 0
    total = sum(float(r[seconds_key]) for r in timed)
    tokens = [r.get("answer_tokens") for r in timed]
    tps = sum(tokens) / total if total > 0 and all(t is not None for t in tokens) else None
    return total / len(timed), tps, len(timed)


def summarize(
    rows: Sequence[Mapping[str, Any]],
    task_order: Sequence[str],
    method_order: Sequence[str],
    aliases: Mapping[str, Mapping[str, str]] | None = None,
    configs: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Per task and method: n, accuracy with its Wilson 95 % interval, mean/median NFE (ours and as
    the authors count it), mean query tokens per request, latency per item at the run's batch size
    and at batch 1, answer tokens per second, branch statistics; reductions relative to vanilla and
    Fast-dLLM; the BlockBatch / Fast-dLLM NFE ratios; whether BlockBatch is dominated by a point of
    the block sweep; and the headline table against tuned baselines (:func:`headline_table`).

    ``configs`` (task -> method -> config) lets a cell say whether the method stops early.
    Statistics read per request from ``stats``: ``nfe_authors`` and ``query_tokens`` (absent ones
    give ``None``, shown as "—")."""
    aliases = aliases or {}
    tasks: dict[str, Any] = {}
    for task in task_order:
        cells: dict[str, Any] = {}
        right: dict[str, dict[Any, bool]] = {}  # per method: item index -> answered right (for paired gaps)
        for method in method_order:
            src = aliases.get(task, {}).get(method, method)
            rs = [r for r in rows if r["task"] == task and r["method"] == src]
            if not rs:
                continue
            right[method] = {r["index"]: bool(r["correct"]) for r in rs}
            k, n = sum(bool(r["correct"]) for r in rs), len(rs)
            lo, hi = wilson_interval(k, n)
            nfes = [int(r["nfe"]) for r in rs]
            stats = [r.get("stats") or {} for r in rs]
            winners: dict[str, int] = {}
            for s in stats:
                if s.get("winner_block_size") is not None:
                    winners[str(s["winner_block_size"])] = winners.get(str(s["winner_block_size"]), 0) + 1
            _, tps, _ = _throughput(rs, "latency_s")
            lat1, tps1, n1 = _throughput(rs, "latency_b1_s")
            cfg = (configs or {}).get(task, {}).get(method)
            cells[method] = {
                "label": method_label(method), "alias_of": src if src != method else None,
                "n": n, "correct": k, "accuracy": k / n, "ci95": [lo, hi],
                "nfe_mean": _mean(nfes), "nfe_median": float(statistics.median(nfes)),
                "nfe_block_mean": _mean([s.get("nfe_block", 0) for s in stats]),
                "nfe_refresh_mean": _mean([s.get("nfe_refresh", 0) for s in stats]),
                "syncs_mean": _mean([s.get("syncs", 0) for s in stats]),
                "merged_mean": _mean([s.get("merged", 0) for s in stats]),
                "latency_mean_s": _mean([float(r["latency_s"]) for r in rs]),
                "seconds_total": float(sum(float(r["latency_s"]) for r in rs)),
                "winner_block_sizes": winners,
                "sweep_block": _sweep_block(method),
                "early_stop": getattr(cfg, "early_stop", None),
                "block": getattr(cfg, "block_length", None) if cfg is not None else _sweep_block(method),
                "nfe_authors_mean": _mean_stat(stats, "nfe_authors"),
                "query_tokens_mean": _mean_stat(stats, "query_tokens"),
                "answer_tokens_mean": _mean_stat(rs, "answer_tokens"),
                "tokens_per_second": tps,
                "latency_b1_mean_s": lat1, "tokens_per_second_b1": tps1, "n_b1": n1,
                "b1_output_mismatches": sum(r.get("same_output_b1") is False for r in rs),
                # out of memory at the run's batch size: the largest batch this method then decoded at (latency differs)
                "batch_reduced_to": max((int(r["batch_size"]) for r in rs if r.get("batch_reduced")), default=None),
            }  # fmt: skip
        for cell in cells.values():
            for ref in ("vanilla", "fast_dllm"):
                base = cells.get(ref)
                ok = base is not None and base["nfe_mean"] and cell["nfe_mean"] is not None
                cell[f"nfe_ratio_vs_{ref}"] = cell["nfe_mean"] / base["nfe_mean"] if ok else None
                lat = base["latency_mean_s"] if base is not None else None
                cell[f"speedup_vs_{ref}"] = lat / cell["latency_mean_s"] if lat and cell["latency_mean_s"] else None
        head = _headline(cells)
        tuned = head.get("tuned_fast_dllm")
        if tuned is not None:  # each method's accuracy minus the tuned baseline's, on the same items
            for m, cell in cells.items():
                cell["accuracy_vs_tuned"] = paired_difference(right[m], right[tuned]) if m != tuned else None
        tasks[task] = {"methods": cells, "headline": head, "headline_table": headline_table(cells, head)}
    return {"tasks": tasks}


def _headline(cells: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The numbers the issue asks about: BlockBatch / Fast-dLLM NFE (with and without Fast-dLLM's
    early stop), the accuracy gap, and the fixed-block frontier verdict."""
    bb, fd, fde = cells.get("blockbatch"), cells.get("fast_dllm"), cells.get("fast_dllm_early_stop")
    out: dict[str, Any] = {
        "nfe_ratio_bb_fd": bb["nfe_mean"] / fd["nfe_mean"] if bb and fd else None,
        "nfe_ratio_bb_fd_early_stop": bb["nfe_mean"] / fde["nfe_mean"] if bb and fde else None,
        "acc_gap_points_bb_fd": 100 * (bb["accuracy"] - fd["accuracy"]) if bb and fd else None,
        "frontier": None,
    }
    sweep = {m: c for m, c in cells.items() if c.get("sweep_block") is not None}
    if bb and sweep:
        dominating = [
            (m, c) for m, c in sweep.items()
            if c["nfe_mean"] <= bb["nfe_mean"] and c["accuracy"] >= bb["accuracy"]
            and (c["nfe_mean"] < bb["nfe_mean"] or c["accuracy"] > bb["accuracy"])
        ]  # fmt: skip
        best = min(sweep.items(), key=lambda mc: mc[1]["nfe_mean"])
        out["frontier"] = {
            "dominated": bool(dominating),
            "dominated_by": sorted(c["sweep_block"] for _, c in dominating),
            "lowest_nfe_block": best[1]["sweep_block"],
            "nfe_ratio_bb_lowest": bb["nfe_mean"] / best[1]["nfe_mean"],
        }
    tuned = tuned_fast_dllm(cells)
    out["tuned_fast_dllm"] = tuned
    td = cells[tuned] if tuned else None
    out["nfe_ratio_bb_tuned"] = _ratio(bb, td, "nfe_mean")
    out["query_tokens_ratio_bb_tuned"] = _ratio(bb, td, "query_tokens_mean")
    out["acc_gap_points_bb_tuned"] = 100 * (bb["accuracy"] - td["accuracy"]) if bb and td else None
    return out


def _ratio(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None, key: str) -> float | None:
    if a is None or b is None or a.get(key) is None or not b.get(key):
        return None
    return a[key] / b[key]


def tuned_fast_dllm(cells: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The tuned Fast-dLLM baseline of a task: among the Fast-dLLM runs with early stop (the block
    sweep's points and ``fast_dllm_early_stop``), the most accurate, ties going to the lower mean
    NFE (then the smaller block); ``None`` when none ran.

    Why this one: the paper compares with Fast-dLLM at block 32 without early stop, which a user
    choosing a method would not run. It is chosen on the same items it is reported on, which
    flatters it slightly, as the best of several configurations always is."""
    pool = [(m, c) for m, c in cells.items() if in_tuned_pool(m, c)]
    if not pool:
        return None
    return min(pool, key=lambda mc: (-mc[1]["accuracy"], mc[1]["nfe_mean"], mc[1].get("block") or 0))[0]


#: the headline table's rows, in order, where run; ``TUNED`` stands for :func:`tuned_fast_dllm`'s
#: pick. Methods not in :data:`METHODS` yet (LocalLeap, the authors' BlockBatch) appear once added.
TUNED = "tuned_fast_dllm"
HEADLINE_METHODS: tuple[str, ...] = ("vanilla", "fast_dllm", TUNED, "localleap", "blockbatch_reference", "blockbatch",
                                     "blockbatch_lean", "fast_dllm_sparse", "fast_dllm_drafted", "fast_dllm_drafted_contained")
HEADLINE_LABELS = {"fast_dllm": "Fast-dLLM (paper: dual, b=32, τ 0.9, no early stop)", "blockbatch": "BlockBatch (ours)"}
#: the columns a headline row copies from its method's cell
_HEADLINE_KEYS = (
    "n", "accuracy", "ci95", "nfe_mean", "nfe_authors_mean", "query_tokens_mean", "latency_mean_s",
    "latency_b1_mean_s", "n_b1", "tokens_per_second", "tokens_per_second_b1", "early_stop", "sweep_block", "block",
    "accuracy_vs_tuned",
)


def headline_table(cells: Mapping[str, Mapping[str, Any]], headline: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The paper's comparison with tuned baselines: one row per method of :data:`HEADLINE_METHODS`
    that ran, with accuracy, NFE (ours and the authors'), query tokens, latency at the run's batch
    size and at batch 1, tokens per second, and NFE / query tokens relative to the tuned Fast-dLLM."""
    tuned = headline.get("tuned_fast_dllm")
    td = cells.get(tuned) if tuned else None
    out = []
    for name in HEADLINE_METHODS:
        method = tuned if name == TUNED else name
        cell = cells.get(method) if method else None
        if cell is None:
            continue
        if name == TUNED:
            stop = "early stop" if cell.get("early_stop") is not False else "no early stop"
            label = f"Fast-dLLM, best block ({cell.get('block') or cell.get('sweep_block')}, {stop})"
        else:
            label = HEADLINE_LABELS.get(name, cell["label"])
        out.append({
            "method": method, "role": name, "label": label, **{k: cell.get(k) for k in _HEADLINE_KEYS},
            "nfe_vs_tuned": _ratio(cell, td, "nfe_mean"), "query_tokens_vs_tuned": _ratio(cell, td, "query_tokens_mean"),
        })  # fmt: skip
    return out


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * (x - 1):+.1f} %"


def _times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _acc(c: Mapping[str, Any]) -> str:
    lo, hi = c["ci95"]
    return f"{100 * c['accuracy']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def _b1(c: Mapping[str, Any], value: float | None, fmt: str) -> str:
    """A batch-1 figure, with how many items it is over when that is not all of them."""
    out = _num(value, fmt)
    return out if value is None or c.get("n_b1", 0) >= c["n"] else f"{out} (n={c['n_b1']})"


def _metric_header(batch: Any) -> tuple[str, str]:
    """The measured columns' header and rule; a run at batch 1 has one latency and one tokens/s column (its batch-1
    figures are the run's own)."""
    alone = batch != 1
    cols = ["Accuracy (%) [95 % CI]", "NFE", "NFE (authors)", "Query tokens", f"Latency (s), batch {batch}",
            *(["Latency (s), batch 1"] if alone else []), f"Tokens/s, batch {batch}", *(["Tokens/s, batch 1"] if alone else [])]  # fmt: skip
    return " | ".join(cols), "|".join(["---"] + ["---:"] * (len(cols) - 1))


def _metric_cells(c: Mapping[str, Any], batch: Any) -> str:
    """The measured columns of a method, shared by the per-task and the headline tables (see :func:`_metric_header`)."""
    alone = batch != 1
    return " | ".join([
        _acc(c), _num(c["nfe_mean"]), _num(c.get("nfe_authors_mean")), _num(c.get("query_tokens_mean"), "{:.0f}"),
        _num(c["latency_mean_s"], "{:.3f}"), *([_b1(c, c.get("latency_b1_mean_s"), "{:.3f}")] if alone else []),
        _num(c.get("tokens_per_second"), "{:.0f}"), *([_b1(c, c.get("tokens_per_second_b1"), "{:.0f}")] if alone else []),
    ])  # fmt: skip


def headline_markdown(rows: Sequence[tuple[str, Mapping[str, Any]]], batch: Any, first: str = "Task") -> list[str]:
    """Markdown lines of a headline table: ``rows`` are ``(first column, row of headline_table)``
    (``benchmarks/make_tables.py --headline`` puts the model and suite in the first column)."""
    top, rule = _metric_header(batch)
    lines = [f"| {first} | Method | {top} | Δ accuracy vs tuned (points) [paired 95 % CI] | NFE / tuned Fast-dLLM | "
             "Query tokens / tuned Fast-dLLM |", f"|---|---|{rule}|---:|---:|---:|"]  # fmt: skip
    for key, r in rows:
        lines.append(f"| {key} | {r['label']} | {_metric_cells(r, batch)} | {paired_points(r.get('accuracy_vs_tuned'))} | "
                     f"{_num(r['nfe_vs_tuned'], '{:.2f}')} | {_num(r['query_tokens_vs_tuned'], '{:.2f}')} |")  # fmt: skip
    return lines


def paired_points(d: Mapping[str, Any] | None) -> str:
    """A paired accuracy difference (:func:`~hf_blockbatch.eval.stats.paired_difference`) in
    points with its interval, e.g. ``-1.4 [-3.0, +0.2]``; "—" when there is none."""
    if not d:
        return "—"
    lo, hi = d["ci95"]
    return f"{100 * d['difference']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def render_markdown(summary: Mapping[str, Any]) -> str:
    """The summary as Markdown: the headline table against tuned baselines, one table per task with
    the paper's columns and the compute columns, then the headline ratios and the frontier verdict."""
    meta = summary.get("meta", {})
    batch = meta.get("settings", {}).get("batch_size", "B")
    lines = ["# Bench results", ""]
    if meta:
        s = meta["settings"]
        alone = s.get("latency_batch_1", 0)
        b1 = ("every item was decoded alone" if s["batch_size"] == 1 else
              f"the first {alone} item{'s' if alone > 1 else ''} of each method re-timed alone (`--latency-batch-1`)" if alone else
              "not measured (`--latency-batch-1 N` re-times N items alone)")  # fmt: skip
        lines += [
            f"Model `{s['model']}` ({meta['model_class']}, {meta['dtype']}) on {meta['device']}, "
            f"{meta['processes']} process(es), batch size {s['batch_size']}, seed {s['seed']}, "
            f"chat template {'on' if meta['chat_template'] else 'off'}; {meta['date']}.",
            "Latency = wall time of a batch / its size; batch 1: " + b1 + ". NFE = forward passes per request "
            "(every forward that carries it); NFE (authors) = the forwards of the winning branch only, as the "
            "BlockBatch authors count; query tokens = positions fed through the model per request, summed over "
            "its forwards (the compute); tokens/s = answer tokens (up to the first end token) per second of "
            "decoding. Accuracy with Wilson 95 % interval. Reductions: NFE change and speed-up relative to "
            "vanilla and to Fast-dLLM (dual cache, block 32, τ 0.9, no early stop). Sweep rows: Fast-dLLM at "
            "other block sizes, with early stop unless configured otherwise (`run.json` holds every config).",
            "",
        ]
    head_rows = [(task, r) for task, t in summary["tasks"].items() for r in t.get("headline_table", [])]
    if head_rows:
        lines += [
            "## Headline: against tuned baselines",
            "",
            "The tuned Fast-dLLM is the most accurate Fast-dLLM run with early stop (the block sweep's points and "
            "Fast-dLLM + early stop; ties: the lower NFE).",
            "",
            *headline_markdown(head_rows, batch),
            "",
        ]
    for task, t in summary["tasks"].items():
        cells = t["methods"]
        if not cells:
            continue
        n = max(c["n"] for c in cells.values())
        g = meta.get("tasks", {}).get(task, {}).get("gen_length")
        lines += [f"## {task} ({n} items" + (f", gen length {g})" if g else ")"), ""]
        top, rule = _metric_header(batch)
        lines += [
            f"| Method | {top} | NFE vs Vanilla | Speed-up vs Vanilla | NFE vs Fast-dLLM | Speed-up vs Fast-dLLM "
            "| Δ accuracy vs tuned (points) [paired 95 % CI] |",
            f"|---|{rule}|---:|---:|---:|---:|---:|",
        ]
        for c in cells.values():
            alias = f" (= {method_label(c['alias_of'])})" if c.get("alias_of") else ""
            lines.append(
                f"| {c['label']}{alias} | {_metric_cells(c, batch)} | {_pct(c['nfe_ratio_vs_vanilla'])} | "
                f"{_times(c['speedup_vs_vanilla'])} | {_pct(c['nfe_ratio_vs_fast_dllm'])} | "
                f"{_times(c['speedup_vs_fast_dllm'])} | {paired_points(c.get('accuracy_vs_tuned'))} |"
            )
        odd = {c["label"]: c["b1_output_mismatches"] for c in cells.values() if c.get("b1_output_mismatches")}
        if odd:
            lines += ["", "**Decoded alone, these greedy answers differ from the batched ones** (a padded batch must "
                          "decode as alone): " + ", ".join(f"{k}: {v}" for k, v in odd.items()) + "."]  # fmt: skip
        small = {c["label"]: c["batch_reduced_to"] for c in cells.values() if c.get("batch_reduced_to")}
        if small:
            lines += ["", f"**Out of memory at batch {batch}**: these methods went on at a smaller batch (greedy decoding "
                          "gives the same tokens and NFE; the latency is not comparable): "
                          + ", ".join(f"{k} at {v}" for k, v in small.items()) + "."]  # fmt: skip
        bb = cells.get("blockbatch")
        if bb and bb["winner_block_sizes"]:
            wins = ", ".join(f"{k}: {v}" for k, v in sorted(bb["winner_block_sizes"].items(), key=lambda kv: int(kv[0])))
            lines += ["", f"BlockBatch per request: {bb['nfe_block_mean']:.1f} block + {bb['nfe_refresh_mean']:.1f} "
                          f"refresh forwards, {bb['merged_mean']:.1f} tokens merged, {bb['syncs_mean']:.1f} syncs; "
                          f"winner block size (count) {wins}."]  # fmt: skip
        lines.append("")
    heads = {k: v["headline"] for k, v in summary["tasks"].items() if v["methods"]}
    if any(h["nfe_ratio_bb_fd"] is not None for h in heads.values()):
        lines += [
            "## BlockBatch against Fast-dLLM",
            "",
            "| Task | NFE BlockBatch / Fast-dLLM | NFE BlockBatch / Fast-dLLM + early stop | Accuracy BlockBatch − Fast-dLLM (points) "
            "| NFE / tuned Fast-dLLM | Query tokens / tuned Fast-dLLM | Accuracy − tuned (points) | Fixed-block frontier |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for task, h in heads.items():
            fr = h["frontier"]
            if fr is None:
                verdict = "no sweep"
            elif fr["dominated"]:
                verdict = "dominated by block " + ", ".join(map(str, fr["dominated_by"]))
            else:
                verdict = (f"on or beyond (NFE {fr['nfe_ratio_bb_lowest']:.2f}× the lowest-NFE block, "
                           f"{fr['lowest_nfe_block']})")  # fmt: skip
            lines.append(
                f"| {task} | {_num(h['nfe_ratio_bb_fd'], '{:.3f}')} | {_num(h['nfe_ratio_bb_fd_early_stop'], '{:.3f}')} "
                f"| {_num(h['acc_gap_points_bb_fd'], '{:+.1f}')} | {_num(h.get('nfe_ratio_bb_tuned'), '{:.3f}')} "
                f"| {_num(h.get('query_tokens_ratio_bb_tuned'), '{:.3f}')} | {_num(h.get('acc_gap_points_bb_tuned'), '{:+.1f}')} "
                f"| {verdict} |"
            )
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- plots

#: what :func:`make_plots` writes into a bench folder
PLOT_FILES = ("accuracy_vs_nfe.png", "accuracy_vs_query_tokens.png", "nfe_distribution.png")
#: the x axes of the accuracy plots: (cell key, axis label)
_ACCURACY_AXES = (("nfe_mean", "mean NFE per request"), ("query_tokens_mean", "mean query tokens per request"))
_COLORS = {"vanilla": "tab:gray", "fast_dllm": "tab:blue", "fast_dllm_early_stop": "tab:cyan", "localleap": "tab:green",
           "blockbatch_reference": "tab:orange", "blockbatch": "tab:red"}  # fmt: skip


def _save_grid(fig: Any, axes: Any, used: int, path: Path, bottom: float = 0.0) -> Path:
    """Hide the unused panels of a subplot grid, save it, and free the figure (``bottom``: the
    fraction of the figure kept free below the panels, for a shared legend)."""
    import matplotlib.pyplot as plt

    for ax in list(axes.flat)[used:]:
        ax.set_visible(False)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _method_colors(names: Sequence[str]) -> dict[str, Any]:
    """One colour per method, the same in every panel and plot of a figure: the built-in methods
    keep theirs, the others take distinct ones from ``tab20`` then ``tab20b`` (34 of them before a colour
    repeats: §10-11's combined plots hold 21)."""
    import matplotlib

    used = {matplotlib.colors.to_hex(u) for u in _COLORS.values()}
    palette = [c for name in ("tab20", "tab20b") for c in matplotlib.colormaps[name].colors
               if matplotlib.colors.to_hex(c) not in used]  # fmt: skip
    out, i = {}, 0
    for m in names:
        if m in _COLORS:
            out[m] = _COLORS[m]
        elif m not in out:
            out[m] = palette[i % len(palette)]
            i += 1
    return out


def _accuracy_panel(ax: Any, task: str, t: Mapping[str, Any], x_key: str, x_label: str,
                    colors: Mapping[str, Any] | None = None, legend: bool = True) -> None:  # fmt: skip
    """One task's accuracy against ``x_key``: the Fast-dLLM block sweep as a line (the fixed-block
    frontier, its tuned point starred), every other method as a point with its Wilson interval."""
    cells = t["methods"]
    has_x = {m: c for m, c in cells.items() if c.get(x_key) is not None}
    sweep = sorted((c for c in has_x.values() if c.get("sweep_block") is not None), key=lambda c: c["sweep_block"])
    if sweep:
        ax.plot([c[x_key] for c in sweep], [100 * c["accuracy"] for c in sweep], "o--", color="tab:blue",
                alpha=0.5, label="Fast-dLLM block sweep (fixed-block frontier)")  # fmt: skip
        for c in sweep:
            ax.annotate(str(c["sweep_block"]), (c[x_key], 100 * c["accuracy"]), textcoords="offset points",
                        xytext=(4, -10), fontsize=8, color="tab:blue")  # fmt: skip
    tuned = t.get("headline", {}).get("tuned_fast_dllm")
    if tuned in has_x:
        c = has_x[tuned]
        ax.plot([c[x_key]], [100 * c["accuracy"]], "*", markersize=14, color="tab:blue",
                label=f"tuned Fast-dLLM (block {c.get('block') or c.get('sweep_block')})")  # fmt: skip
    for m, c in has_x.items():
        if c.get("sweep_block") is not None:
            continue
        lo, hi = c["ci95"]
        acc = 100 * c["accuracy"]
        ax.errorbar([c[x_key]], [acc], yerr=[[acc - 100 * lo], [100 * hi - acc]], fmt="s", capsize=3,
                    color=(colors or _COLORS).get(m), label=c["label"])  # fmt: skip
    if not has_x:  # e.g. a decoder that does not report query tokens
        ax.text(0.5, 0.5, f"no method reports {x_label}", ha="center", va="center", transform=ax.transAxes)
    xs = [c[x_key] for c in has_x.values() if c[x_key] > 0]
    if xs and max(xs) > 20 * min(xs):  # vanilla's one forward per token would squash every other point
        ax.set_xscale("log")
    ax.set_title(task)
    ax.set_xlabel(x_label)
    ax.set_ylabel("accuracy (%)")
    ax.grid(alpha=0.3)
    if has_x and legend:
        ax.legend(fontsize=7)


def _panel_grid(summary: Mapping[str, Any]) -> tuple[list[str], int, int]:
    """The tasks that have methods, and the ``(columns, rows)`` of their panel grid (at most three wide)."""
    tasks = [t for t, v in summary["tasks"].items() if v["methods"]]
    ncols = min(3, len(tasks)) or 1
    return tasks, ncols, -(-len(tasks) // ncols)


def accuracy_plots(summary: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> list[Path]:
    """``accuracy_vs_nfe.png`` and ``accuracy_vs_query_tokens.png`` of a summary (one panel per task),
    from its cells alone: ``benchmarks/paper_table.py`` draws runs of several folders together."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    tasks, ncols, nrows = _panel_grid(summary)
    if not tasks:
        return []
    colors = _method_colors([m for t in tasks for m in summary["tasks"][t]["methods"]])
    paths = []
    for (x_key, x_label), name in zip(_ACCURACY_AXES, PLOT_FILES[:2]):
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows + 1.2), squeeze=False)
        for ax, task in zip(axes.flat, tasks):
            _accuracy_panel(ax, task, summary["tasks"][task], x_key, x_label, colors, legend=False)
        # one legend for the figure, below the panels: inside a panel it hides the points
        handles: dict[str, Any] = {}
        for ax in list(axes.flat)[: len(tasks)]:
            for h, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, h)
        bottom = 0.0
        if handles:
            rows_needed = -(-len(handles) // 4)
            bottom = min(0.45, (0.28 * rows_needed + 0.2) / (4.2 * nrows + 1.2))
            fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=8, frameon=False)
        paths.append(_save_grid(fig, axes, len(tasks), out_dir / name, bottom))
    return paths


def make_plots(summary: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], out_dir: str | os.PathLike[str]) -> list[Path]:
    """``accuracy_vs_nfe.png`` and ``accuracy_vs_query_tokens.png`` (one panel per task: each
    method's point with its Wilson interval, the Fast-dLLM block sweep as a line, the tuned
    baseline starred) and ``nfe_distribution.png`` (box plots of per-request NFE per method).
    Uses the Agg backend: no display needed."""
    tasks, ncols, nrows = _panel_grid(summary)
    if not tasks:
        return []
    out_dir = Path(out_dir)
    paths = accuracy_plots(summary, out_dir)  # selects the Agg backend first
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        cells = summary["tasks"][task]["methods"]
        names = list(cells)
        data = []
        for m in names:
            src = cells[m].get("alias_of") or m
            data.append([r["nfe"] for r in rows if r["task"] == task and r["method"] == src])
        ax.boxplot(data, showmeans=True)
        ax.set_xticks(range(1, len(names) + 1), [cells[m]["label"] for m in names], rotation=35, ha="right",
                      fontsize=8)  # fmt: skip
        ax.set_title(task)
        ax.set_ylabel("NFE per request")
        ax.grid(alpha=0.3, axis="y")
    paths.append(_save_grid(fig, axes, len(tasks), out_dir / PLOT_FILES[2]))
    return paths
