"""Where a lower threshold is safe: the shipped drafts with ``many_masks_threshold`` τ_m above ``many_masks`` M masks.

Why (RESULTS §48): lowering Fast-dLLM's threshold everywhere saves forwards and loses accuracy (RESULTS §33, index
row 81: τ 0.85 in the drafted preset costs tiny-llada code and arith 0.8-1.5 points). A probe that lowered it only
in some steps found the loss is in the late ones, among a window's last masks, and none in the steps that still
have many masks left. This grid measures that rule as the library ships it (``FastDLLMConfig(many_masks_threshold=τ_m,
many_masks=M)``, ``rules/threshold.py``) on top of ``drafted(exact=False)`` at each suite's tuned block, on items
drawn from the suites' training generators (never a test question; the test splits are where the chosen point is
reported, by the bench): accuracy, mean NFE and query tokens, each against the tuned Fast-dLLM and the preset
without the option, with the paired accuracy difference.

    PYTHONPATH=$PWD python benchmarks/many_masks_grid.py --model tiny-llada --cells arith:96 code:96 lists:64 \
        --limit 1000 --thresholds 0.85 0.8 0.7 --masks 8 16 32

Writes ``benchmarks/results/many_masks/<model>_<limit>.json`` and ``.md`` (``--out``: another folder).
"""

from __future__ import annotations

import argparse
import logging
import statistics
from pathlib import Path
from typing import Any

from beyond_paper import _FD, decode, summarise

from hf_blockbatch.eval.runner import load_for_benchmark, load_task, write_report
from hf_blockbatch.eval.stats import paired_difference
from hf_blockbatch.generation.configs import DRAFTED_CONTAINED

logger = logging.getLogger("many_masks_grid")

OUT = Path(__file__).resolve().parent / "results" / "many_masks"


def preset(block: int, threshold: float | None = None, masks: int | None = None) -> dict[str, Any]:
    """``drafted(exact=False)`` at ``block`` as a bench config, as §48 measured it (without §49's runner-up drafts),
    with ``many_masks_threshold`` and ``many_masks`` set (or without the option, as shipped before §48, when
    ``threshold`` is None)."""
    cfg = {k: v for k, v in DRAFTED_CONTAINED.items()
           if k not in ("many_masks_threshold", "many_masks", "lookahead_runner_up")}  # fmt: skip
    cfg = {**_FD, **cfg, "block_length": block}
    if threshold is not None:
        cfg.update(many_masks_threshold=threshold, many_masks=masks)
    return cfg


def _paired(a: list[dict], b: list[dict]) -> dict[str, Any] | None:
    return paired_difference({r["index"]: r["correct"] for r in a}, {r["index"]: r["correct"] for r in b})


def grid(model: Any, tokenizer: Any, cells: list[tuple[str, int]], limit: int, thresholds: list[float],
         masks: list[int], batch_size: int) -> dict[str, Any]:  # fmt: skip
    """Every cell's tuned baseline, the preset without the option and each (τ_m, M) point: summaries and paired
    accuracy differences against the first two."""
    out: dict[str, Any] = {}
    for suite, block in cells:
        task = load_task(suite)
        items = task.items("train", limit=limit)
        prompts = [task.prompt(it, tokenizer) for it in items]
        gen = int(task.default_gen_length)
        configs = {"tuned": {**_FD, "block_length": block}, "preset": preset(block)}
        configs.update({f"{t}@{m}": preset(block, t, m) for t in thresholds for m in masks})
        runs, rows = {}, {}
        for name, cfg in configs.items():
            runs[name] = decode(model, tokenizer, suite, items, prompts, gen, cfg, batch_size)["items"]
            s = summarise({"items": runs[name], "seconds": 0.0})
            logger.info("%s b%d %s: acc %.1f nfe %.3f qt %.1f", suite, block, name, s["acc"], s["nfe"], s["qt"])
            rows[name] = {"accuracy": s["acc"], "nfe": s["nfe"], "query_tokens": s["qt"]}
        for name, items_ in runs.items():  # paired against the first two, once all have run
            rows[name].update(vs_tuned=_paired(items_, runs["tuned"]), vs_preset=_paired(items_, runs["preset"]))
        out[f"{suite}:{block}"] = {"configs": configs, "rows": rows}
    return out


def markdown(model: str, limit: int, res: dict[str, Any]) -> str:
    lines = [f"# `many_masks_threshold` on {model}'s training items ({limit} per suite)", "",
             "Accuracy Δ in points against the tuned Fast-dLLM (paired 95 % interval) and against the preset without "
             "the option; NFE and query tokens × the tuned Fast-dLLM's.", ""]  # fmt: skip
    for cell, r in res.items():
        tuned = r["rows"]["tuned"]
        lines += [f"## {cell}", "", "| point | accuracy | Δ tuned [95 %] | Δ preset | NFE × | query tokens × |",
                  "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for name, row in r["rows"].items():
            vt, vp = row["vs_tuned"], row["vs_preset"]
            lo, hi = vt["ci95"]
            lines.append(f"| {name} | {row['accuracy']:.1f} | {100 * vt['difference']:+.1f} [{100 * lo:+.1f}, "
                         f"{100 * hi:+.1f}] | {100 * vp['difference']:+.1f} | {row['nfe'] / tuned['nfe']:.3f} | "
                         f"{row['query_tokens'] / tuned['query_tokens']:.3f} |")  # fmt: skip
        lines.append("")
    worst = {name: min(100 * r["rows"][name]["vs_tuned"]["difference"] for r in res.values())
             for name in next(iter(res.values()))["rows"]}  # fmt: skip
    nfe = {name: statistics.fmean(r["rows"][name]["nfe"] / r["rows"]["tuned"]["nfe"] for r in res.values())
           for name in worst}  # fmt: skip
    lines += ["## Over the cells", "", "| point | worst Δ tuned (points) | mean NFE × |", "|---|---:|---:|"]
    lines += [f"| {name} | {worst[name]:+.1f} | {nfe[name]:.3f} |" for name in worst]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--cells", nargs="+", default=["arith:96", "code:96", "lists:64"],
                   help="suite:block, the block each suite's tuned Fast-dLLM uses (RESULTS §35)")
    p.add_argument("--limit", type=int, default=1000, help="training items per suite")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.85, 0.8, 0.7])
    p.add_argument("--masks", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(OUT), help="folder of the report")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model, tokenizer = load_for_benchmark(args.model, args.threads)
    cells = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cells]
    res = grid(model, tokenizer, cells, args.limit, args.thresholds, args.masks, args.batch_size)
    name = Path(args.model).name
    print(write_report(Path(args.out) / f"{name}_{args.limit}", {"model": args.model, "limit": args.limit, "cells": res},
                       markdown(name, args.limit, res)))  # fmt: skip


if __name__ == "__main__":
    main()
