"""Where the drafted preset's block steps go: which steps a draft stood in for, and why the others had none.

A block step of ``FastDLLMConfig.drafted(exact=False)`` (as §41 measured it: without §49's runner-up drafts, whose
spare rows draft a token their shape does not name) either adopts a draft (the next block step is then
skipped), or it does not, and then the request pays for the next step. This script decodes training items (never a
test question) at each suite's block picked on training items (``results/targets/heldout_blocks.json``) and sorts
every (request, block step) into one class, from what the main row held before the step, the probability map its
drafts were built from (the previous forward's), and what the step committed:

* ``adopted``: the main row took a draft's state (``adopted_2``: two chained drafts, two steps skipped);
* ``completes``: the step committed every mask left in the window. It is the window's last step, so there is no next
  step for a draft to stand for (nothing to save: an end, or a refresh);
* ``parked``: no draft rode (a closed gate or the query budget) and the window kept a mask;
* ``one_r<k>_<token>``: drafts rode, none was adopted, the step committed one token: at the mask the previous
  forward ranked ``k``-th by confidence (``3`` for 3 or more), with that forward's top token (``top1``), its
  runner-up (``top2``) or another (``other``). The drafts hold ranks 0 and 1 with their top tokens: ``one_r0_top1``
  and ``one_r1_top1`` are adopted unless a draft was parked;
* ``several``: drafts rode, none was adopted, the step committed several tokens.

The counts per class sum to the block steps the requests ran (``nfe_block``), and the adopted levels to
``lookahead_adopted``: the script checks both, and that the instrumented decode (the probability map kept at its top
two tokens instead of one) decodes what the plain one does. RESULTS §37 and §41 read the classes.

It also counts the slots each block step proposes at (the positions whose logits it reads), in main rows and in
draft rows, and among the latter those of drafts on an adopted chain (the adopted draft and the drafts it extends).
A draft's proposals matter only when it is adopted: the rest is what proposing the main rows first, and then only
the drafts still in question, would skip at most (RESULTS §45). The count checks itself: the main rows that proposed
are the block steps, and each draft row reads its main row's slots less the ones it drafted.

    PYTHONPATH=$PWD python benchmarks/draft_misses.py --model tiny-dream --limit 500

Writes ``benchmarks/results/lookahead/misses_<model>_<limit>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

import hf_blockbatch.generation.mixin as mixin
from hf_blockbatch.eval.runner import _encode, load_for_benchmark, load_task, write_report
from hf_blockbatch.eval.script_args import out_folder, positive_int, run_main
from hf_blockbatch.generation.configs import FastDLLMConfig
from hf_blockbatch.generation.engine import Run
from hf_blockbatch.generation.policies.lookahead import DRAFT_SHAPES, Lookahead
from hf_blockbatch.generation.state import DecodeState
from hf_blockbatch.tasks import SUITES

logger = logging.getLogger("draft_misses")

HELDOUT = Path(__file__).parent / "results" / "targets" / "heldout_blocks.json"
#: the classes in the order the report lists them
CLASSES = ("adopted_1", "adopted_2", "completes", "parked", *(f"one_r{k}_{t}" for k in range(4) for t in ("top1", "top2", "other")),
           "several")  # fmt: skip


def classify(before: torch.Tensor, after: torch.Tensor, mask_id: int, gen_start: int, win: tuple[int, int],
             prob: torch.Tensor, ids: torch.Tensor, rode: bool, adopted: int) -> str:  # fmt: skip
    """One request's block step: ``before``/``after`` its main row's canvas around the step's commit (before any
    adoption), ``prob``/``ids`` ``[G, 2]`` the top-2 map its drafts were built from, ``win`` its window."""
    if adopted:
        return f"adopted_{min(adopted, 2)}"
    in_win = torch.zeros_like(before, dtype=torch.bool)
    in_win[win[0] : win[1]] = True
    open_ = (before == mask_id) & in_win
    taken = open_ & (after != mask_id)
    if not bool((open_ & ~taken).any()):
        return "completes"
    if not rode:
        return "parked"
    if int(taken.sum()) > 1:
        return "several"
    p = int(taken.nonzero()[0, 0])
    positions = open_.nonzero().squeeze(1)
    conf = prob[positions - gen_start, 0]
    order = positions[conf.argsort(descending=True, stable=True)]  # the drafts' ranking (ties: the leftmost first)
    rank = min(int((order == p).nonzero()[0, 0]), 3)
    token = int(after[p])
    top = ids[p - gen_start].tolist()
    kind = "top1" if token == top[0] else "top2" if token == top[1] else "other"
    return f"one_r{rank}_{kind}"


def chain_rows(sources: list[int], parent: list[int], branches: int) -> set[int]:
    """The state rows of the drafts on adopted chains: each adopted draft's row (``sources``) and, through
    ``parent`` (each row's parent branch, ``-1`` or ``0``: none), the draft rows it extends."""
    rows: set[int] = set()
    for row in sources:
        while row % branches:  # a draft row (branch 0 is the main row)
            rows.add(row)
            row = row - row % branches + max(parent[row], 0)  # the parent's row, or the main row
    return rows


@contextlib.contextmanager
def instrumented(counts: Counter[str], slots: Counter[str] | None = None) -> Iterator[None]:
    """Count every request's block steps into ``counts`` while decoding; the map kept at two tokens per position.
    ``slots``: also the block steps' proposed slots, in main rows (``main``), in draft rows (``draft``) and in draft
    rows on an adopted chain (``draft_adopted``), and the rows that proposed (``main_rows``, ``draft_rows``: a main
    row proposes in every block step of its request); ``draft_expected``, what the draft rows read if each reads its
    main row's masks less the ones it drafted (:func:`count` checks both)."""
    plan_from_config, draft, apply = mixin.plan_from_config, Lookahead.draft, Lookahead.apply
    commit, copy_rows = Run.commit, DecodeState.copy_rows
    seen: dict[str, torch.Tensor] = {}
    step: dict[str, list] = {}

    def commit_and_count(self: Run, span, packed, phase: str, *args, **kwargs) -> bool:
        if phase == "block" and slots is not None:
            read = span.read
            n = torch.full_like(span.rows, span.positions.shape[1]) if read is None else read.sum(-1)
            step.update(rows=span.rows.tolist(), n=n.tolist(), branch=self.state.branch[span.rows].tolist(), sources=[])
        return commit(self, span, packed, phase, *args, **kwargs)

    def copy_rows_and_see(self: DecodeState, src: torch.Tensor, dst: torch.Tensor, names: tuple[str, ...]) -> None:
        if "sources" in step:  # inside Lookahead.apply: an adoption (the only caller there)
            step["sources"] += src.tolist()
        copy_rows(self, src, dst, names)

    def plan_top2(*args, **kwargs):
        plan = plan_from_config(*args, **kwargs)
        return dataclasses.replace(plan, map_k=2) if plan.lookahead is not None else plan

    def draft_and_look(self: Lookahead, run) -> bool:
        changed = draft(self, run)
        s = run.state
        seen.update(canvas=s.per_request(s.canvas)[:, 0].clone(), prob=s.per_request(s.prob_p)[:, 0].clone(),
                    ids=s.per_request(s.prob_ids)[:, 0].clone(), rode=(~s.per_request(s.pruned)[:, 1:]).any(-1),
                    done=s.per_request(s.done)[:, 0].clone(), adopted=s.per_request(s.adopted)[:, 0].clone(),
                    ws=s.per_request(s.win_start)[:, 0].clone(), we=s.per_request(s.win_end)[:, 0].clone())  # fmt: skip
        return changed

    def apply_and_count(self: Lookahead, ctx) -> bool:
        if ctx.full or not seen:
            return apply(self, ctx)
        s = ctx.state
        after = s.per_request(s.canvas)[:, 0].clone()
        parent = s.draft_parent.tolist()
        moved = apply(self, ctx)
        if step:
            on_chain = chain_rows(step["sources"], parent, s.branches)
            read = dict(zip(step["rows"], step["n"]))
            for row, n, branch in zip(step["rows"], step["n"], step["branch"]):
                slots["draft" if branch else "main"] += n
                slots["draft_rows" if branch else "main_rows"] += 1
                slots["draft_adopted"] += n if row in on_chain else 0
                if branch:  # a draft reads its main row's masks but those it drafted
                    slots["draft_expected"] += read[row - branch] - len(DRAFT_SHAPES[branch - 1])
            step.clear()
        took = (s.per_request(s.adopted)[:, 0] - seen["adopted"]).tolist()
        for b in (~seen["done"]).nonzero().squeeze(1).tolist():
            counts[classify(seen["canvas"][b], after[b], s.mask_id, s.gen_start, (int(seen["ws"][b]), int(seen["we"][b])),
                            seen["prob"][b], seen["ids"][b], bool(seen["rode"][b]), took[b])] += 1  # fmt: skip
        seen.clear()
        return moved

    mixin.plan_from_config, Lookahead.draft, Lookahead.apply = plan_top2, draft_and_look, apply_and_count
    Run.commit, DecodeState.copy_rows = commit_and_count, copy_rows_and_see
    try:
        yield
    finally:
        mixin.plan_from_config, Lookahead.draft, Lookahead.apply = plan_from_config, draft, apply
        Run.commit, DecodeState.copy_rows = commit, copy_rows


def count(model, tokenizer, suite: str, limit: int, block: int, batch_size: int) -> dict:
    """Every block step of ``limit`` training items, by class; checked against the decode's own counters."""
    task = load_task(suite)
    items = task.items("train", limit=limit)
    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = [task.prompt(it, tokenizer, chat=chat) for it in items]
    cfg = FastDLLMConfig.drafted(exact=False, max_new_tokens=int(task.default_gen_length), block_length=block,
                                 lookahead_runner_up=False)  # fmt: skip
    counts: Counter[str] = Counter()
    slots: Counter[str] = Counter()
    nfe = block_steps = adopted = refreshes = 0
    for b0 in tqdm(range(0, len(prompts), batch_size), desc=suite, leave=False):
        ids, mask = _encode(tokenizer, prompts[b0 : b0 + batch_size], torch.device("cpu"))
        with torch.inference_mode():
            plain = model.generate(ids, mask, generation_config=cfg, return_dict_in_generate=True)
            with instrumented(counts, slots):
                out = model.generate(ids, mask, generation_config=cfg, return_dict_in_generate=True)
        if not (torch.equal(plain.sequences, out.sequences) and torch.equal(plain.nfe, out.nfe)):
            raise RuntimeError(f"{suite}: the instrumented decode differs from the plain one; its counts would not be this decode's")
        nfe += int(out.nfe.sum())
        refreshes += sum(st["nfe_refresh"] for st in out.stats)
        block_steps += sum(st["nfe_block"] for st in out.stats)
        adopted += sum(st["lookahead_adopted"] for st in out.stats)
    if slots["main_rows"] != block_steps or slots["draft"] != slots["draft_expected"]:
        raise RuntimeError(f"{suite}: {slots['main_rows']} main rows proposed in {block_steps} block steps; draft rows "
                           f"read {slots['draft']} slots for {slots['draft_expected']} (their main rows' less the drafted)")  # fmt: skip
    if sum(counts.values()) != block_steps or counts["adopted_1"] + 2 * counts["adopted_2"] != adopted:
        raise RuntimeError(f"{suite}: {sum(counts.values())} steps counted for {block_steps} block steps; "
                           f"adopted {counts['adopted_1']} + 2 x {counts['adopted_2']} for {adopted}")  # fmt: skip
    n = len(prompts)
    return {"items": n, "block": block, "nfe_mean": nfe / n, "block_steps_mean": block_steps / n,
            "nfe_without_drafts_mean": (nfe + adopted) / n, "refreshes_mean": refreshes / n,
            "per_item": {c: counts[c] / n for c in CLASSES},
            # the block steps' proposed slots, per item: in main rows, in draft rows, in drafts on an adopted chain
            "slots_per_item": {k: slots[k] / n for k in ("main", "draft", "draft_adopted", "main_rows", "draft_rows")}}  # fmt: skip


def heldout_block(model: str, suite: str) -> int:
    """The block picked on training items for a tiny checkpoint's suite (the scorecard's second table)."""
    picked = json.loads(HELDOUT.read_text(encoding="utf-8"))
    try:
        return int(picked[Path(model).name][suite]["block"])
    except KeyError:
        raise ValueError(f"No block picked on training items for {model} {suite} in {HELDOUT.name} "
                         f"(it has {', '.join(picked)}): pass --block.") from None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--suites", nargs="+", choices=SUITES, default=["arith", "code", "lists"], metavar="SUITE")
    p.add_argument("--limit", type=positive_int, default=200, help="training items per suite")
    p.add_argument("--block", type=positive_int, default=None, help="one block for every suite (default: each suite's block "
                   "picked on training items, results/targets/heldout_blocks.json)")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", type=out_folder, default="benchmarks/results/lookahead")
    args = p.parse_args(argv)
    # every suite's block before the model loads (a checkpoint without picked blocks is said first)
    blocks = {suite: args.block if args.block is not None else heldout_block(args.model, suite) for suite in args.suites}
    model, tokenizer = load_for_benchmark(args.model, args.threads)
    result = {"model": args.model, "limit": args.limit, "suites": {}}
    for suite, block in blocks.items():
        result["suites"][suite] = count(model, tokenizer, suite, args.limit, block, args.batch_size)
        logger.info("%s %s", suite, json.dumps(result["suites"][suite]))
    shown = [c for c in CLASSES if any(r["per_item"][c] for r in result["suites"].values())]
    lines = [f"# The drafted preset's block steps by class: {args.model}, {args.limit} training items", "",
             "`FastDLLMConfig.drafted(exact=False)`; block steps per item in each class (benchmarks/draft_misses.py "
             "says what each class is). NFE = 1 + block steps + refreshes; the adopted steps are the "
             "forwards saved (`adopted_2`: two each).", "",
             "| suite (block) | NFE | without drafts | " + " | ".join(f"`{c}`" for c in shown) + " |",
             "|---|---:|---:|" + "---:|" * len(shown)]  # fmt: skip
    for suite, r in result["suites"].items():
        lines.append(f"| {suite} ({r['block']}) | {r['nfe_mean']:.2f} | {r['nfe_without_drafts_mean']:.2f} | "
                     + " | ".join(f"{r['per_item'][c]:.3f}" for c in shown) + " |")  # fmt: skip
    lines += ["", "Slots the block steps propose at, per item, and the share of them in draft rows that no adoption used "
              "(what proposing only the drafts still in question would skip at most):", "",
              "| suite (block) | main rows | draft rows | on an adopted chain | draft rows on none, share of all |",
              "|---|---:|---:|---:|---:|"]  # fmt: skip
    for suite, r in result["suites"].items():
        sl = r["slots_per_item"]
        idle = (sl["draft"] - sl["draft_adopted"]) / max(sl["main"] + sl["draft"], 1e-9)
        lines.append(f"| {suite} ({r['block']}) | {sl['main']:.1f} | {sl['draft']:.1f} | {sl['draft_adopted']:.1f} | {idle:.2f} |")
    write_report(Path(args.out) / f"misses_{Path(args.model).name}_{args.limit}", result, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(run_main(main))
