"""Runner-up drafts (``lookahead_runner_up``) in both drafted presets, on the suites' training items.

Why (RESULTS §49): with three drafts, the chained ``(0, 1)`` draft needs three masks, so once a window has two left its
row is parked, while the step it could stand for is often a single commit of a token the drafts do not hold: the
runner-up of a mask (code: ``return x + 3`` against ``return 3 + x``). The option drafts that token in the spare row.
This grid decodes each cell's tuned Fast-dLLM and both presets (``drafted()``, exact: the tokens are sparse
Fast-dLLM's with or without the option; ``drafted(exact=False)``) without and with the option, on items drawn from the
suites' training generators (never a test question): accuracy, mean NFE and query tokens against the tuned
Fast-dLLM, the paired accuracy difference against it and against the same preset without the option, and the share
of answers the option left unchanged.

    PYTHONPATH=$PWD python benchmarks/runner_up_grid.py --model tiny-llada --cells arith:96 code:96 lists:64 --limit 1000

Writes ``benchmarks/results/runner_up/<model>_<limit>.json`` and ``.md`` (``--out``: another folder).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from beyond_paper import _FD, decode, summarise
from many_masks_grid import _paired

from hf_blockbatch.eval.runner import load_for_benchmark, load_task, write_report
from hf_blockbatch.generation.configs import DRAFTED, DRAFTED_CONTAINED

logger = logging.getLogger("runner_up_grid")

OUT = Path(__file__).resolve().parent / "results" / "runner_up"
#: the presets the option is measured in, by the names of the table's rows
PRESETS = {"drafted()": DRAFTED, "drafted(exact=False)": DRAFTED_CONTAINED}


def configs(block: int) -> dict[str, dict[str, Any]]:
    """The cell's decoders as bench configs: the tuned Fast-dLLM, then each preset without and with the option."""
    out = {"tuned": {**_FD, "block_length": block}}
    for name, preset in PRESETS.items():
        for on in (False, True):
            out[f"{name}{' + runner-up' if on else ''}"] = {**_FD, **preset, "block_length": block,
                                                            "lookahead_runner_up": on}  # fmt: skip
    return out


def grid(model: Any, tokenizer: Any, cells: list[tuple[str, int]], limit: int, batch_size: int) -> dict[str, Any]:
    """Every cell's decoders: summaries, paired accuracy differences against the tuned Fast-dLLM and against the same
    preset without the option, and the share of answers equal to that preset's."""
    out: dict[str, Any] = {}
    for suite, block in cells:
        task = load_task(suite)
        items = task.items("train", limit=limit)
        prompts = [task.prompt(it, tokenizer) for it in items]
        gen = int(task.default_gen_length)
        cfgs = configs(block)
        runs, rows = {}, {}
        for name, cfg in cfgs.items():
            runs[name] = decode(model, tokenizer, suite, items, prompts, gen, cfg, batch_size)["items"]
            s = summarise({"items": runs[name], "seconds": 0.0})
            logger.info("%s b%d %s: acc %.1f nfe %.3f qt %.1f", suite, block, name, s["acc"], s["nfe"], s["qt"])
            rows[name] = {"accuracy": s["acc"], "nfe": s["nfe"], "query_tokens": s["qt"]}
        for name in rows:
            base = name.removesuffix(" + runner-up")
            rows[name]["vs_tuned"] = _paired(runs[name], runs["tuned"])
            rows[name]["vs_preset"] = _paired(runs[name], runs[base])
            rows[name]["same_answers"] = sum(a["text"] == b["text"] for a, b in zip(runs[name], runs[base])) / len(items)
        out[f"{suite}:{block}"] = {"configs": cfgs, "rows": rows}
    return out


def markdown(model: str, limit: int, res: dict[str, Any]) -> str:
    lines = [f"# Runner-up drafts on {model}'s training items ({limit} per suite)", "",
             "Accuracy Δ in points against the tuned Fast-dLLM (paired 95 % interval) and against the same preset without "
             "the option; NFE and query tokens × the tuned Fast-dLLM's; answers equal to that preset's.", ""]  # fmt: skip
    for cell, r in res.items():
        tuned = r["rows"]["tuned"]
        lines += [f"## {cell}", "", "| decoder | accuracy | Δ tuned [95 %] | Δ preset | NFE × | query tokens × | same answers |",
                  "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for name, row in r["rows"].items():
            vt, vp = row["vs_tuned"], row["vs_preset"]
            lo, hi = vt["ci95"]
            lines.append(f"| {name} | {row['accuracy']:.1f} | {100 * vt['difference']:+.1f} [{100 * lo:+.1f}, "
                         f"{100 * hi:+.1f}] | {100 * vp['difference']:+.1f} | {row['nfe'] / tuned['nfe']:.3f} | "
                         f"{row['query_tokens'] / tuned['query_tokens']:.3f} | {100 * row['same_answers']:.1f} % |")  # fmt: skip
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--cells", nargs="+", default=["arith:96", "code:96", "lists:64"],
                   help="suite:block, the block each suite's tuned Fast-dLLM uses (RESULTS §35)")
    p.add_argument("--limit", type=int, default=1000, help="training items per suite")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(OUT), help="folder of the report")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model, tokenizer = load_for_benchmark(args.model, args.threads)
    cells = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cells]
    res = grid(model, tokenizer, cells, args.limit, args.batch_size)
    name = Path(args.model).name
    print(write_report(Path(args.out) / f"{name}_{args.limit}", {"model": args.model, "limit": args.limit, "cells": res},
                       markdown(name, args.limit, res)))  # fmt: skip


if __name__ == "__main__":
    main()
