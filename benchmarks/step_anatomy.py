"""Where a decode's time goes, part by part, for several decoders side by side (RESULTS §31, §34).

Why: on a CPU the drafts' latency gap to the tuned Fast-dLLM is their policy, not their forwards (§31 found the
model time equal and the rest 2.5 ms per item dearer, from scratch timers). This makes that reading reproducible,
and says which part a change to the policy should aim at and what it won.

Each part is the wall time inside one library function, *exclusive* of the other timed functions it calls: the
functions are wrapped for the run (``PARTS``), the library is not edited. "model" is every model call
(``Forwards.timed``); "block-step layout" is what a block step does around its forward (spans, sparse query sets);
"rest" is the decode's time outside every part (state and cache set-up, the loop, the output). Every decoder runs
the same training items (never a test question) in the same padded batches, round-robin for ``--rounds`` rounds
after one untimed round; a figure is the median over rounds of the per-item time.

    PYTHONPATH=$PWD python benchmarks/step_anatomy.py --model tiny-llada --suite code --limit 64 --batch-size 1

``--ops N`` adds one round per decoder under ``torch.profiler``: the self CPU time of its N costliest operators
(attention, matrix products, gathers), each for every decoder, which says what a part such as "model" is made of.

Writes ``benchmarks/results/step_anatomy/<model>_<suite>_b<batch>_<limit>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_blockbatch import cache as cache_mod
from hf_blockbatch.eval.runner import _encode, load_for_benchmark, load_task, write_report
from hf_blockbatch.eval.script_args import nonnegative_int, out_folder, positive_int, run_main
from hf_blockbatch.generation import engine, forward
from hf_blockbatch.generation.configs import FastDLLMConfig
from hf_blockbatch.generation.policies import lookahead

logger = logging.getLogger("step_anatomy")

#: part name -> the functions whose time (exclusive of the other parts) it is; in table order
PARTS: dict[str, tuple[tuple[Any, str], ...]] = {
    "model": ((forward.Forwards, "timed"),),
    "sampling": ((engine.Run, "_sample"),),
    "commit (rule, writes, EOS hits)": ((engine.Run, "commit"),),
    "block-step layout": ((engine.Run, "block_step"), (engine.Run, "step_rows")),
    "full-step layout": ((engine.Run, "full_step"), (engine.Run, "initial_step")),
    "policies (advance, ...)": ((engine.Run, "apply_policies"),),
    "stop and refresh": ((engine.Run, "settle"),),
    "lookahead: draft": ((lookahead.Lookahead, "draft"),),
    "lookahead: apply": ((lookahead.Lookahead, "apply"),),
    "lookahead: draft K/V records": ((forward.Forwards, "_draft_records"), (forward.Forwards, "_mark_dirty")),
    "cache row copies": ((cache_mod.BranchCache, "copy_positions"), (cache_mod.BranchCache, "copy_rows")),
    "set-up": ((engine.Run, "__init__"),),
}
DECODERS: dict[str, Callable[[int, int], Any]] = {
    "tuned": lambda gen, block: FastDLLMConfig(max_new_tokens=gen, block_length=block, early_stop=True),
    "sparse r6": lambda gen, block: FastDLLMConfig(max_new_tokens=gen, block_length=block, early_stop=True,
                                                   window_queries="sparse", requery_radius=6),
    "drafted()": lambda gen, block: FastDLLMConfig.drafted(max_new_tokens=gen, block_length=block),
    "drafted(exact=False)": lambda gen, block: FastDLLMConfig.drafted(exact=False, max_new_tokens=gen, block_length=block),
}  # fmt: skip


class Timers:
    """Exclusive wall time per part: a timed call's time less that of the timed calls it makes."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._stack: list[float] = []  # per open call, the time its timed callees took

    def wrap(self, part: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                inner = self._stack.pop()
                self.seconds[part] += spent - inner
                self.calls[part] += 1
                if self._stack:
                    self._stack[-1] += spent

        return timed


def install(timers: Timers) -> Callable[[], None]:
    """Wrap every part's functions; returns the undo."""
    undo = []
    for part, targets in PARTS.items():
        for owner, name in targets:
            raw = owner.__dict__[name]
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            wrapped = timers.wrap(part, fn)
            setattr(owner, name, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
            undo.append((owner, name, raw))
    return lambda: [setattr(owner, name, raw) for owner, name, raw in undo]


def _batches(model, tokenizer, suite: str, limit: int, batch_size: int) -> tuple[list, list, int]:
    """The suite's first ``limit`` training items, their padded batches and the generation length."""
    task = load_task(suite)
    items = task.items("train", limit=limit)
    batches = [_encode(tokenizer, [task.prompt(it, tokenizer) for it in items[i : i + batch_size]], model.device)
               for i in range(0, len(items), batch_size)]  # fmt: skip
    return items, batches, task.default_gen_length


def measure(model, tokenizer, suite: str, limit: int, block: int, batch_size: int, rounds: int,
            decoders: list[str]) -> dict[str, Any]:  # fmt: skip
    items, batches, gen = _batches(model, tokenizer, suite, limit, batch_size)
    configs = {name: DECODERS[name](gen, block) for name in decoders}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in decoders}
    nfe: dict[str, int] = {}
    timers = Timers()
    undo = install(timers)
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for name, cfg in configs.items():
                timers.seconds.clear()
                timers.calls.clear()
                total, forwards = 0.0, 0
                for ids, mask in batches:
                    t0 = time.perf_counter()
                    out = model.generate(ids, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)
                    total += time.perf_counter() - t0
                    forwards += int(out.nfe.sum())
                if r == 0:
                    continue
                nfe[name] = forwards
                per_item = {part: 1e3 * timers.seconds[part] / len(items) for part in PARTS}
                per_item["rest"] = 1e3 * total / len(items) - sum(per_item.values())
                per_item["total"] = 1e3 * total / len(items)
                per_item["model calls"] = timers.calls["model"] / len(items)
                runs[name].append(per_item)
    finally:
        undo()
    table = {name: {k: statistics.median(run[k] for run in runs[name]) for k in runs[name][0]} for name in decoders}
    return {"suite": suite, "limit": len(items), "block": block, "batch_size": batch_size, "rounds": rounds,
            "gen_length": gen, "nfe_per_item": {n: nfe[n] / len(items) for n in decoders}, "ms_per_item": table}  # fmt: skip


def operators(model, tokenizer, suite: str, limit: int, block: int, batch_size: int, decoders: list[str],
              top: int) -> dict[str, dict[str, float]]:  # fmt: skip
    """Per decoder, the self CPU time of torch's operators in ms per item, over one round under ``torch.profiler``
    (after an untimed one): the ``top`` operators of any decoder, each for every decoder. Whether a decoder's
    extra model time is attention, gathers or the MLP, which the parts above cannot say: they time functions."""
    from torch.profiler import ProfilerActivity, profile

    items, batches, gen = _batches(model, tokenizer, suite, limit, batch_size)
    per: dict[str, dict[str, float]] = {}
    for name in decoders:
        cfg = DECODERS[name](gen, block)
        for ids, mask in batches:
            model.generate(ids, attention_mask=mask, generation_config=cfg)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for ids, mask in batches:
                model.generate(ids, attention_mask=mask, generation_config=cfg)
        per[name] = {e.key: e.self_cpu_time_total / 1e3 / len(items) for e in prof.key_averages()}
    keep = sorted({op for ops in per.values() for op in sorted(ops, key=ops.get, reverse=True)[:top]},
                  key=lambda op: -max(ops.get(op, 0.0) for ops in per.values()))  # fmt: skip
    return {name: {op: per[name].get(op, 0.0) for op in keep} for name in decoders}


def markdown(model: str, result: dict[str, Any]) -> str:
    names = list(result["ms_per_item"])
    t = result["ms_per_item"]
    lines = [f"# Step anatomy: {model}, {result['suite']}, {result['limit']} training items, block {result['block']}, "
             f"batch {result['batch_size']}, median of {result['rounds']} rounds", "",
             "Milliseconds per item, each part exclusive of the others (`benchmarks/step_anatomy.py`).", "",
             "| part | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]  # fmt: skip
    for part in [*PARTS, "rest"]:
        lines.append(f"| {part} | " + " | ".join(f"{t[n][part]:.2f}" for n in names) + " |")
    lines.append("| **total** | " + " | ".join(f"**{t[n]['total']:.2f}**" for n in names) + " |")
    lines.append("| outside the model | " + " | ".join(f"{t[n]['total'] - t[n]['model']:.2f}" for n in names) + " |")
    lines.append("| × the first decoder's total | " + " | ".join(f"{t[n]['total'] / t[names[0]]['total']:.3f}" for n in names) + " |")
    lines.append("| NFE per item | " + " | ".join(f"{result['nfe_per_item'][n]:.2f}" for n in names) + " |")
    lines.append("| model ms per forward | " + " | ".join(f"{t[n]['model'] / t[n]['model calls']:.2f}" for n in names) + " |")
    if "operators" in result:
        ops = result["operators"]
        lines += ["", "Operators: self CPU ms per item over one round under `torch.profiler` (which adds its own cost), "
                  "the whole decode.", "", "| operator | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]  # fmt: skip
        lines += [f"| `{op}` | " + " | ".join(f"{ops[n][op]:.2f}" for n in names) + " |" for op in ops[names[0]]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--suite", default="code")
    p.add_argument("--limit", type=positive_int, default=64, help="training items")
    p.add_argument("--block", type=positive_int, default=64, help="the block length of every decoder (the tuned block)")
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=1)
    # a metavar: argparse's usage line drops the parentheses of choices such as drafted(), naming a spelling it refuses
    p.add_argument("--decoders", nargs="+", default=["tuned", "sparse r6", "drafted(exact=False)"], choices=list(DECODERS),
                   metavar="DECODER", help="of " + ", ".join(f"'{name}'" for name in DECODERS) + " (quote them in a shell)")
    p.add_argument("--out", type=out_folder, default=str(Path(__file__).parent / "results" / "step_anatomy"))
    p.add_argument("--tag", default="")
    p.add_argument("--ops", type=nonnegative_int, default=0, metavar="N",
                   help="also one round under torch.profiler: the N costliest operators of each decoder, for every decoder")
    args = p.parse_args(argv)
    try:  # a misspelt suite is said before the model loads
        load_task(args.suite)
    except ValueError as err:
        p.error(str(err))
    model, tokenizer = load_for_benchmark(args.model, args.threads)
    result = measure(model, tokenizer, args.suite, args.limit, args.block, args.batch_size, args.rounds, args.decoders)
    if args.ops > 0:
        result["operators"] = operators(model, tokenizer, args.suite, args.limit, args.block, args.batch_size,
                                        args.decoders, args.ops)  # fmt: skip
    result["model"] = args.model
    # the checkpoint's name, not its path: a --model folder would put the report beside the checkpoint, not under --out
    stem = Path(args.out) / f"{Path(args.model).name}_{args.suite}_b{args.batch_size}_{args.limit}{args.tag}"
    write_report(stem, result, markdown(args.model, result))
    print(markdown(args.model, result))


if __name__ == "__main__":
    raise SystemExit(run_main(main))
