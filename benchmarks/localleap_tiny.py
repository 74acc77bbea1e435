"""LocalLeap against the threshold rule on the tiny checkpoints, the rule being the only difference.

Greedy batch-1 block decoding with full forwards (no cache, no early stop), block 32, each suite's
default generation length, the first N test items; per rule: accuracy and mean NFE per item. A
stand-in until the engine takes the rule (then use the bench); the figures are in docs/localleap.md.

    PYTHONPATH=$PWD python benchmarks/localleap_tiny.py --items 150
"""

from __future__ import annotations

import argparse
import math

import torch
from hf_blockbatch.generation.transfer import threshold_select

import hf_blockbatch as hb
from hf_blockbatch.generation.rules.localleap import LocalLeapRule
from hf_blockbatch.tasks import get_suite

RULES = {
    "threshold 0.9": lambda s, d: threshold_select(s, 0.9),
    "LocalLeap 0.9/0.75/4": LocalLeapRule().select,
    "LocalLeap 0.9/0.75/1": LocalLeapRule(radius=1).select,
    "threshold 0.75": lambda s, d: threshold_select(s, 0.75),
}


def decode(model, ids: torch.Tensor, gen: int, block: int, select, mask_id: int) -> tuple[torch.Tensor, int]:
    x = torch.cat([ids[0], torch.full((gen,), mask_id)])[None]
    start, shift, nfe = ids.shape[1], model.logit_shift, 0
    for bs in range(start, start + gen, block):
        be = min(bs + block, start + gen)
        while (x[0, bs:be] == mask_id).any():
            logits = model(x).logits[0, bs - shift : be - shift]
            nfe += 1
            logp = torch.log_softmax(logits.float(), -1)
            logp[:, mask_id] = -math.inf  # the mask token is never proposed
            best, tokens = logp.max(-1)
            candidates = x[0, bs:be] == mask_id
            chosen = select(torch.where(candidates, best.double().exp(), -math.inf)[None], (~candidates)[None])[0]
            x[0, bs:be] = torch.where(chosen, tokens, x[0, bs:be])
    return x, nfe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=150)
    parser.add_argument("--block", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | suite | " + " | ".join(f"{r}: correct, NFE" for r in RULES) + " |")
    print("| --- | --- |" + " --- |" * len(RULES))
    for name in ["tiny-llada", "tiny-dream"]:
        model, tok = hb.load_model(name, device="cpu")
        mask_id = model.config.mask_token_id
        for suite_name in ["arith", "code", "lists"]:
            suite = get_suite(suite_name)
            items = suite.items("test")[: args.items]
            cells = []
            for select in RULES.values():
                correct = nfe = 0
                with torch.no_grad():
                    for item in items:
                        ids = tok(suite.prompt(item, tok), add_special_tokens=False, return_tensors="pt").input_ids
                        x, n = decode(model, ids, suite.default_gen_length, args.block, select, mask_id)
                        correct += suite.score(item, tok.decode(x[0, ids.shape[1] :], skip_special_tokens=True)).correct
                        nfe += n
                cells.append(f"{correct}/{len(items)}, {nfe / len(items):.1f}")
            print(f"| {name} | {suite_name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
