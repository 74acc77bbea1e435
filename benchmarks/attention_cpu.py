"""Which window-attention path is fastest on this CPU for BlockBatch's windows?

Compares, for one layer's attention over a cache of ``L`` positions and the six BlockBatch windows
(4, 8, 16, 32, 64, 128):

* ``sdpa``: the library's padded path (every row padded to the longest window, one SDPA call);
* ``sdpa_grouped``: the library's grouped path (one SDPA call per group of window lengths, padded
  where that is cheaper than a call: here, at 4 heads of 32 over 384 keys, 8 and 16 share one, the others each have their own);
* ``per_row``: one SDPA call per row on its exact window (no padding waste, a Python loop);
* ``reference``: the library's explicit float32 softmax path;
* ``single_32``: one row, one window of 32 (Fast-dLLM dual), for scale.

Writes ``benchmarks/results/attention_cpu.json``. Usage:
``python benchmarks/attention_cpu.py [--length 384] [--heads 4] [--head-dim 32] [--repeats 200]``.

``--groups`` measures instead what ``sdpa_grouped`` weighs when it merges query counts: one group's
call (gathers, SDPA's setup, the scatter back) against padded attention work, by timing groups of
``n`` rows of ``w`` queries and fitting ``time = call + n * row + n * w * L * heads * head_dim * unit``, then
``G`` single-row groups attended one call each, whose time less their rows' own query work grows by ``call``
per group. ``call / unit`` is the ``GROUP_CALL_COST`` of this CPU (``hf_blockbatch/attention/metadata.py``);
writes ``benchmarks/results/attention_cpu_groups.json`` (RESULTS §27).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_blockbatch.attention import build_window_batch, get_backend, metadata
from hf_blockbatch.cache import BranchCache
from hf_blockbatch.eval.script_args import positive_int, run_main

#: the windows compared, each a BlockBatch block size; they start WINDOWS_FROM positions before the cache's end
SIZES = (4, 8, 16, 32, 64, 128)
WINDOWS_FROM = 256
#: ``--groups``' windows start this many positions before the cache's end
GROUPS_FROM = 64


def report(results: dict, name: str) -> None:
    """Print ``results`` and write them to ``benchmarks/results/<name>``."""
    print(json.dumps(results, indent=1))
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / name).write_text(json.dumps(results, indent=1))


def timed(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=positive_int, default=384,
                        help=f"cache positions: at least {WINDOWS_FROM} ({GROUPS_FROM} with --groups)")
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--head-dim", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=200)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--groups", action="store_true", help="fit the grouped backend's cost of a call (RESULTS §27)")
    args = parser.parse_args(argv)
    # the windows sit at fixed offsets from the cache's end: a shorter cache fails inside the window batch
    least = GROUPS_FROM if args.groups else WINDOWS_FROM
    if args.length < least:
        parser.error(f"--length must be at least {least}{' with --groups' if args.groups else ''}: the windows start "
                     f"{least} positions before the cache's end; got {args.length}")  # fmt: skip
    if args.groups and args.heads % max(1, args.heads // 2):
        parser.error(f"--groups attends {args.heads} query heads to {args.heads // 2} K/V heads, which must divide them: "
                     "give 1 to 3 or an even number of heads")  # fmt: skip
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.groups:
        return group_costs(args)
    sizes = list(SIZES)
    R, L, H, D = len(sizes), args.length, args.heads, args.head_dim
    cache = BranchCache(1, R, L, H, D)
    cache.layers[0].keys.normal_()
    cache.layers[0].values.normal_()
    starts = torch.full((R,), L - WINDOWS_FROM)
    ends = starts + torch.tensor(sizes)
    wb = build_window_batch(cache, starts, ends)
    q = torch.randn(wb.num_tokens, H, D)
    k, v = cache.layers[0].keys, cache.layers[0].values
    scale = D**-0.5
    sdpa, ref = get_backend("sdpa", "cpu", torch.float32), get_backend("reference", "cpu", torch.float32)
    grouped = get_backend("sdpa_grouped", "cpu", torch.float32)
    cu = wb.cu_seqlens.tolist()

    def per_row():
        outs = []
        for r in range(R):
            qr = q[cu[r] : cu[r + 1]].transpose(0, 1)[None]
            outs.append(F.scaled_dot_product_attention(qr, k[r : r + 1].transpose(1, 2), v[r : r + 1].transpose(1, 2),
                                                       scale=scale)[0].transpose(0, 1))  # fmt: skip
        return torch.cat(outs)

    wb1 = build_window_batch(cache, starts[3:4], ends[3:4], rows=torch.tensor([3]))
    q1 = torch.randn(32, H, D)
    results = {
        "geometry": {"rows": R, "length": L, "heads": H, "head_dim": D, "windows": sizes, "threads": args.threads},
        "microseconds": {
            "sdpa": timed(lambda: sdpa.window(q, k, v, wb, scale), args.repeats),
            "sdpa_grouped": timed(lambda: grouped.window(q, k, v, wb, scale), args.repeats),
            "per_row": timed(per_row, args.repeats),
            "reference": timed(lambda: ref.window(q, k, v, wb, scale), args.repeats),
            "single_32": timed(lambda: sdpa.window(q1, k, v, wb1, scale), args.repeats),
        },
    }
    assert torch.allclose(sdpa.window(q, k, v, wb, scale), per_row(), atol=1e-5)
    assert torch.allclose(grouped.window(q, k, v, wb, scale), per_row(), atol=1e-5)
    report(results, "attention_cpu.json")


def group_costs(args) -> None:
    """What ``sdpa_grouped`` trades when it merges query counts (see the module docstring): a call,
    from ``G`` single-row groups of distinct counts 8…8+G-1 attended one call each (merging off),
    against a padded query slot, from one group of ``n`` rows x ``w`` queries over a range of sizes."""
    L, H, D = args.length, args.heads, args.head_dim
    grouped = get_backend("sdpa_grouped", "cpu", torch.float32)
    scale = D**-0.5

    def cache_of(n):
        cache = BranchCache(1, n, L, max(1, H // 2), D)
        return cache, cache.layers[0].keys.normal_(), cache.layers[0].values.normal_()

    samples = []  # one group: (rows, width, us)
    for n in (1, 4, 16):
        cache, k, v = cache_of(n)
        for w in (1, 8, 16, 32, 64):
            starts = torch.full((n,), L - GROUPS_FROM)
            wb = build_window_batch(cache, starts, starts + w)
            q = torch.randn(n * w, H, D)
            samples.append((n, w, timed(functools.partial(grouped.window, q, k, v, wb, scale), args.repeats)))
    design = torch.tensor([[1.0, n, n * w * L * H * D] for n, w, _ in samples], dtype=torch.float64)
    times = torch.tensor([[t] for *_, t in samples], dtype=torch.float64)
    _, row, unit = torch.linalg.lstsq(design, times).solution[:, 0].tolist()
    calls = []  # G groups of one row each, one call per group: (G, us)
    shipped, metadata.GROUP_CALL_COST = metadata.GROUP_CALL_COST, 0.0  # merging off: the call cost, no padding
    try:
        for G in (2, 4, 8, 12):
            cache, k, v = cache_of(G)
            starts = torch.full((G,), L - GROUPS_FROM)
            wb = build_window_batch(cache, starts, starts + 8 + torch.arange(G))
            q = torch.randn(wb.num_tokens, H, D)
            calls.append((G, timed(functools.partial(grouped.window, q, k, v, wb, scale), args.repeats)))
    finally:
        metadata.GROUP_CALL_COST = shipped
    # each added group also attends its own row's queries (8 + g of them): that work is the padded slots' rate,
    # not the call's, so it comes off (with the row's cost) before the slope over G is read
    gs = torch.tensor([[1.0, g] for g, _ in calls], dtype=torch.float64)
    own = torch.tensor([[t - g * row - sum(8 + i for i in range(g)) * L * H * D * unit] for g, t in calls],
                       dtype=torch.float64)  # fmt: skip
    call = float(torch.linalg.lstsq(gs, own).solution[1, 0])
    results = {
        "geometry": {"length": L, "heads": H, "head_dim": D, "threads": args.threads},
        "one_group_us": [{"rows": n, "width": w, "us": round(t, 1)} for n, w, t in samples],
        "one_call_per_group_us": [{"groups": g, "us": round(t, 1)} for g, t in calls],
        "fit": {"call_us": call, "row_us": row, "unit_ns": unit * 1e3, "padded_slot_us": unit * L * H * D},
        "call_cost_units": call / unit,
        "padded_slots_per_call": call / (unit * L * H * D),
        "shipped_GROUP_CALL_COST": metadata.GROUP_CALL_COST,
    }
    report(results, "attention_cpu_groups.json")


if __name__ == "__main__":
    raise SystemExit(run_main(main))
