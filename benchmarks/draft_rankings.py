"""Which ordering of the masks best predicts the next commit: the evidence behind the drafts' ranking (RESULTS §31).

A lookahead draft commits the masks its main row's latest forward rated most confident (``DRAFT_SHAPES`` ranks
them by confidence). About half of a draft's misses on code are position misses: the step commits a mask the draft
did not hold. Could another ordering of the same forward's masks guess the step's commit better? This decodes
training items (never a test question) with sparse Fast-dLLM (the drafts' own trajectory without drafts) and the
trace on, recomputes its initial forward (a full forward of the prompt and the all-mask canvas, what the dual
cache's first forward computes), and asks, for every position that block step 1 committed after an initial
forward that left masks, where five orderings of the masks left put it: by confidence, by the gap between the two
best tokens, by entropy (lowest first), leftmost first and rightmost first. It reports the share of those
positions each ordering ranks first or second, and how many of them step 1 committed with a token other than the
initial forward's best (what a draft of that position gets wrong even at the right place).

    PYTHONPATH=$PWD python benchmarks/draft_rankings.py --model tiny-llada --suites code --limit 200

Writes ``benchmarks/results/lookahead/rankings_<model>_<limit>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from hf_blockbatch.eval.runner import _encode, load_for_benchmark, load_task, write_report
from hf_blockbatch.eval.script_args import nonnegative_int, out_folder, positive_int, run_main
from hf_blockbatch.generation.configs import FastDLLMConfig
from hf_blockbatch.generation.trace import CommitEvent
from hf_blockbatch.tasks import SUITES

logger = logging.getLogger("draft_rankings")

ORDERINGS = ("confidence", "gap", "entropy", "leftmost", "rightmost")


def ranks(logits: torch.Tensor, left: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per ordering, the rank (0: first) of each position among ``left`` (bool ``[G]``) by the logits ``[G, V]``
    predicting them; positions not in ``left`` rank last."""
    logp = torch.log_softmax(logits.double(), -1)
    top2 = logp.topk(2, -1).values.exp()
    score = {
        "confidence": top2[:, 0],
        "gap": top2[:, 0] - top2[:, 1],
        "entropy": (logp.exp() * logp).sum(-1),  # minus the entropy: the lowest entropy scores highest
        "leftmost": -torch.arange(logits.shape[0], dtype=torch.float64),
        "rightmost": torch.arange(logits.shape[0], dtype=torch.float64),
    }
    out = {}
    for name, s in score.items():
        s = s.masked_fill(~left, float("-inf"))
        order = s.argsort(descending=True, stable=True)
        out[name] = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    return out


def count(model, tokenizer, suite: str, limit: int, block: int, radius: int, batch_size: int) -> dict:
    task = load_task(suite)
    items = task.items("train", limit=limit)
    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = [task.prompt(it, tokenizer, chat=chat) for it in items]
    gen = int(task.default_gen_length)
    cfg = FastDLLMConfig(max_new_tokens=gen, block_length=block, early_stop=True, window_queries="sparse",
                         requery_radius=radius, output_trace=True)  # fmt: skip
    mask_id, shift = model.config.mask_token_id, model.logit_shift
    top: Counter[str] = Counter()
    positions = other_token = requests = 0
    for b0 in tqdm(range(0, len(prompts), batch_size), desc=suite, leave=False):
        ids, mask = _encode(tokenizer, prompts[b0 : b0 + batch_size], torch.device("cpu"))
        with torch.inference_mode():
            out = model.generate(ids, mask, generation_config=cfg, return_dict_in_generate=True)
        for r, st in enumerate(out.stats):
            commits = [ev for ev in st["trace"] if isinstance(ev, CommitEvent) and ev.branch == 0]
            init = next(ev for ev in commits if ev.phase == "init")
            step1 = next((ev for ev in commits if ev.phase == "block"), None)
            start, end = init.window
            if step1 is None or step1.window != init.window:
                continue  # the initial forward completed its window: no block step followed it there
            left = torch.zeros(gen, dtype=torch.bool)
            left[start:end] = True
            left[init.committed] = False
            prompt = ids[r : r + 1][:, int((mask[r] == 0).sum()) :]  # the row without its left padding
            P = prompt.shape[1]
            canvas = torch.cat([prompt, torch.full((1, gen), mask_id, dtype=prompt.dtype)], 1)
            with torch.inference_mode():
                logits = model(canvas).logits[0, P - shift : P - shift + gen]  # the logits predicting each position
            rank = ranks(logits, left)
            best = logits.argmax(-1)
            requests += 1
            for pos, tok in zip(step1.committed, step1.tokens):
                positions += 1
                other_token += int(best[pos]) != tok
                top.update(name for name in ORDERINGS if int(rank[name][pos]) <= 1)
    return {"requests": requests, "positions": positions, "other_token": other_token,
            "first_or_second": {name: top[name] / max(positions, 1) for name in ORDERINGS}}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--suites", nargs="+", choices=SUITES, default=["code"], metavar="SUITE")
    p.add_argument("--limit", type=positive_int, default=200, help="training items per suite")
    p.add_argument("--block", type=positive_int, default=64)
    p.add_argument("--radius", type=nonnegative_int, default=6, help="sparse Fast-dLLM's re-query radius (the presets' 6)")
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", type=out_folder, default="benchmarks/results/lookahead")
    args = p.parse_args(argv)
    model, tokenizer = load_for_benchmark(args.model, args.threads)
    result = {"model": args.model, "limit": args.limit, "block": args.block, "radius": args.radius, "suites": {}}
    for suite in args.suites:
        result["suites"][suite] = count(model, tokenizer, suite, args.limit, args.block, args.radius, args.batch_size)
        logger.info("%s %s", suite, json.dumps(result["suites"][suite]))
    lines = [f"# Which ordering of the masks left predicts block step 1's commit: {args.model}, {args.limit} training "
             f"items, block {args.block}", "",
             f"Sparse Fast-dLLM (radius {args.radius}, early stop); share of the positions block step 1 committed that "
             "each ordering of the initial forward's masks left ranks first or second.", "",
             "| suite | requests | positions | " + " | ".join(ORDERINGS) + " | other token than the initial best |",
             "|---|---:|---:|" + "---:|" * len(ORDERINGS) + "---:|"]  # fmt: skip
    for suite, r in result["suites"].items():
        lines.append(f"| {suite} | {r['requests']} | {r['positions']} | "
                     + " | ".join(f"{r['first_or_second'][o]:.2f}" for o in ORDERINGS) + f" | {r['other_token']} |")  # fmt: skip
    write_report(Path(args.out) / f"rankings_{Path(args.model).name}_{args.limit}", result, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(run_main(main))
