"""Sliding windows instead of fixed blocks, in an uncached loop (RESULTS §35).

Fast-dLLM decodes in fixed blocks: the window is the block holding the first mask, and a block's last uncertain
masks hold back every position of the next block, however easy. Dynamic Sliding Block scheduling (DSB: Luo et al.
2026, arXiv 2602.05992) lets the window slide instead. Its two schedules, as its release defines them:

* ``sliding:B`` (DSB's *constant* schedule): the window is the ``B`` positions from the first mask on;
* ``masks:B`` (DSB's *greedy* schedule): the window runs from the first mask to the ``B``-th mask, so it always
  holds ``B`` masks however many tokens between them are decoded; ``masks:B:C`` caps it at ``C`` positions.

Commits are the library's threshold rule inside the window (``threshold_select``: every mask at ≥ τ, else the most
confident one). A sliding window is never complete while a mask is left, so the early stop is the answer's: an end
token with every position before it decoded. ``fixed:B`` is the probe's baseline loop (``commit_rules_probe.decode``,
which is ``FastDLLMConfig(cache="none", early_stop=True)``), so that every schedule is compared with the same
Fast-dLLM on the same items: the suites' training items by default, never their test splits.

Why uncached: which positions a step may commit decides the forwards, whatever K/V a cache would reuse, and a
schedule that needs more forwards here needs more with a cache too (DSB's cache re-queries a prefix window on top).

    PYTHONPATH=$PWD python benchmarks/window_schedule_probe.py --model tiny-llada --limit 100 \\
        --schedules fixed:64 fixed:32 sliding:64 sliding:96 masks:64 masks:48

A real checkpoint: ``--model <folder or repo> --device cuda --dtype bfloat16 --suites gsm8k --split test`` (the real
benchmarks ship their test split only). Writes ``benchmarks/results/window_schedules/<model>_<limit>[<tag>].json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from commit_rules_probe import (
    Rule,
    add_model_arguments,
    check_suites,
    load_from_arguments,
    score_runs,
    summarize,
    table_rows,
)
from commit_rules_probe import decode as fixed_decode

from hf_blockbatch.eval.runner import ALL_TASKS, write_report
from hf_blockbatch.eval.script_args import out_folder, positive_int, run_main
from hf_blockbatch.generation.rules.threshold import threshold_select
from hf_blockbatch.generation.sampling import sample_tokens

logger = logging.getLogger("window_schedule_probe")

MODES = ("fixed", "sliding", "masks")


@dataclass(frozen=True)
class Schedule:
    """One window schedule (see the module docstring); parsed from ``mode:block[:cap]``."""

    spec: str
    mode: str
    block: int
    cap: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Schedule:
        mode, _, rest = spec.partition(":")
        parts = rest.split(":") if rest else []
        if mode not in MODES or not 1 <= len(parts) <= (2 if mode == "masks" else 1) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"Schedule {spec!r}: write fixed:B, sliding:B or masks:B[:C] with positive integers, e.g. "
                             "fixed:64, sliding:64, masks:64:96.")  # fmt: skip
        return cls(spec, mode, int(parts[0]), int(parts[1]) if len(parts) == 2 else None)


def window(masked: torch.Tensor, schedule: Schedule) -> tuple[int, int]:
    """``[s, e)``: the window of a sliding schedule over a generated region whose masks are ``masked`` ``[G]`` (at
    least one), as offsets into it. ``sliding``: ``block`` positions from the first mask; ``masks``: from the first
    mask to the ``block``-th (every mask when fewer), at most ``cap`` positions."""
    G = masked.shape[0]
    at = masked.nonzero().squeeze(1)
    s = int(at[0])
    if schedule.mode == "sliding":
        return s, min(s + schedule.block, G)
    e = int(at[min(schedule.block, at.numel()) - 1]) + 1
    return s, e if schedule.cap is None else min(e, s + schedule.cap)


def decode(model, prompt: torch.Tensor, gen_length: int, schedule: Schedule, mask_id: int, end_ids: torch.Tensor,
           threshold: float = 0.9, steps: list | None = None) -> tuple[torch.Tensor, int, int]:  # fmt: skip
    """One request (``prompt`` ``[1, P]``, no padding) under ``schedule``: the canvas ``[1, P + gen_length]``, the
    forwards and the query tokens it took (``fixed``: the rule probe's loop). ``steps``, for a sliding schedule:
    appends ``(s, e, committed positions)`` per forward, positions counted from the generated region's start."""
    if schedule.mode == "fixed":
        return fixed_decode(model, prompt, gen_length, schedule.block, Rule.parse(f"threshold:{threshold}"), mask_id, end_ids)
    P = prompt.shape[1]
    L, sh = P + gen_length, model.logit_shift
    x = torch.full((1, L), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :P] = prompt
    nfe = 0
    while True:
        masked = x[0, P:] == mask_id
        s, e = window(masked, schedule)
        logits = model(x).logits[0]
        nfe += 1
        got = sample_tokens(logits[P + s - sh : P + e - sh], 0.0, "low_confidence", 1, mask_id=mask_id)
        take = threshold_select(got.confidence.masked_fill(~masked[s:e], float("-inf"))[None], threshold)[0]
        x[0, P + s : P + e] = torch.where(take, got.tokens, x[0, P + s : P + e])
        if steps is not None:
            steps.append((s, e, (s + take.nonzero().squeeze(1)).tolist()))
        gen = x[0, P:]
        left = gen == mask_id
        if not bool(left.any()):
            break
        is_end = torch.isin(gen, end_ids)
        if bool(is_end.any()) and not bool(left[: int(is_end.byte().argmax())].any()):  # the answer is complete
            break
    return x, nfe, nfe * L


def run_suite(model, tokenizer, suite: str, limit: int, schedules: list[Schedule], split: str = "train") -> dict:
    """Every schedule on the suite's first ``limit`` items of ``split``: per schedule, correct items, forwards,
    query tokens (keyed by spec, the first schedule first: :func:`commit_rules_probe.summarize`'s baseline)."""
    mask_id = model.config.mask_token_id
    runs = {sc.spec: (lambda ids, gen, end, sc=sc: decode(model, ids, gen, sc, mask_id, end)) for sc in schedules}
    return score_runs(model, tokenizer, suite, limit, split, runs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--suites", nargs="+", choices=ALL_TASKS, default=["arith", "code", "lists"], metavar="SUITE")
    p.add_argument("--limit", type=positive_int, default=100, help="items per suite")
    p.add_argument("--split", default="train", choices=("train", "test"))
    p.add_argument("--schedules", nargs="+", default=["fixed:64", "sliding:64", "masks:64"],
                   help="mode:block[:cap] each; the first is the baseline the others are compared with")
    p.add_argument("--out", type=out_folder, default="benchmarks/results/window_schedules")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    try:
        schedules = [Schedule.parse(s) for s in args.schedules]
    except ValueError as err:
        p.error(str(err))
    model, tokenizer = load_from_arguments(args)
    check_suites(model, tokenizer, args.suites, args.limit, args.split)
    result = {"model": args.model, "split": args.split, "limit": args.limit, "baseline": schedules[0].spec, "suites": {}}
    for suite in args.suites:
        rows = summarize(run_suite(model, tokenizer, suite, args.limit, schedules, args.split), schedules[0].spec)
        result["suites"][suite] = rows
        for spec, r in rows.items():
            logger.info("%s %s %s: %.1f %% · NFE %.2f (×%.3f) · +%d/−%d items", args.model, suite, spec, r["accuracy"],
                        r["nfe"], r["nfe_ratio"], r["won"], r["lost"])  # fmt: skip
    suites = list(result["suites"])
    base = schedules[0].spec
    lines = [f"# Window schedules in an uncached loop: {args.model}, {args.limit} {args.split} items per suite", "",
             f"Δ accuracy in points · NFE × · items won/lost, against `{base}` on the same items (threshold 0.9).", "",
             "| schedule | " + " | ".join(suites) + " |", "|---|" + "---|" * len(suites)]  # fmt: skip
    lines += table_rows(result["suites"], base, [schedule.spec for schedule in schedules[1:]],
                        lambda c: f"{c['delta_points']:+.1f} · {c['nfe_ratio']:.3f} · +{c['won']}/−{c['lost']}")  # fmt: skip
    write_report(Path(args.out) / f"{args.model.replace('/', '_')}_{args.limit}{args.tag}", result, "\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(run_main(main))
