"""Peak memory and time of one proposal step over a real vocabulary, in row chunks against one pass (RESULTS §37).

Why: ``sample_tokens`` makes float32 log-probabilities of every logit it is given (and, when sampling, float64 noise
and Gumbel scores). An initial forward proposes at every mask of every request: 16 requests x 256 masks at LLaDA's
126,464 ids is 4,096 rows, so the float copies were several times the bf16 logits themselves. The rows are now
proposed in chunks of ``SAMPLE_CHUNK_ELEMENTS`` logits. Each setting runs in a fresh process, which reports its peak
resident memory above the logits it was given (``ru_maxrss``: on a CPU the allocator's peak is the process's), and
the median time of ``--repeats`` calls. Sampled, the chunked step also runs with keyed noise (``seed``:
``generation/noise.py``), whose hash replaces the generator's ``torch.rand`` (RESULTS §39).

    python benchmarks/sampling_memory.py --rows 4096 --vocab 126464 --repeats 3

Writes ``benchmarks/results/sampling_memory.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_blockbatch.eval.script_args import nonnegative_float, out_file, positive_int, run_main

#: the exit status of a child the kernel killed for want of memory (SIGKILL): a result, not a failure
KILLED = -9


def one(rows: int, vocab: int, temperature: float, chunked: bool, repeats: int, keyed: bool = False) -> dict:
    """In this process: the peak resident memory that proposing from ``rows`` x ``vocab`` bf16 logits added, and the
    median time of a call (``keyed``: the noise hashed from a key per row, as with a seed, not drawn)."""
    from hf_blockbatch.generation import sampling

    torch.set_num_threads(1)
    if not chunked:
        sampling.SAMPLE_CHUNK_ELEMENTS = rows * vocab
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)  # no float32 copy
    keys = torch.randint(0, 2**32, (rows,), generator=torch.Generator().manual_seed(1)) if keyed else None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    times = []
    for r in range(repeats):
        t = time.perf_counter()
        out = sampling.sample_tokens(logits, temperature, "low_confidence", 1, torch.Generator().manual_seed(r),
                                     mask_id=vocab - 1, noise_keys=keys)  # fmt: skip
        times.append(time.perf_counter() - t)
        del out
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rows": rows, "vocab": vocab, "temperature": temperature, "chunked": chunked, "keyed": keyed,
            "chunk_rows": min(rows, max(1, sampling.SAMPLE_CHUNK_ELEMENTS // vocab)) if chunked else rows,
            "logits_mb": logits.numel() * 2 / 2**20, "peak_above_logits_mb": (peak - before) / 1024,
            "median_s": statistics.median(times)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=positive_int, default=4096)
    parser.add_argument("--vocab", type=positive_int, default=126464, help="ids per row, at least 2 (the last is the mask)")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--temperatures", type=nonnegative_float, nargs="+", default=[0.0, 1.0], help="0: greedy")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process's setting, as JSON
    parser.add_argument("--out", type=out_file, default=str(Path(__file__).parent / "results" / "sampling_memory"),
                        help="the results' stem: <out>.json and <out>.md")
    args = parser.parse_args(argv)
    if args.vocab < 2:  # a child would fail on it, and its failure read as a result
        parser.error(f"--vocab must be at least 2: the last id is the mask, which is never proposed; got {args.vocab}")
    if args.one:
        print(json.dumps(one(**json.loads(args.one))))
        return 0
    results = []
    # sampled, the shipped (chunked) step is also timed with keyed noise
    settings = [(t, chunked, keyed) for t in args.temperatures for chunked in (False, True)
                for keyed in ((False, True) if t and chunked else (False,))]  # fmt: skip
    for temperature, chunked, keyed in settings:
        setting = {"rows": args.rows, "vocab": args.vocab, "temperature": temperature, "chunked": chunked,
                   "keyed": keyed, "repeats": args.repeats}  # fmt: skip
        run = subprocess.run([sys.executable, __file__, "--one", json.dumps(setting)], capture_output=True,
                             text=True)  # fmt: skip
        if run.returncode:  # e.g. killed by the kernel for want of memory: that is the result
            results.append({**setting, "chunk_rows": None, "logits_mb": args.rows * args.vocab * 2 / 2**20,
                            "error": f"exit status {run.returncode}", "exit_status": run.returncode,
                            "stderr": run.stderr[-500:]})  # fmt: skip
        else:
            results.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    lines = [f"# One proposal step over {args.rows} rows x {args.vocab} ids (bf16 logits of "
             f"{results[0]['logits_mb']:.0f} MB), 1 thread", "",
             "| decoding | rows at once | peak memory above the logits (MB) | median time (s) |", "|---|---:|---:|---:|"]
    for r in results:
        kind = (f"sampled, T {r['temperature']:g}" + (", keyed noise" if r.get("keyed") else "")
                if r["temperature"] else "greedy")  # fmt: skip
        if "error" in r:
            why = " (killed, out of memory)" if r["exit_status"] == KILLED else ""
            lines.append(f"| {kind} | {args.rows} | failed: {r['error']}{why} | — |")
        else:
            lines.append(f"| {kind} | {r['chunk_rows']} | {r['peak_above_logits_mb']:.0f} | {r['median_s']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    failed = [r for r in results if "error" in r and r["exit_status"] != KILLED]
    if failed:  # not the memory this measures: a fault, said with the child's last line
        print(f"error: {len(failed)} setting(s) failed, e.g. {failed[0]['stderr'].strip().splitlines()[-1:]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
