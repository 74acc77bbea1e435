"""What a decode's forwards would cost at a real model's size on an H200: a roofline price of exact counts.

Why (issue 16): on this CPU a forward's time grows with its query tokens from the first token up,
so a decoder's latency follows its query tokens and its policy; the issue's third point is that a GPU
is different. At LLaDA-8B on an H200 a forward reads 16 GB of weights (about 3.4 ms at 4.8 TB/s)
however few tokens it carries, and turns compute-bound only at a few hundred query tokens. There,
fewer forwards (NFE) should pay at batch 1 whatever the extra rows, and query tokens at batch 32.
No GPU has been lent to this project yet, so this script prices what the tiny checkpoints' decodes
*did*, forward by forward, at a large model's geometry:

* each model forward of a decode is recorded (``hf_blockbatch.eval.forward_log.ForwardLog``): its
  rows, query tokens, the slots sent through the head, each row's keys, and the decoding policy's
  tensor operations since the previous forward. These are exact and machine-independent;
* a forward costs ``max(bytes / bandwidth, flops / peak)``: bytes are the weights (bf16, the head
  included, the embedding table only as gathered) plus every row's K/V read once per layer; flops
  are 2 × body parameters per query token, 2 × d × vocab per head slot, and 4 × layers × d per
  query-key pair (attention's two products);
* a tensor operation costs ``--op-us`` microseconds of host time (eager PyTorch issues a small CUDA
  op in about 5-10 µs). Three settings of the host: *gpu*, the forwards' roofline alone (a forward
  captured in a CUDA graph, the policy overlapped or captured too); *graphed*, plus the policy's
  operations in series (the policy reads results on the host several times a step, so it does not
  overlap the GPU's work); *async*, the graphed forward with the policy's operations queued while it
  runs, up to the policy's first host sync (a read-back: ``forward_log.is_sync``), the rest in series;
  *eager*, as PyTorch runs today: each forward takes at least its own
  operations' host time (the logged per-layer operations repeated to the target's depth: a deep
  model at batch 1 is launch-bound without graphs), plus the policy's. The decodes are logged with
  the padded SDPA backend (``--backend``), which, like a GPU's varlen kernel, issues the same
  operations per layer whatever the step's window lengths.

Beside what a forward reads, what a decoder keeps resident: the cache rows a request holds (logged,
``ForwardLog.kv_slots``: one for Fast-dLLM, one per branch or draft row), their size at the geometry
for a canvas of ``--kv-length`` positions, and the largest batch whose K/V fit beside the weights in
``--memory`` bytes (activations not counted).

What it does not model: the tiny checkpoints' trajectories stand in for the large model's (the
same NFE, query tokens and canvas lengths; a real 8B model commits differently), and kernel
efficiencies beyond the two constants (``--bandwidth-eff``, ``--flops-eff``). It is a projection to
be checked against ``benchmarks/gpu_check.py``'s measured step times when a GPU is lent, not a
measurement. Usage::

    PYTHONPATH=$PWD python benchmarks/gpu_projection.py --model tiny-llada --limit 64 --batch-size 1 \\
        --configs fd_es_b64 fd_es_b64_sq_r6 fd_es_b64_sq_r6_la3_m16_ctr2_q2 fd_es_b64_sq_r6_la6_m16_ctr2_q2 bb_default \\
        --config-file benchmarks/beyond_paper_configs.json

Decodes training items (``task.items("train")``, as ``beyond_paper.py``), writes
``<out>/<model>_<limit>_b<batch>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hf_blockbatch.attention.backends import BACKENDS
from hf_blockbatch.eval.forward_log import ForwardLog, ForwardRecord
from hf_blockbatch.eval.roofline import Geometry, Hardware, kv_residency, project
from hf_blockbatch.eval.runner import _encode, load_for_benchmark, load_task, write_report
from hf_blockbatch.eval.script_args import (
    nonnegative_float,
    out_folder,
    positive_float,
    positive_int,
    probability,
    run_main,
)
from hf_blockbatch.generation.configs import config_from_dict
from hf_blockbatch.tasks import SUITES

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a sibling script: its named configs
import beyond_paper  # noqa: E402

logger = logging.getLogger("gpu_projection")


def decode_logged(model: Any, tokenizer: Any, prompts: list[str], cfg_dict: dict[str, Any], gen_length: int,
                  batch_size: int) -> tuple[list[ForwardRecord], int, dict[str, list[int]]]:  # fmt: skip
    """Decode every prompt with one config, logging its forwards; returns the records, the policy's
    operations after the batches' last forwards, and per item its NFE and query tokens (the engine's
    own counts, for the check that the log saw every query token); and, per batch, its cache's K/V slots
    and its canvases' positions (``kv_slots``, ``canvas_slots``), whose ratio is the cache rows a request holds."""
    cfg = config_from_dict({"max_new_tokens": gen_length, **cfg_dict})
    cfg.validate()
    counts: dict[str, list[int]] = {"nfe": [], "query_tokens": [], "canvas_slots": []}
    with ForwardLog(model) as log, torch.inference_mode():
        for b0 in range(0, len(prompts), batch_size):
            ids, mask = _encode(tokenizer, prompts[b0 : b0 + batch_size], torch.device("cpu"))
            out = model.generate(ids, mask, generation_config=cfg, return_dict_in_generate=True)
            log.end_decode()
            counts["nfe"] += out.nfe.tolist()
            counts["query_tokens"] += [int(st["query_tokens"]) for st in out.stats]
            counts["canvas_slots"].append(ids.shape[0] * (ids.shape[1] + gen_length))
    counts["kv_slots"] = log.kv_slots
    return log.records, log.tail_ops, counts


def render(report: dict[str, Any]) -> str:
    g, hw, base = report["geometry"], report["hardware"], report["baseline"]
    lines = [f"# GPU projection: {report['model']} trajectories priced at {g['name']} on {hw['name']}, batch {report['batch_size']}",
             "", f"{report['limit']} training items per suite. A forward's GPU time is max(bytes / ({hw['bandwidth'] / 1e12:.1f} TB/s × "
             f"{hw['bandwidth_eff']}), flops / ({hw['flops'] / 1e12:.0f} TFLOPS × {hw['flops_eff']})); a tensor operation "
             f"takes {hw['op_us']} µs of host time. *gpu*: the forwards alone; *graphed*: plus the policy's operations "
             "in series; *async*: the policy's operations before its first host sync after a forward overlap that "
             "forward, the rest in series; *eager*: each forward at least its own operations' host time, plus the "
             "policy's. *Syncs*: the policy's host syncs per forward, and its operations from the first one on "
             "(serial). A projection "
             "from exact counts, not a measurement (the script's docstring says what it leaves out). Ratios "
             f"against `{base}` on the same items. *K/V*: the cache rows a request holds (logged), what they occupy at "
             f"{g['name']} for a canvas of {report['kv_length']} positions, and the largest batch whose K/V fit beside "
             f"the weights in {hw['memory'] / 1e9:.0f} GB (activations not counted; – : no cache).", ""]  # fmt: skip
    for suite, rows in report["suites"].items():
        b = rows[base]
        lines += [f"## {suite}", "", "| config | NFE | NFE × | query tok × | tokens / forward | compute-bound | host-bound "
                  "(eager) | policy ops / forward | syncs · serial ops / forward | gpu ms/item | policy ms/item | gpu × | "
                  "graphed × | async × | eager × | K/V rows · GB / request | max batch |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, r in rows.items():
            x = {
                k: r[k] / b[k]
                for k in ("nfe", "query_tokens", "gpu_ms_item", "graphed_ms_item", "async_ms_item", "eager_ms_item")
            }
            lines.append(f"| {name} | {r['nfe']:.2f} | {x['nfe']:.3f} | {x['query_tokens']:.2f} | "
                         f"{r['query_tokens_per_forward']:.0f} | {100 * r['compute_bound_share']:.0f} % | "
                         f"{100 * r['host_bound_share']:.0f} % | {r['policy_ops_per_forward']:.0f} | "
                         f"{r['policy_syncs_per_forward']:.1f} · {r['serial_ops_per_forward']:.0f} | "
                         f"{r['gpu_ms_item']:.2f} | {r['policy_ms_item']:.2f} | {x['gpu_ms_item']:.3f} | "
                         f"{x['graphed_ms_item']:.3f} | {x['async_ms_item']:.3f} | {x['eager_ms_item']:.3f} | "
                         f"{r['kv_rows_per_request']:.2f} · {r['kv_gb_per_request']:.2f} | "
                         f"{'–' if r['max_batch'] is None else r['max_batch']} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--suites", nargs="+", choices=SUITES, default=["arith", "code", "lists"], metavar="SUITE")
    p.add_argument("--limit", type=positive_int, default=64, help="training items per suite")
    p.add_argument(
        "--configs",
        nargs="+",
        default=["fd_es_b64", "fd_es_b64_sq_r6"],
        help="named configs of benchmarks/beyond_paper.py or entries of --config-file",
    )
    p.add_argument("--config-file", help='JSON {"name": {"strategy": ..., option: value}} of extra configs')
    p.add_argument("--baseline", default="fd_es_b64")
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument(
        "--geometry",
        choices=["auto", "llada-8b", "dream-7b"],
        default="auto",
        help="the large model to price at (auto: the checkpoint's family)",
    )
    for field, default in asdict(Hardware()).items():
        if field != "name":  # rates and sizes above 0, efficiencies in (0, 1], a host time per operation >= 0
            kind = probability if field.endswith("_eff") else nonnegative_float if field == "op_us" else positive_float
            p.add_argument("--" + field.replace("_", "-"), type=kind, default=default)
    p.add_argument("--backend", default="sdpa", choices=["auto", *BACKENDS],
                   help="window attention backend of the logged decodes: the padded one issues the same operations "
                        "per layer whatever the windows, as a GPU's varlen kernel does (the CPU's default, "
                        "sdpa_grouped, calls attention once per group of query counts)")  # fmt: skip
    p.add_argument("--kv-length", type=positive_int, default=1024,
                   help="canvas length (prompt + generated) at which to state the resident K/V per request and the "
                        "largest batch whose K/V fit beside the weights (the tiny suites' canvases are 100-160)")  # fmt: skip
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", type=out_folder, default="benchmarks/results/gpu_projection")
    p.add_argument("--tag", default="", help="suffix of the output files' names")
    args = p.parse_args(argv)
    configs = {**beyond_paper.CONFIGS, **beyond_paper.read_config_file(args.config_file)}
    names = list(dict.fromkeys([args.baseline, *args.configs]))
    unknown = [c for c in names if c not in configs]
    if unknown:
        p.error(
            f"unknown config(s) {unknown}: name entries of benchmarks/beyond_paper.py's CONFIGS or of --config-file"
        )
    hw = Hardware(**{f: getattr(args, f) for f in asdict(Hardware()) if f != "name"})

    model, tokenizer = load_for_benchmark(args.model, args.threads)
    model.set_attention_backend(args.backend)
    family = "dream-7b" if model.config.model_type.lower() == "dream" else "llada-8b"
    geometry = {"llada-8b": Geometry.llada_8b, "dream-7b": Geometry.dream_7b}[
        family if args.geometry == "auto" else args.geometry]()  # fmt: skip
    chat = bool(getattr(tokenizer, "chat_template", None))
    report: dict[str, Any] = {"model": args.model, "limit": args.limit, "batch_size": args.batch_size, "backend": args.backend,
                              "kv_length": args.kv_length,
                              "baseline": args.baseline, "geometry": asdict(geometry), "hardware": asdict(hw),
                              "configs": {n: configs[n] for n in names}, "suites": {}}  # fmt: skip
    for suite in args.suites:
        task = load_task(suite)
        items = task.items("train", limit=args.limit)
        prompts = [task.prompt(it, tokenizer, chat=chat) for it in items]
        report["suites"][suite] = {}
        for name in names:
            records, tail, counts = decode_logged(model, tokenizer, prompts, configs[name], int(task.default_gen_length),
                                                  args.batch_size)  # fmt: skip
            logged = sum(r.queries for r in records)
            if logged != sum(counts["query_tokens"]):  # the log and the engine count the same positions
                raise RuntimeError(f"{suite} {name}: the forwards carried {logged} query tokens, the engine counted "
                                   f"{sum(counts['query_tokens'])}")  # fmt: skip
            rows_per_request = sum(counts["kv_slots"]) / sum(counts["canvas_slots"])
            row = {"nfe": statistics.fmean(counts["nfe"]), "query_tokens": statistics.fmean(counts["query_tokens"]),
                   **project(records, tail, geometry, hw, items=len(prompts)),
                   **kv_residency(rows_per_request, geometry, hw, args.kv_length)}  # fmt: skip
            report["suites"][suite][name] = row
            logger.info("%s %-36s nfe %5.2f  tok/fwd %5.0f  gpu %6.2f  graphed %6.2f  async %6.2f  eager %6.2f ms/item",
                        suite, name, row["nfe"], row["query_tokens_per_forward"], row["gpu_ms_item"],
                        row["graphed_ms_item"], row["async_ms_item"], row["eager_ms_item"])  # fmt: skip
    write_report(Path(args.out) / f"{Path(args.model).name}_{args.limit}_b{args.batch_size}{args.tag}", report,
                 render(report))
    return report


if __name__ == "__main__":
    raise SystemExit(run_main(main))
