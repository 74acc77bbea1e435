"""How much of decoding time is the policy (everything outside model forwards)?

Runs each strategy on a batch of prompts and splits the wall time into model forwards (timed
inside the engine) and the rest: sampling, transfer, advance, merge, sync, refresh selection,
bookkeeping. Target (issue 3): policy ≤ 5 % of decoding time on the tiny model on CPU.

Usage: ``python benchmarks/policy_overhead.py [--model tiny-llada] [--random] [--prompts 16]``.
``--random`` uses a random model at the tiny checkpoints' geometry (no weights needed); a random
model commits about one token per step, the worst case for per-step policy cost.
Each strategy runs ``--repeats`` times over the same prompts; the run with the median policy share
is reported, with every run's share. Writes ``benchmarks/results/policy_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_blockbatch as hb


def build_model(args):
    if args.random:
        torch.manual_seed(0)
        d, v = args.d_model, args.vocab
        cfg = hb.LLaDAConfig(d_model=d, n_heads=max(4, d // 64), n_kv_heads=max(4, d // 64), n_layers=args.layers,
                             mlp_hidden_size=3 * d, vocab_size=v, embedding_size=v, max_sequence_length=1024,
                             mask_token_id=v - 1, eos_token_id=v - 2, pad_token_id=v - 2, rope_theta=10000.0)  # fmt: skip
        return hb.LLaDAModelLM(cfg).eval(), None
    return hb.load_model(args.model, device="cpu")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llada")
    parser.add_argument("--random", action="store_true")
    parser.add_argument("--d-model", type=int, default=128, help="random model width (tiny checkpoints: 128)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--out", default="policy_overhead.json")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs per strategy; the median run is reported")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = build_model(args)
    vocab = model.config.vocab_size
    torch.manual_seed(1)
    if tokenizer is not None:  # real prompts: the arith suite's first test questions, left-padded
        from hf_blockbatch.tasks import get_suite

        suite = get_suite("arith")
        texts = [suite.prompt(item, tokenizer) for item in suite.items("test", args.prompts)]
        enc = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)
        prompts, masks = enc.input_ids, enc.attention_mask
    else:
        prompts = torch.randint(0, vocab - 8, (args.prompts, 24))
        masks = torch.ones_like(prompts)
    threshold = 0.9 if not args.random else 0.02
    strategies = {
        "fast_dllm_dual_b32": hb.FastDLLMConfig(max_new_tokens=args.max_new_tokens, block_length=32, threshold=threshold),
        "blockbatch_default": hb.BlockBatchConfig(max_new_tokens=args.max_new_tokens, threshold=threshold),
    }
    model_name = f"random d{args.d_model} L{args.layers} V{args.vocab}" if args.random else args.model
    report = {"model": model_name, "threads": args.threads, "prompts": args.prompts,
              "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "strategies": {}}  # fmt: skip
    for name, cfg in strategies.items():
        runs = []
        for _ in range(args.repeats):  # the same work each time: a quiet machine still moves timings by ~1 point
            total = forward = sample = 0.0
            nfe = 0
            t0 = time.perf_counter()
            for i in range(0, args.prompts, args.batch_size):
                sl = slice(i, i + args.batch_size)
                out = model.generate(prompts[sl], attention_mask=masks[sl], generation_config=cfg,
                                     return_dict_in_generate=True)  # fmt: skip
                total += out.stats[0]["seconds"]
                forward += out.stats[0]["forward_seconds"]
                sample += out.stats[0]["sample_seconds"]
                nfe += int(out.nfe.sum())
            runs.append({
                "wall_seconds": time.perf_counter() - t0,
                "decode_seconds": total,
                "forward_seconds": forward,
                "policy_fraction": 1 - forward / total,
                # proposals: the softmax over the vocabulary at every queried position (part of the policy)
                "sampling_fraction": sample / total,
                "policy_fraction_without_sampling": 1 - (forward + sample) / total,
                "policy_ms_per_request": 1e3 * (total - forward) / args.prompts,
                "mean_nfe": nfe / args.prompts,
            })  # fmt: skip
        median = sorted(runs, key=lambda r: r["policy_fraction"])[len(runs) // 2]
        report["strategies"][name] = {**median, "policy_fraction_runs": [r["policy_fraction"] for r in runs]}
        print(name, json.dumps(report["strategies"][name]))
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
