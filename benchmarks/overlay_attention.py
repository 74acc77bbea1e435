"""Would a K/V overlay make the lookahead drafts' attention cheaper? Measured on the steps of a real decode
(issue 16, RESULTS index row 75, §36).

Why: every draft row of ``FastDLLMConfig.drafted()`` owns a whole cache row, although 85-90 % of it is a copy of
its main row (§28). That costs three ways: memory (4 rows of K/V per request instead of 1), full-row copies after
each refresh, and attention, where a draft row's few queries read a whole row of keys, gathered per layer when the
rows of a query-count group are not evenly spaced (§35: +0.28 ms attention and +0.43 ms gathers per item at batch
32 on tiny-dream lists). An *overlay* keeps one cache row per request: its main row, then a tail of spare slots
holding the draft rows' own K/V. A request's queries (main and drafts) attend to that one row in one batch entry,
under a mask: a main query sees the main positions; a draft query sees the main positions except those its own
K/V replace, plus its tail slots. §28 judged an overlay dearer on a CPU than the copies it saves, assuming the
draft's keys would be gathered per layer; in this layout nothing is gathered, so this measures it.

What it does: decodes training items (never a test question) with ``drafted(exact=False)`` and captures, at the
last layer of every sparse step that carries a draft (a first layer's K/V depend on the token alone, so there a
draft differs from its main row only at its drafted tokens), the attention's inputs (packed queries, the cache after
the step's writes, the packing metadata). For each captured step it then times, per layer call:

* ``rows``: today's path, ``sdpa_grouped`` over every row of the step (its gathers included), and the layer's
  cache write (the queries' K/V and the echoes into draft rows);
* ``overlay``: one batch entry per request over its main row plus a tail of the draft rows' K/V (the positions
  where a draft row's cache differs from its main row's, read off the captured cache), one masked
  ``scaled_dot_product_attention`` call, and the layer's write (the queries' K/V only: no echoes).

The overlay's outputs are compared with today's, query by query: the layout is only worth building if it computes
the same attention. Metadata (the masks and indices, built once per step in either layout) is not timed; a layer
pays it once per step, not per layer. Figures are medians over ``--repeats`` calls.

    PYTHONPATH=$PWD python benchmarks/overlay_attention.py --model tiny-dream --suite lists --block 48 \\
        --limit 64 --batch-size 32

Writes ``benchmarks/results/overlay_attention/<model>_<suite>_b<batch>_<limit>.json`` and ``.md``. Verdict (§36): the
same attention in 1.7-1.8 rows per request, but on this CPU 1.1-1.3x the attention time once more than 16 requests
ride a step; not built.
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from step_anatomy import _batches as step_anatomy_batches

from hf_blockbatch.attention.backends import AttentionBackend, GroupedSDPABackend
from hf_blockbatch.attention.metadata import GROUP_CALL_COST, WindowBatch
from hf_blockbatch.eval.runner import load_for_benchmark, load_task, write_report
from hf_blockbatch.eval.script_args import out_folder, positive_int, run_main
from hf_blockbatch.generation.configs import FastDLLMConfig

logger = logging.getLogger("overlay_attention")


@dataclass
class Captured:
    """One layer call of a drafted sparse step: the attention's inputs after the layer's cache write."""

    q: torch.Tensor  # [T, H, D] packed queries
    k: torch.Tensor  # [R, L, H_kv, D] the cache after the write
    v: torch.Tensor
    k_fresh: torch.Tensor  # [T, H_kv, D] the queries' own K/V (what the layer writes)
    v_fresh: torch.Tensor
    wb: WindowBatch
    branches: int  # rows per request (main row first)


def capture(model, batches: list, config: FastDLLMConfig, limit: int) -> tuple[list[Captured], int]:
    """Decode ``batches`` with ``config`` until ``limit`` steps with drafts are kept (the last layer's inputs of
    each); returns them and the number of items decoded."""
    backend = model.attention_backend
    original = type(backend).window
    layers = model.config.num_hidden_layers
    steps: list[Captured] = []
    calls = [0]  # window calls so far: one per layer of each window forward, in layer order
    branches = 1 + config.lookahead

    def window(self, q, k_cache, v_cache, wb, scale):
        last_layer = calls[0] % layers == layers - 1
        calls[0] += 1
        if last_layer and len(steps) < limit and wb.write_src is not None and bool((wb.rows % branches != 0).any()):
            flat_k = k_cache.reshape(-1, *k_cache.shape[2:])  # the step's own K/V, as the layer wrote them
            flat_v = v_cache.reshape(-1, *v_cache.shape[2:])
            steps.append(Captured(q.clone(), k_cache.clone(), v_cache.clone(), flat_k[wb.flat_slots].clone(),
                                  flat_v[wb.flat_slots].clone(), wb, branches))  # fmt: skip
        return original(self, q, k_cache, v_cache, wb, scale)

    type(backend).window = window
    decoded = 0
    try:
        for ids, mask in batches:
            model.generate(ids, attention_mask=mask, generation_config=config)
            decoded += ids.shape[0]
            if len(steps) >= limit:
                break
    finally:
        type(backend).window = original
    return steps, decoded


@dataclass
class OverlayGroup:
    """Requests attended in one masked SDPA call, padded to the group's widest query count and tail."""

    k: torch.Tensor  # [n, H_kv, L + T, D] each request's main row, then its tail (the layout's cache)
    v: torch.Tensor
    mask: torch.Tensor  # [n, 1, Q, L + T] keys each query sees
    index: torch.Tensor  # [n * Q] packed query of each padded slot (a padded slot repeats a real query)
    real: torch.Tensor | None  # [t] padded slots holding a real query (None: all)
    target: torch.Tensor  # [t] their packed query index
    count: int
    width: int  # Q


@dataclass
class Overlay:
    """Per-step metadata of the overlay layout (built once per step, shared by the layers)."""

    groups: list[OverlayGroup]
    requests: int
    tails: list[int]  # each request's tail: the draft K/V slots it needs in this step
    write_slots: torch.Tensor  # flat slots the layer's K/V go to: a main query's at its position, a draft's in the tail
    write_src: torch.Tensor  # their packed query index
    units: int  # padded queries x keys over the groups (today's: the step's packed queries x the canvas)


def build_overlay(c: Captured) -> Overlay:
    """The overlay layout of a captured step, read off the captured cache: a draft row's tail is its own queries and
    every other position where its cache row differs from its main row's (its draft ancestors' echoes). Requests
    are grouped by query count with ``sdpa_grouped``'s rule (:data:`GROUP_CALL_COST`)."""
    wb, N, dev = c.wb, c.branches, c.k.device
    rows, L = wb.rows.tolist(), c.k.shape[1]
    main_of = torch.arange(c.k.shape[0], device=dev) // N * N
    diff = (c.k != c.k[main_of]).flatten(2).any(-1) | (c.v != c.v[main_of]).flatten(2).any(-1)  # [R, L]
    bounds = [0, *wb.lengths.cumsum(0).tolist()]
    members: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        members.setdefault(r - r % N, []).append(i)
    requests = sorted(members)
    # per request: its K/V (main row, then tail), the keys each of its queries sees, its queries in packed order
    built, write_slots, write_src = [], [], []
    for a, m in enumerate(requests):
        ks, vs, sees, queries, tail = [c.k[m]], [c.v[m]], [], [], 0
        for i in members[m]:
            r, own = rows[i], torch.arange(bounds[i], bounds[i + 1], device=dev)
            keys = torch.ones(L, dtype=torch.bool, device=dev) if wb.key_mask is None else wb.key_mask[i].clone()
            slot = wb.token_pos[own]
            if r != m:
                # the tail: where the draft's K/V differ from its main row's, and its own queries (their K/V are
                # its own, even where they happen to equal the main row's)
                own_pos = torch.zeros(L, dtype=torch.bool, device=dev).index_fill_(0, slot, True)
                at = (diff[r] | own_pos).nonzero().squeeze(1)
                ks.append(c.k[r, at])
                vs.append(c.v[r, at])
                keys[at] = False
                sees.append((keys, tail, tail + at.numel(), own.numel()))
                slot = L + tail + torch.searchsorted(at, slot)  # a draft query's K/V go to its position's tail slot
                tail += at.numel()
            else:
                sees.append((keys, 0, 0, own.numel()))
            write_slots.append((a, slot))
            write_src.append(own)
            queries.append(own)
        built.append((torch.cat(ks), torch.cat(vs), sees, torch.cat(queries), tail))
    tails = [b[4] for b in built]
    unit = c.q.shape[1] * c.q.shape[2]
    order = sorted(range(len(requests)), key=lambda a: -built[a][3].numel())
    plan: list[list[int]] = []
    for a in order:  # widest first; join the current group while its padding costs less than a call
        width = built[plan[-1][0]][3].numel() if plan else 0
        if plan and (width - built[a][3].numel()) * (L + tails[plan[-1][0]]) * unit <= GROUP_CALL_COST:
            plan[-1].append(a)
        else:
            plan.append([a])
    groups, units = [], 0
    for members_ in plan:
        n, Q, T = len(members_), built[members_[0]][3].numel(), max(tails[a] for a in members_)
        k = torch.zeros(n, L + T, *c.k.shape[2:], dtype=c.k.dtype, device=dev)
        v = torch.zeros_like(k)
        mask = torch.zeros(n, 1, Q, L + T, dtype=torch.bool, device=dev)
        index = torch.zeros(n, Q, dtype=torch.long, device=dev)
        valid = torch.zeros(n, Q, dtype=torch.bool, device=dev)
        for g, a in enumerate(members_):
            kk, vv, sees, queries, tail = built[a]
            k[g, : kk.shape[0]], v[g, : vv.shape[0]] = kk, vv
            at = 0
            for keys, lo, hi, count in sees:
                mask[g, 0, at : at + count, :L] = keys
                mask[g, 0, at : at + count, L + lo : L + hi] = True
                at += count
            index[g, :at], valid[g, :at] = queries, True
            index[g, at:], mask[g, 0, at:] = queries[0], mask[g, 0, 0]
        units += n * Q * (L + T)
        real = None if bool(valid.all()) else valid.reshape(-1).nonzero().squeeze(1)
        target = index.reshape(-1) if real is None else index.reshape(-1)[real]
        groups.append(OverlayGroup(k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), mask,
                                   index.reshape(-1), real, target, n, Q))  # fmt: skip
    stride = [0] * len(requests)  # the flat slot of a request's row in a cache of rows L + max(tails) long
    for a in range(len(requests)):
        stride[a] = a * (L + max(tails))
    slots = torch.cat([stride[a] + s for a, s in write_slots])
    return Overlay(groups, len(requests), tails, slots, torch.cat(write_src), units)


def overlay_attention(q: torch.Tensor, o: Overlay, scale: float) -> torch.Tensor:
    """One layer's attention in the overlay layout: ``[T, H, D]`` packed queries in, packed outputs out."""
    out = torch.empty_like(q)
    for g in o.groups:
        qg = q.index_select(0, g.index).view(g.count, g.width, *q.shape[1:]).transpose(1, 2)
        o_ = F.scaled_dot_product_attention(qg, g.k, g.v, attn_mask=g.mask, scale=scale,
                                            enable_gqa=q.shape[1] != g.k.shape[1])  # fmt: skip
        o_ = o_.transpose(1, 2).reshape(-1, *q.shape[1:])
        out.index_copy_(0, g.target, o_ if g.real is None else o_.index_select(0, g.real))
    return out


def _median_us(fn, repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn`` in µs (on a GPU, each call synchronized: a layer's attention, start to end)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def measure_step(c: Captured, repeats: int, backend: AttentionBackend | None = None) -> dict[str, Any]:
    """Today's rows (``backend``: ``sdpa_grouped``, this CPU's) against the overlay on one captured layer call:
    time, key slots read, resident slots."""
    wb, backend = c.wb, backend or GroupedSDPABackend()
    scale = c.q.shape[-1] ** -0.5
    o = build_overlay(c)
    groups = wb.length_groups(c.q.shape[1] * c.q.shape[2])  # today's per-step metadata, built untimed as the overlay's
    error = float((backend.window(c.q, c.k, c.v, wb, scale) - overlay_attention(c.q, o, scale)).abs().max())
    us = functools.partial(_median_us, repeats=repeats, device=c.k.device)

    # the layer's write in each layout: today the queries' K/V and the echoes, scattered into the cache rows; the
    # overlay the queries' K/V only (a draft's own K/V into its tail), into the overlay's cache
    flat_k, flat_v = c.k.clone().view(-1, *c.k.shape[2:]), c.v.clone().view(-1, *c.v.shape[2:])
    size = o.requests * (c.k.shape[1] + max(o.tails))
    flat_o_k = torch.zeros(size, *c.k.shape[2:], dtype=c.k.dtype, device=c.k.device)
    flat_o_v = torch.zeros_like(flat_o_k)

    def write_rows() -> None:
        flat_k.index_copy_(0, wb.write_slots, c.k_fresh.index_select(0, wb.write_src))
        flat_v.index_copy_(0, wb.write_slots, c.v_fresh.index_select(0, wb.write_src))

    def write_overlay() -> None:
        flat_o_k.index_copy_(0, o.write_slots, c.k_fresh.index_select(0, o.write_src))
        flat_o_v.index_copy_(0, o.write_slots, c.v_fresh.index_select(0, o.write_src))

    N, L = c.branches, c.k.shape[1]
    return {
        "rows": int(wb.rows.numel()), "requests": o.requests, "queries": int(c.q.shape[0]),
        "echoes": int(wb.write_slots.numel() - c.q.shape[0]), "groups": {"rows": len(groups), "overlay": len(o.groups)},
        "attention_us": {"rows": us(lambda: backend.window(c.q, c.k, c.v, wb, scale)),
                         "overlay": us(lambda: overlay_attention(c.q, o, scale))},
        "write_us": {"rows": us(write_rows), "overlay": us(write_overlay)},
        "keys_read": {"rows": int(wb.rows.numel()) * L, "overlay": sum(g.count * g.k.shape[2] for g in o.groups)},
        "query_key_units": {"rows": sum(g.count * g.width for g in groups) * L, "overlay": o.units},
        "resident_rows_per_request": {"rows": N, "overlay": 1 + max(o.tails) / L},
        "tails": o.tails, "canvas": L, "max_abs_error": error,
    }  # fmt: skip


#: requests riding a step, binned: the overlay's trade turns with them
BINS = ((1, 1), (2, 8), (9, 16), (17, 10**9))


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per bin of requests riding a step: the layouts' mean time per layer call and their ratios."""

    def ratio(rows: list[dict[str, Any]], key: str) -> float:
        return sum(s[key]["overlay"] for s in rows) / sum(s[key]["rows"] for s in rows)

    bins = {}
    for lo, hi in BINS:
        rows = [s for s in steps if lo <= s["requests"] <= hi]
        if not rows:
            continue
        name = f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi < 10**9 else f"{lo}+")
        bins[name] = {
            "steps": len(rows),
            "attention_us": {lay: statistics.mean(s["attention_us"][lay] for s in rows) for lay in ("rows", "overlay")},
            "write_us": {lay: statistics.mean(s["write_us"][lay] for s in rows) for lay in ("rows", "overlay")},
            "attention_ratio": ratio(rows, "attention_us"),
            "write_ratio": ratio(rows, "write_us"),
            "keys_read_ratio": ratio(rows, "keys_read"),
            "query_key_units_ratio": ratio(rows, "query_key_units"),
        }  # fmt: skip
    tails = [t for s in steps for t in s["tails"]]
    return {"steps": len(steps), "bins": bins, "tail_mean": statistics.mean(tails), "tail_max": max(tails),
            "canvas": steps[0]["canvas"], "resident_rows_max": max(s["resident_rows_per_request"]["overlay"] for s in steps),
            "max_abs_error": max(s["max_abs_error"] for s in steps)}  # fmt: skip


def markdown(args: argparse.Namespace, result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [
        f"# K/V overlay for the drafts' attention: {args.model}, {args.suite}, block {args.block}, batch {args.batch_size}",
        "",
        f"The first {s['steps']} sparse steps with drafts (`drafted(exact=False)`, the first {result['decoded']} training "
        f"items, last layer), each timed as the median of {args.repeats} calls (`benchmarks/overlay_attention.py`). Per layer "
        "call, mean over the steps of a bin; \"×\": overlay over rows (today).",
        "",
        "| requests in the step | steps | attention µs, rows → overlay | × | cache write µs, rows → overlay | × "
        "| key slots read × | query × key work × |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for name, b in s["bins"].items():
        a, w = b["attention_us"], b["write_us"]
        lines.append(f"| {name} | {b['steps']} | {a['rows']:.0f} → {a['overlay']:.0f} | {b['attention_ratio']:.2f} | "
                     f"{w['rows']:.0f} → {w['overlay']:.0f} | {b['write_ratio']:.2f} | {b['keys_read_ratio']:.2f} | "
                     f"{b['query_key_units_ratio']:.2f} |")  # fmt: skip
    lines += ["", f"Tail per request (draft K/V slots): mean {s['tail_mean']:.1f}, max {s['tail_max']} on a canvas of "
              f"{s['canvas']}: at most {s['resident_rows_max']:.2f} rows resident per request, against "
              f"{result['steps'][0]['resident_rows_per_request']['rows']} today. Largest difference from today's "
              f"attention outputs: {s['max_abs_error']:.2e}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-dream")
    p.add_argument("--suite", default="lists")
    p.add_argument("--block", type=positive_int, default=48, help="the block length (the tuned block)")
    p.add_argument("--limit", type=positive_int, default=64, help="training items")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--steps", type=positive_int, default=40, help="captured steps with drafts, at most")
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", type=out_folder, default=str(Path(__file__).parent / "results" / "overlay_attention"))
    args = p.parse_args(argv)
    try:
        load_task(args.suite)  # a misspelt suite is said before the model loads
    except ValueError as err:
        p.error(str(err))
    model, tokenizer = load_for_benchmark(args.model, args.threads)
    model.set_attention_backend("sdpa_grouped")
    _, batches, gen = step_anatomy_batches(model, tokenizer, args.suite, args.limit, args.batch_size)
    config = FastDLLMConfig.drafted(exact=False, max_new_tokens=gen, block_length=args.block)
    with torch.inference_mode():
        steps, decoded = capture(model, batches, config, args.steps)
        if not steps:
            raise ValueError("No step carried a draft: try more items (--limit) or another suite.")
        per_step = [measure_step(c, args.repeats) for c in steps]
    result = {"model": args.model, "suite": args.suite, "block": args.block, "limit": args.limit, "decoded": decoded,
              "batch_size": args.batch_size, "repeats": args.repeats, "summary": summarize(per_step), "steps": per_step}  # fmt: skip
    # the checkpoint's name, not its path: a --model folder would put the report beside the checkpoint, not under --out
    stem = Path(args.out) / f"{Path(args.model).name}_{args.suite}_b{args.batch_size}_{args.limit}"
    write_report(stem, result, markdown(args, result))
    print(markdown(args, result))


if __name__ == "__main__":
    raise SystemExit(run_main(main))
