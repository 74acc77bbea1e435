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
import statistics
from pathlib import Path
from typing import Any

from beyond_paper import _FD, option_grid, option_grid_main, option_markdown

from hf_blockbatch.eval.script_args import nonnegative_int, probability, run_main
from hf_blockbatch.generation.configs import DRAFTED_CONTAINED

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


def grid(model: Any, tokenizer: Any, cells: list[tuple[str, int]], limit: int, thresholds: list[float],
         masks: list[int], batch_size: int) -> dict[str, Any]:  # fmt: skip
    """Every cell's tuned baseline, the preset without the option and each (τ_m, M) point: summaries and paired
    accuracy differences against the first two."""

    def configs(block: int) -> dict[str, dict[str, Any]]:
        out = {"tuned": {**_FD, "block_length": block}, "preset": preset(block)}
        out.update({f"{t}@{m}": preset(block, t, m) for t in thresholds for m in masks})
        return out

    return option_grid(model, tokenizer, cells, limit, batch_size, configs, lambda name: "preset")


def markdown(model: str, limit: int, res: dict[str, Any]) -> str:
    lines = option_markdown(res, f"`many_masks_threshold` on {model}'s training items ({limit} per suite)",
                            "Accuracy Δ in points against the tuned Fast-dLLM (paired 95 % interval) and against the "
                            "preset without the option; NFE and query tokens × the tuned Fast-dLLM's.")  # fmt: skip
    worst = {name: min(100 * r["rows"][name]["vs_tuned"]["difference"] for r in res.values())
             for name in next(iter(res.values()))["rows"]}  # fmt: skip
    nfe = {name: statistics.fmean(r["rows"][name]["nfe"] / r["rows"]["tuned"]["nfe"] for r in res.values())
           for name in worst}  # fmt: skip
    lines += ["## Over the cells", "", "| point | worst Δ tuned (points) | mean NFE × |", "|---|---:|---:|"]
    lines += [f"| {name} | {worst[name]:+.1f} | {nfe[name]:.3f} |" for name in worst]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    def thresholds(p: argparse.ArgumentParser) -> None:
        p.add_argument("--thresholds", type=probability, nargs="+", default=[0.85, 0.8, 0.7])
        p.add_argument("--masks", type=nonnegative_int, nargs="+", default=[8, 16, 32])

    option_grid_main(argv, __doc__, OUT, thresholds,
                     lambda model, tok, cells, a: grid(model, tok, cells, a.limit, a.thresholds, a.masks, a.batch_size),
                     markdown)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(run_main(main))
