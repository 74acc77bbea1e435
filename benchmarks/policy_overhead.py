"""How much of decoding time is the policy (everything outside model forwards)?

Runs each strategy on batches of prompts and splits the wall time of each ``generate`` call into
model forwards (timed inside the engine) and the rest, the policy: checking the config, building
the state and the cache, sampling, transfer, advance, merge, sync, refresh selection, bookkeeping
and the output. Target (issue 3): policy ≤ 5 % of decoding time on the tiny model on CPU.
``policy_fraction_decode_loop`` is the same share of the decoding loop alone (what the engine's
own ``stats["seconds"]`` times; earlier sessions reported this one).

Usage: ``python benchmarks/policy_overhead.py [--model tiny-llada] [--random] [--prompts 16]``
(``--lookahead K`` adds Fast-dLLM with K lookahead draft rows; with ``--sparse``, of sparse steps;
``--lookahead-accept contained`` adopts contained drafts too; ``--presets`` adds the shipped
``FastDLLMConfig.drafted()`` and ``drafted(exact=False)``, and the latter without its query budget).
``--temperature T`` samples with every strategy (from the global generator, or with ``--seed S`` keyed noise:
``generation/noise.py``, RESULTS §39). ``--random`` uses a random model at the tiny checkpoints' geometry (no
weights needed); a random
model commits about one token per step, the worst case for per-step policy cost.
Each strategy first makes ``--warmup`` untimed passes over the prompts (a process's first ``generate`` calls pay
one-off costs: PyTorch's first calls of its kernels, tables built once, the first allocation of each cache size in
the storage pool and its page faults; 1-3 points of the share in the first timed run at batch 16 on the tiny model,
RESULTS §44), then ``--repeats`` timed ones; the run with the median policy share is reported, with every run's
share. Timings move between machines and sessions, so one more, untimed pass counts the policy's tensor operations per model forward call (exact, and the same on
any machine for the same code and inputs: what a change to the policy should be compared by), and
with ``--callers N`` the N functions that run most of them.
Writes ``benchmarks/results/policy_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import hf_blockbatch as hb
from hf_blockbatch.eval.forward_log import ForwardLog
from hf_blockbatch.eval.script_args import (
    nonnegative_float,
    nonnegative_int,
    out_file,
    positive_int,
    run_main,
)

#: a random model's prompts are ids below its vocabulary's last RESERVED (the mask and the end token among them)
RESERVED = 8


def random_heads(d_model: int) -> int:
    """The attention heads of ``--random``'s model of width ``d_model`` (64 wide, at least 4)."""
    return max(4, d_model // 64)


def build_model(args):
    if args.random:
        torch.manual_seed(0)
        d, v = args.d_model, args.vocab
        cfg = hb.LLaDAConfig(d_model=d, n_heads=random_heads(d), n_kv_heads=random_heads(d), n_layers=args.layers,
                             mlp_hidden_size=3 * d, vocab_size=v, embedding_size=v, max_sequence_length=1024,
                             mask_token_id=v - 1, eos_token_id=v - 2, pad_token_id=v - 2, rope_theta=10000.0)  # fmt: skip
        return hb.LLaDAModelLM(cfg).eval(), None
    return hb.load_model(args.model, device="cpu")


def count_policy_ops(model, prompts, masks, cfg, batch_size: int, callers: int = 0) -> dict[str, Any]:
    """Tensor operations of the policy per model forward call, and its host syncs, over one pass of every
    batch: counted for the whole of ``generate`` except inside the model's forwards (``ForwardLog``).
    ``callers`` > 0: also the ``callers`` functions that run most of them, with their operations and syncs
    per forward (``ForwardLog(by_caller=True)``): which part a change to the policy moves."""
    with ForwardLog(model, by_caller=callers > 0) as log:
        for i in range(0, prompts.shape[0], batch_size):
            model.generate(prompts[i : i + batch_size], attention_mask=masks[i : i + batch_size], generation_config=cfg)
            log.end_decode()
    forwards = len(log.records)
    out: dict[str, Any] = {
        "policy_ops": log.policy_ops, "forward_calls": forwards, "policy_ops_per_forward": log.policy_ops / forwards,
        # reads back to the host (forward_log.is_sync): what keeps a GPU waiting for the policy
        "policy_syncs_per_forward": sum(r.policy_syncs for r in log.records) / forwards,
    }  # fmt: skip
    if callers:
        out["policy_callers"] = [{"caller": name, "ops_per_forward": ops / forwards, "syncs_per_forward": syncs / forwards}
                                 for name, ops, syncs in log.policy_callers[:callers]]  # fmt: skip
        # the same callers by the time their operations took (in the counting pass: a share, not a latency)
        total = sum(t for _, t in log.policy_caller_seconds)
        out["policy_callers_by_time"] = [{"caller": name, "op_ms_per_forward": 1e3 * t / forwards, "share": t / total}
                                         for name, t in log.policy_caller_seconds[:callers]]  # fmt: skip
    return out


def timed_pass(model, prompts, masks, cfg, batch_size: int) -> dict[str, float]:
    """One pass of ``generate`` over every batch of the prompts: its wall time split into model forwards (timed
    inside the engine) and the rest, the policy."""
    total = loop = forward = sample = 0.0
    nfe = 0
    t0 = time.perf_counter()
    for i in range(0, prompts.shape[0], batch_size):
        sl = slice(i, i + batch_size)
        t = time.perf_counter()
        out = model.generate(prompts[sl], attention_mask=masks[sl], generation_config=cfg, return_dict_in_generate=True)
        total += time.perf_counter() - t
        loop += out.stats[0]["seconds"]
        forward += out.stats[0]["forward_seconds"]
        sample += out.stats[0]["sample_seconds"]
        nfe += int(out.nfe.sum())
    n = prompts.shape[0]
    return {
        "wall_seconds": time.perf_counter() - t0,
        "decode_seconds": total,
        "forward_seconds": forward,
        "policy_fraction": 1 - forward / total,
        "policy_fraction_decode_loop": 1 - forward / loop,
        # proposals: the softmax over the vocabulary at every queried position (part of the policy)
        "sampling_fraction": sample / total,
        "policy_fraction_without_sampling": 1 - (forward + sample) / total,
        "policy_ms_per_request": 1e3 * (total - forward) / n,
        "mean_nfe": nfe / n,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llada")
    parser.add_argument("--random", action="store_true")
    parser.add_argument("--d-model", type=positive_int, default=128,
                        help="random model width (tiny checkpoints: 128), a multiple of twice its heads (64 wide, at least 4)")
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--vocab", type=positive_int, default=1024, help=f"random model ids, more than {RESERVED}")
    parser.add_argument("--out", default="policy_overhead.json",
                        help="a file name (written under benchmarks/results/) or a path")
    parser.add_argument("--prompts", type=positive_int, default=16)
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--max-new-tokens", type=positive_int, default=96)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs per strategy; the median run is reported")
    parser.add_argument("--warmup", type=nonnegative_int, default=1,
                        help="untimed passes over the prompts per strategy before its timed runs (0: none, as before §44)")
    parser.add_argument("--sparse", action="store_true", help="the strategies with window_queries='sparse'")
    parser.add_argument("--lookahead", type=nonnegative_int, default=0,
                        help="also Fast-dLLM dual b32 with this many lookahead draft rows (issue 16)")
    parser.add_argument("--lookahead-accept", default="exact", choices=["exact", "contained"],
                        help="which drafts are adopted (FastDLLMConfig.lookahead_accept; RESULTS §16)")
    parser.add_argument("--callers", type=nonnegative_int, default=0, metavar="N",
                        help="also the N functions running most of the policy's operations, with their operations "
                             "and host syncs per forward (exact; RESULTS §26), and the N whose operations take the "
                             "most time, with their share of the policy's operation time (RESULTS §40)")
    parser.add_argument("--presets", action="store_true",
                        help="also FastDLLMConfig.drafted() and drafted(exact=False) at block 32, and the latter "
                             "without its query budget (RESULTS §17)")
    parser.add_argument("--temperature", type=nonnegative_float, default=0.0, help="sample at this temperature (0: greedy)")
    parser.add_argument("--seed", type=nonnegative_int, default=None, help="with --temperature: keyed noise of this seed")
    args = parser.parse_args(argv)
    if args.seed is not None and not args.temperature:  # a greedy decode draws nothing: the seed would be recorded, unused
        parser.error("--seed keys the sampling noise: give --temperature T > 0 with it, or leave it out")
    if args.random and args.vocab <= RESERVED:
        parser.error(f"--vocab must be more than {RESERVED} with --random: its prompts are ids below the last {RESERVED}; "
                     f"got {args.vocab}")  # fmt: skip
    if args.random and args.d_model % (2 * random_heads(args.d_model)):
        parser.error(f"--d-model must be a multiple of twice its {random_heads(args.d_model)} heads (RoPE rotates pairs "
                     f"of each head's dimensions), e.g. 128 or 512; got {args.d_model}")  # fmt: skip
    # a bare name goes under benchmarks/results/, a path where it says; its folder exists before the run
    out_path = Path(args.out) if Path(args.out).parent != Path() else Path(__file__).parent / "results" / args.out
    try:
        out_file(str(out_path))
    except argparse.ArgumentTypeError as err:
        parser.error(f"argument --out: {err}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
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
        prompts = torch.randint(0, vocab - RESERVED, (args.prompts, 24))
        masks = torch.ones_like(prompts)
    threshold = 0.9 if not args.random else 0.02
    # --sparse: the same two with sparse window queries (issue 16); --temperature, --seed: every strategy samples
    sparse, tag = ({"window_queries": "sparse"}, "_sparse") if args.sparse else ({}, "")
    sampling = {"temperature": args.temperature, "seed": args.seed} if args.temperature else {}
    strategies = {
        f"fast_dllm_dual_b32{tag}": hb.FastDLLMConfig(max_new_tokens=args.max_new_tokens, block_length=32,
                                                      threshold=threshold, **sparse, **sampling),
        f"blockbatch_default{tag}": hb.BlockBatchConfig(max_new_tokens=args.max_new_tokens, threshold=threshold, **sparse,
                                                        **sampling),
    }  # fmt: skip
    if args.lookahead:  # with --sparse, the drafts of sparse steps
        ct = "_ct" if args.lookahead_accept == "contained" else ""
        strategies[f"fast_dllm_dual_b32_la{args.lookahead}{ct}{tag}"] = hb.FastDLLMConfig(
            max_new_tokens=args.max_new_tokens, block_length=32, threshold=threshold, lookahead=args.lookahead,
            lookahead_accept=args.lookahead_accept, **sparse, **sampling)
    if args.presets:  # the shipped lookahead points, as users run them
        common = {"max_new_tokens": args.max_new_tokens, "block_length": 32, "threshold": threshold, **sampling}
        strategies["fast_dllm_drafted_b32"] = hb.FastDLLMConfig.drafted(**common)
        strategies["fast_dllm_drafted_contained_b32"] = hb.FastDLLMConfig.drafted(exact=False, **common)
        strategies["fast_dllm_drafted_contained_no_budget_b32"] = hb.FastDLLMConfig.drafted(
            exact=False, lookahead_query_budget=None, **common)
    model_name = f"random d{args.d_model} L{args.layers} V{args.vocab}" if args.random else args.model
    report = {"model": model_name, "threads": args.threads, "prompts": args.prompts, "warmup": args.warmup,
              "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "seed": args.seed, "strategies": {}}  # fmt: skip
    for name, cfg in strategies.items():
        for _ in range(args.warmup):  # untimed: a process's first calls pay one-off costs (see the docstring)
            timed_pass(model, prompts, masks, cfg, args.batch_size)
        # the same work each time: a quiet machine still moves timings by ~1 point
        runs = [timed_pass(model, prompts, masks, cfg, args.batch_size) for _ in range(args.repeats)]
        median = sorted(runs, key=lambda r: r["policy_fraction"])[len(runs) // 2]
        ops = count_policy_ops(model, prompts, masks, cfg, args.batch_size, args.callers)
        report["strategies"][name] = {**median, "policy_fraction_runs": [r["policy_fraction"] for r in runs], **ops}
        print(name, json.dumps(report["strategies"][name]))
    out_path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    raise SystemExit(run_main(main))
