"""Which lookahead drafts get adopted: the evidence behind the order of ``DRAFT_SHAPES``.

Decodes training items (never a test question) with Fast-dLLM (dual, τ 0.9, early stop) and every
draft shape at once (``lookahead=len(DRAFT_SHAPES)``), with the trace on. Each adoption is a
``SyncEvent`` of the main row to the draft branch it took (the last of a chain), so counting those
events by branch says how often each shape was the exact next state, and the NFE saved says what
all of them buy together. The first shapes of ``DRAFT_SHAPES`` are the ones a smaller ``lookahead``
keeps, so they should be the ones adopted most. Adoption does not depend on the other drafts (each
is compared with the main row's own next canvas), except that a chain ends on its last draft.

    PYTHONPATH=$PWD python benchmarks/lookahead_shapes.py --model tiny-llada --limit 200

Writes ``benchmarks/results/lookahead/shapes_<model>_<limit>.json`` and ``.md``.
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
from hf_blockbatch.eval.script_args import out_folder, positive_int, run_main
from hf_blockbatch.generation.configs import FastDLLMConfig
from hf_blockbatch.generation.policies.lookahead import DRAFT_SHAPES
from hf_blockbatch.generation.trace import SyncEvent
from hf_blockbatch.tasks import SUITES

logger = logging.getLogger("lookahead_shapes")


def count(model, tokenizer, suite: str, limit: int, block: int, batch_size: int) -> dict:
    task = load_task(suite)
    items = task.items("train", limit=limit)
    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = [task.prompt(it, tokenizer, chat=chat) for it in items]
    cfg = FastDLLMConfig(max_new_tokens=int(task.default_gen_length), block_length=block, early_stop=True,
                         lookahead=len(DRAFT_SHAPES), output_trace=True)  # fmt: skip
    by_branch: Counter[int] = Counter()
    nfe = adopted = 0
    for b0 in tqdm(range(0, len(prompts), batch_size), desc=suite, leave=False):
        ids, mask = _encode(tokenizer, prompts[b0 : b0 + batch_size], torch.device("cpu"))
        with torch.inference_mode():
            out = model.generate(ids, mask, generation_config=cfg, return_dict_in_generate=True)
        for st in out.stats:
            by_branch.update(ev.leader for ev in st["trace"] if isinstance(ev, SyncEvent))
            adopted += st["lookahead_adopted"]
        nfe += int(out.nfe.sum())
    events = sum(by_branch.values())
    return {"items": len(prompts), "nfe_mean": nfe / len(prompts), "nfe_without_drafts_mean": (nfe + adopted) / len(prompts),
            "adopting_steps": events,
            "by_shape": {str(DRAFT_SHAPES[b - 1]): by_branch[b] for b in range(1, len(DRAFT_SHAPES) + 1)}}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--suites", nargs="+", choices=SUITES, default=["arith", "code", "lists"], metavar="SUITE")
    p.add_argument("--limit", type=positive_int, default=200, help="training items per suite")
    p.add_argument("--block", type=positive_int, default=64)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", type=out_folder, default="benchmarks/results/lookahead")
    args = p.parse_args(argv)
    model, tokenizer = load_for_benchmark(args.model, args.threads)
    result = {"model": args.model, "limit": args.limit, "block": args.block, "suites": {}}
    for suite in args.suites:
        result["suites"][suite] = count(model, tokenizer, suite, args.limit, args.block, args.batch_size)
        logger.info("%s %s", suite, json.dumps(result["suites"][suite]))
    lines = [f"# Adopted lookahead drafts by shape: {args.model}, {args.limit} training items, block {args.block}", "",
             "Fast-dLLM dual, τ 0.9, early stop, every shape drafted at once; an adopting step is counted under the "
             "last draft of its chain.", "",
             "| suite | NFE without drafts | NFE | adopting steps | " + " | ".join(f"`{s}`" for s in DRAFT_SHAPES) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(DRAFT_SHAPES)]  # fmt: skip
    for suite, r in result["suites"].items():
        lines.append(f"| {suite} | {r['nfe_without_drafts_mean']:.2f} | {r['nfe_mean']:.2f} | {r['adopting_steps']} | "
                     + " | ".join(str(v) for v in r["by_shape"].values()) + " |")  # fmt: skip
    write_report(Path(args.out) / f"shapes_{Path(args.model).name}_{args.limit}", result, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(run_main(main))
