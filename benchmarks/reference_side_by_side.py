"""Side by side: the authors' bulk BlockBatch decoder vs our plain restatement of it.

The authors' code (github Laurence-Wu/BlockBatch) is never part of this repository: this script
imports it at run time from the checkout the user points to (``--reference-repo``, the folder
holding ``llada/`` and ``dream/``), in a *separate Python* whose environment runs it
(``--reference-python``: transformers 4.49 and a ``flash_attn`` module). Our package needs transformers 5,
so the two halves run in two processes: this one builds the prompts as our bench does (``get_suite(name)``,
``task.prompt(item, tokenizer, chat=True)``, tokenised without special tokens), asks the worker
(this same file, ``--worker``, which imports nothing of ours) to decode them with the authors'
``generate_block_batching``, decodes them with ``tests/_reference_blockbatch.py``, and compares
the winner canvases token for token and the authors' NFE count.

Float32: the authors' packed attention casts Q/K/V to bfloat16. By default (``--no-float32`` keeps their
casts) the worker loads their module source, replaces exactly those three casts by float32 in memory (it
checks that each occurs once) and executes it; nothing is written into their checkout. The
winner rule's bfloat16 EOS softmax is left as it is (the restatement reproduces it) unless
``--eos-softmax float32``, which edits it too and tells the restatement to match. Their layer
profiler (CUDA events) is switched off (``_PROFILE_LAYERS = False``).

Usage (in our venv)::

    python benchmarks/reference_side_by_side.py --reference-repo /tmp/bb \\
        --reference-python /tmp/ref_venv/bin/python --suites arith code lists --items 20 \\
        --gen-length 64 --out /tmp/side_by_side.json

``--family dream`` runs the authors' Dream bulk decoder (``dream/generate_blockBatching_original_
bulk.py``), which is a different algorithm from the LLaDA one (prefix-cache block steps, every
forward counted, no EOS stop by default): its agreement with the restatement is reported, not
expected to be 100 %.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = dict(block_sizes=[4, 8, 16, 32, 64], threshold=0.9, merge_threshold=0.5, sync_threshold=8,
                refresh_interval=32)  # fmt: skip
# (old, new) source edits of the authors' LLaDA bulk module for a float32 run; each must occur once
_F32_ATTENTION = [(f"{n}_fa.to(torch.bfloat16)", f"{n}_fa.to(torch.float32)") for n in ("q", "k", "v")]
_F32_EOS = [
    (
        "F.softmax(block_logits.to(torch.bfloat16), dim=-1)",
        "F.softmax(block_logits.to(torch.float32), dim=-1)",
    )
]


# ====================================================================================== worker
def _load_patched(path: Path, name: str, edits: list[tuple[str, str]]) -> types.ModuleType:
    """Execute the module at ``path`` with ``edits`` applied to its source in memory."""
    source = path.read_text()
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"{path}: expected exactly one {old!r} to edit, found {source.count(old)}; "
                             "this checkout differs from the one this script was written against")  # fmt: skip
        source = source.replace(old, new)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def _worker(job_path: str, out_path: str) -> None:
    """Runs in the reference venv: decode every prompt of the job with the authors' code."""
    import torch

    torch.set_num_threads(1)
    job = json.loads(Path(job_path).read_text())
    repo, family = Path(job["reference_repo"]), job["family"]
    sys.dont_write_bytecode = True  # nothing written into the user's checkout
    sys.path.insert(0, str(repo / family))
    s = job["settings"]
    if family == "llada":
        from model.configuration_llada import LLaDAConfig
        from model.modeling_llada import LLaDAModelLM

        cfg = LLaDAConfig.from_pretrained(job["checkpoint"])
        cfg.init_device = "cpu"
        model = LLaDAModelLM.from_pretrained(job["checkpoint"], config=cfg, torch_dtype=torch.float32).eval()
        edits = (_F32_ATTENTION if job["float32"] else []) + (
            _F32_EOS if job["eos_softmax"] == "float32" else []
        )
        bulk = _load_patched(
            repo / "llada/generate_blockBatching_original_bulk.py", "_authors_bulk_llada", edits
        )
        bulk._PROFILE_LAYERS = False

        def decode(ids):
            return bulk.generate_block_batching(
                model, ids, gen_length=s["gen_length"], block_sizes=s["block_sizes"], temperature=0.0,
                remasking="low_confidence", mask_id=model.config.mask_token_id, threshold=s["threshold"],
                sync_threshold=s["sync_threshold"], conf_threshold=s["merge_threshold"],
                refresh_block_size=s["refresh_interval"],
            )  # fmt: skip
    else:
        from model.configuration_dream import DreamConfig
        from model.modeling_dream import DreamModel

        cfg = DreamConfig.from_pretrained(job["checkpoint"])
        model = DreamModel.from_pretrained(job["checkpoint"], config=cfg, torch_dtype=torch.float32).eval()
        edits = [(".to(torch.bfloat16)", ".to(torch.float32)")] if job["float32"] else []
        path = repo / "dream/generate_blockBatching_original_bulk.py"
        source_count = path.read_text().count(".to(torch.bfloat16)")
        bulk = _load_patched(path, "_authors_bulk_dream", edits if source_count == 1 else [])

        def decode(ids):
            return bulk.generate_block_batching(
                model, ids, gen_length=s["gen_length"], block_sizes=s["block_sizes"], threshold=s["threshold"],
                refresh_block_size=s["refresh_interval"], sync_threshold=s["sync_threshold"],
            )  # fmt: skip

    results = []
    with torch.no_grad():
        for item in job["items"]:
            t0 = time.perf_counter()
            out, nfe, stats = decode(torch.tensor([item["prompt_ids"]]))
            keep = {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool, type(None)))}
            results.append({"key": item["key"], "tokens": out[0].tolist(), "nfe_authors": int(nfe),
                            "seconds": time.perf_counter() - t0, "stats": keep})  # fmt: skip
    Path(out_path).write_text(json.dumps(results))


# ======================================================================================== main
def _answer(tokens: list[int], prompt_len: int, end_ids: set[int]) -> list[int]:
    """The generated tokens up to the first end id (EOS or end of turn): what a scorer reads."""
    gen = tokens[prompt_len:]
    ends = [i for i, t in enumerate(gen) if t in end_ids]
    return gen[: ends[0]] if ends else gen


def _items(family: str, suites: list[str], limit: int) -> tuple[str, list[dict], object, object]:
    import torch

    import hf_blockbatch as hb
    from hf_blockbatch.tasks import get_suite

    torch.set_num_threads(1)
    name = "tiny-llada" if family == "llada" else "tiny-dream"
    model, tokenizer = hb.load_model(name, device="cpu", dtype=torch.float32)
    items = []
    for suite in suites:
        task = get_suite(suite)
        for i, item in enumerate(task.items("test", limit)):
            text = task.prompt(item, tokenizer, chat=True)
            ids = tokenizer(text, add_special_tokens=False).input_ids
            items.append({"key": f"{suite}/{i}", "suite": suite, "id": item.id, "prompt_ids": ids})
    checkpoint = hb.TINY_LLADA if family == "llada" else hb.TINY_DREAM
    return checkpoint, items, model, tokenizer


def main(argv: list[str] | None = None) -> int:
    # here, not at the top: the worker runs this file in the reference venv, which cannot import our package
    from hf_blockbatch.eval.script_args import nonnegative_int, out_file, positive_int, probability, read_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference-repo", type=Path, help="the user's checkout of Laurence-Wu/BlockBatch")
    p.add_argument(
        "--reference-python",
        default=os.environ.get("HF_BLOCKBATCH_REFERENCE_PYTHON"),
        help="a Python whose environment runs the authors' code (transformers 4.49, flash_attn)",
    )
    p.add_argument(
        "--reference-results", type=Path, help="reuse a worker output instead of running the authors' code"
    )
    p.add_argument("--family", choices=["llada", "dream"], default="llada")
    p.add_argument("--suites", nargs="+", default=["arith", "code", "lists"])
    p.add_argument("--items", type=positive_int, default=20, help="first N test items of each suite")
    p.add_argument("--gen-length", type=positive_int, default=64)
    p.add_argument("--block-sizes", type=positive_int, nargs="+", default=DEFAULTS["block_sizes"])
    p.add_argument("--threshold", type=probability, default=DEFAULTS["threshold"], help="the threshold rule's tau")
    p.add_argument("--merge-threshold", type=float, default=DEFAULTS["merge_threshold"])
    p.add_argument("--sync-threshold", type=nonnegative_int, default=DEFAULTS["sync_threshold"])
    p.add_argument("--refresh-interval", type=positive_int, default=DEFAULTS["refresh_interval"])
    p.add_argument(
        "--no-float32",
        dest="float32",
        action="store_false",
        help="leave the authors' bf16 attention casts in place",
    )
    p.add_argument("--eos-softmax", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", type=out_file, help="write per-item results and the agreement here (JSON)")
    p.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0
    if args.reference_results is None:
        if args.reference_repo is None or args.reference_python is None:
            p.error("give --reference-repo and --reference-python (or --reference-results)")
        if not (args.reference_repo / args.family / "generate_blockBatching_original_bulk.py").is_file():
            p.error(f"{args.reference_repo} has no {args.family}/generate_blockBatching_original_bulk.py: point "
                    "--reference-repo to the folder holding the authors' llada/ and dream/")  # fmt: skip
    bad = [b for b in args.block_sizes if args.gen_length % b]
    if bad:
        p.error(
            f"block sizes {bad} do not divide --gen-length {args.gen_length} (the authors' code requires it)"
        )

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from _reference_blockbatch import reference_blockbatch

    if not 0.0 <= args.merge_threshold <= 1.0:
        p.error(f"--merge-threshold must lie in [0, 1], got {args.merge_threshold:g}")
    theirs = None
    if args.reference_results is not None:  # a file that is no worker output is said before the model loads
        theirs = read_json(args.reference_results, list, "a worker's output: a list of {\"key\": ..., \"tokens\": ...}")
        if not all(isinstance(r, dict) and {"key", "tokens", "nfe_authors"} <= r.keys() for r in theirs):
            raise ValueError(f"{args.reference_results}: an entry lacks key, tokens or nfe_authors: not a worker's output")
    settings = dict(
        block_sizes=sorted(args.block_sizes), gen_length=args.gen_length, threshold=args.threshold,
        merge_threshold=args.merge_threshold, sync_threshold=args.sync_threshold,
        refresh_interval=args.refresh_interval,
    )  # fmt: skip
    checkpoint, items, model, tokenizer = _items(args.family, args.suites, args.items)

    if theirs is None:
        with tempfile.TemporaryDirectory() as tmp:
            job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
            job.write_text(json.dumps({"reference_repo": str(args.reference_repo.resolve()), "family": args.family,
                                       "checkpoint": checkpoint, "settings": settings, "float32": args.float32,
                                       "eos_softmax": args.eos_softmax, "items": items}))  # fmt: skip
            t0 = time.perf_counter()
            subprocess.run([args.reference_python, str(Path(__file__).resolve()), "--worker", str(job), str(out)],
                           check=True, cwd=tempfile.gettempdir())  # fmt: skip
            print(
                f"authors' decoder: {len(items)} prompts in {time.perf_counter() - t0:.1f} s", file=sys.stderr
            )
            theirs = json.loads(out.read_text())
    theirs = {r["key"]: r for r in theirs}

    end_ids = {
        i for i in (model.config.eos_token_id, getattr(model.config, "eot_token_id", None)) if i is not None
    }
    eos_dtype = torch.float32 if args.eos_softmax == "float32" else torch.bfloat16
    rows = []
    for item in items:
        ref = theirs.get(item["key"])
        if ref is None:
            continue
        stats: dict = {}
        tokens, nfe_ours, nfe_authors = reference_blockbatch(
            model, item["prompt_ids"], args.gen_length, block_sizes=settings["block_sizes"],
            threshold=settings["threshold"], merge_threshold=settings["merge_threshold"],
            sync_threshold=settings["sync_threshold"], refresh_interval=settings["refresh_interval"],
            eos_softmax_dtype=eos_dtype, stats=stats,
        )  # fmt: skip
        same_answer = _answer(tokens, len(item["prompt_ids"]), end_ids) == _answer(
            ref["tokens"], len(item["prompt_ids"]), end_ids
        )
        first_diff = next((i for i, (a, b) in enumerate(zip(tokens, ref["tokens"])) if a != b), None)
        rows.append({
            "key": item["key"], "suite": item["suite"], "same_tokens": tokens == ref["tokens"],
            "same_answer": same_answer,
            "same_nfe": nfe_authors == ref["nfe_authors"], "nfe_authors_theirs": ref["nfe_authors"],
            "nfe_authors_restated": nfe_authors, "nfe_ours_restated": nfe_ours, "first_diff": first_diff,
            "winner_theirs": ref["stats"].get("final_block_size"), "winner_restated": stats["winner_block"],
            "tokens_theirs": ref["tokens"], "tokens_restated": tokens, "restated_stats": stats,
        })  # fmt: skip

    if not rows:  # an empty table that exits 0 would read as a comparison that found nothing wrong
        raise ValueError(f"no reference result matches an item decoded here ({len(items)} items, keys such as "
                         f"{items[0]['key'] if items else 'arith/0'!r}; the results hold {len(theirs)}): give the "
                         "--suites and --items they were decoded for")  # fmt: skip
    summary = {}
    for suite in args.suites + ["all"]:
        sel = [r for r in rows if suite == "all" or r["suite"] == suite]
        if not sel:
            continue
        summary[suite] = {
            "items": len(sel),
            "identical_tokens_pct": 100.0 * sum(r["same_tokens"] for r in sel) / len(sel),
            "identical_answer_pct": 100.0 * sum(r["same_answer"] for r in sel) / len(sel),
            "identical_nfe_pct": 100.0 * sum(r["same_nfe"] for r in sel) / len(sel),
            "mean_nfe_authors_theirs": sum(r["nfe_authors_theirs"] for r in sel) / len(sel),
            "mean_nfe_authors_restated": sum(r["nfe_authors_restated"] for r in sel) / len(sel),
            "mean_nfe_ours_restated": sum(r["nfe_ours_restated"] for r in sel) / len(sel),
        }
    print(f"{args.family}, gen_length {args.gen_length}, block sizes {settings['block_sizes']}, threshold "
          f"{args.threshold}, merge {args.merge_threshold}, sync {args.sync_threshold}, refresh {args.refresh_interval}, "
          f"attention {'float32' if args.float32 else 'bf16'}, EOS softmax {args.eos_softmax}")  # fmt: skip
    print(f"{'suite':8} {'items':>5} {'same tokens':>12} {'same answer':>12} {'same NFE':>9} {'NFE theirs':>11} "
          f"{'NFE restated':>13} {'NFE all fwd':>12}")  # fmt: skip
    for suite, s in summary.items():
        print(f"{suite:8} {s['items']:5d} {s['identical_tokens_pct']:11.1f}% {s['identical_answer_pct']:11.1f}% "
              f"{s['identical_nfe_pct']:8.1f}% "
              f"{s['mean_nfe_authors_theirs']:11.2f} {s['mean_nfe_authors_restated']:13.2f} "
              f"{s['mean_nfe_ours_restated']:12.2f}")  # fmt: skip
    for r in rows:
        if not (r["same_tokens"] and r["same_nfe"]):
            print(f"  differs: {r['key']} first token diff at {r['first_diff']}, NFE {r['nfe_authors_theirs']} vs "
                  f"{r['nfe_authors_restated']}, winner {r['winner_theirs']} vs {r['winner_restated']}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"settings": settings, "family": args.family, "float32": args.float32,
                                        "eos_softmax": args.eos_softmax, "summary": summary, "rows": rows},
                                       indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # the reference venv: nothing of ours is imported there
        _worker(*sys.argv[2:4])
        raise SystemExit(0)
    from hf_blockbatch.eval.script_args import run_main

    raise SystemExit(run_main(main))
