"""LocalLeap against the threshold rule on the tiny checkpoints, the rule being the only difference.

The library's Fast-dLLM without a cache and without early stop (``FastDLLMConfig(cache="none")``: full forwards,
blocks left to right), greedy, block 32, each suite's default generation length, the first N test items; per rule
(``rule="localleap"`` or the threshold): items correct and mean NFE per item. Answers are scored up to their first
end token, as the bench scores them. The figures are in docs/localleap.md; the engine's cached decoders take the
same rule (``FastDLLMConfig(rule="localleap", ...)``, RESULTS §11, §23).

    PYTHONPATH=$PWD python benchmarks/localleap_tiny.py --items 150

Writes ``benchmarks/results/localleap_tiny.{json,md}``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch

from hf_blockbatch.eval.runner import (
    TINY_TASKS,
    _encode,
    _score_all,
    check_scoring,
    load_for_benchmark,
    load_task,
    write_report,
)
from hf_blockbatch.eval.script_args import out_file, positive_int, run_main
from hf_blockbatch.generation.configs import FastDLLMConfig
from hf_blockbatch.generation.outputs import answer_texts, end_token_ids

logger = logging.getLogger("localleap_tiny")

#: the rules compared, as the config options that select them
RULES: dict[str, dict[str, Any]] = {
    "threshold 0.9": {"threshold": 0.9},
    "LocalLeap 0.9/0.75/4": {"threshold": 0.9, "rule": "localleap", "relaxed_threshold": 0.75, "leap_radius": 4},
    "LocalLeap 0.9/0.75/1": {"threshold": 0.9, "rule": "localleap", "relaxed_threshold": 0.75, "leap_radius": 1},
    "threshold 0.75": {"threshold": 0.75},
}


def run(model, tokenizer, suite: str, items: int, block: int, batch_size: int) -> dict[str, dict[str, float]]:
    """Every rule on the first ``items`` test items of ``suite``: items correct, their count and the mean NFE."""
    task = load_task(suite)
    chosen = task.items("test", limit=items)
    gen = int(task.default_gen_length)
    end = end_token_ids(tokenizer, model.config)
    out: dict[str, dict[str, float]] = {}
    for name, options in RULES.items():
        cfg = FastDLLMConfig(cache="none", block_length=block, max_new_tokens=gen, **options)
        texts, nfe = [], 0
        for i in range(0, len(chosen), batch_size):
            ids, mask = _encode(tokenizer, [task.prompt(it, tokenizer) for it in chosen[i : i + batch_size]], model.device)
            res = model.generate(ids, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)
            texts += answer_texts(tokenizer, res.sequences[:, ids.shape[1] :], end)
            nfe += int(res.nfe.sum())
        correct = sum(bool(s.correct) for s in _score_all(task, chosen, texts))
        out[name] = {"correct": correct, "items": len(chosen), "nfe": nfe / len(chosen)}
        logger.info("%s %s: %d/%d correct, NFE %.2f", suite, name, correct, len(chosen), nfe / len(chosen))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=positive_int, default=150, help="test items per suite, from the first")
    parser.add_argument("--block", type=positive_int, default=32)
    parser.add_argument("--batch-size", type=positive_int, default=16, help="requests per generate call (a padded batch decodes as alone)")
    parser.add_argument("--models", nargs="+", default=["tiny-llada", "tiny-dream"])
    parser.add_argument("--out", type=out_file, default="benchmarks/results/localleap_tiny",
                        help="the report's stem: <out>.json and <out>.md")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"items": args.items, "block": args.block, "models": {}}
    lines = ["| model | suite | " + " | ".join(f"{r}: correct, NFE" for r in RULES) + " |",
             "| --- | --- |" + " --- |" * len(RULES)]  # fmt: skip
    check_scoring(load_task(suite) for suite in TINY_TASKS)
    for name in args.models:
        model, tokenizer = load_for_benchmark(name, threads=1)
        result["models"][name] = {}
        for suite in TINY_TASKS:
            with torch.inference_mode():
                cells = run(model, tokenizer, suite, args.items, args.block, args.batch_size)
            result["models"][name][suite] = cells
            lines.append(f"| {name} | {suite} | " + " | ".join(f"{c['correct']}/{c['items']}, {c['nfe']:.1f}" for c in cells.values()) + " |")
    write_report(Path(args.out), result, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(run_main(main))
