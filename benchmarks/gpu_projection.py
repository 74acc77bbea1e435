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
  overlap the GPU's work); *eager*, as PyTorch runs today: each forward takes at least its own
  operations' host time (the logged per-layer operations repeated to the target's depth: a deep
  model at batch 1 is launch-bound without graphs), plus the policy's. The decodes are logged with
  the padded SDPA backend (``--backend``), which, like a GPU's varlen kernel, issues the same
  operations per layer whatever the step's window lengths.

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
import json
import logging
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import hf_blockbatch as hb
from hf_blockbatch.eval.forward_log import ForwardLog, ForwardRecord
from hf_blockbatch.eval.runner import _encode, load_task
from hf_blockbatch.generation.configs import config_from_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a sibling script: its named configs
import beyond_paper  # noqa: E402

logger = logging.getLogger("gpu_projection")


@dataclass(frozen=True)
class Geometry:
    """What a forward of a model of this shape reads and computes (bf16 weights and K/V)."""

    name: str
    layers: int
    d_model: int
    d_kv: int  # key (= value) width per layer: KV heads × head size
    mlp_hidden: int
    vocab: int
    bytes_per_value: int = 2

    @property
    def body_params(self) -> int:
        """Per-token matrix parameters of the layers: q and o (d × d), k and v (d × d_kv), and a gated MLP."""
        d = self.d_model
        return self.layers * (2 * d * d + 2 * d * self.d_kv + 3 * d * self.mlp_hidden)

    @property
    def head_params(self) -> int:
        return self.d_model * self.vocab

    @classmethod
    def llada_8b(cls) -> Geometry:
        c = hb.LLaDAConfig()  # the defaults are LLaDA-8B's
        return cls("LLaDA-8B", c.n_layers, c.d_model, c.d_model // c.n_heads * c.effective_n_kv_heads,
                   c.mlp_hidden_size, c.embedding_size or c.vocab_size)  # fmt: skip

    @classmethod
    def dream_7b(cls) -> Geometry:
        c = hb.DreamConfig()  # the defaults are Dream-v0-7B's (Qwen2.5-7B's)
        return cls("Dream-7B", c.num_hidden_layers, c.hidden_size,
                   c.hidden_size // c.num_attention_heads * c.num_key_value_heads, c.intermediate_size, c.vocab_size)  # fmt: skip


@dataclass(frozen=True)
class Hardware:
    """Peak rates and the fractions of them a decode's kernels reach (assumptions, see the module docstring)."""

    name: str = "H200"
    bandwidth: float = 4.8e12  # bytes/s, HBM3e
    flops: float = 989e12  # dense bf16
    bandwidth_eff: float = 0.8
    flops_eff: float = 0.6
    op_us: float = 5.0  # host time per policy tensor operation


def price(rec: ForwardRecord, g: Geometry, hw: Hardware) -> tuple[float, bool]:
    """``(seconds, compute_bound)`` of one forward on ``hw`` at geometry ``g``."""
    b = g.bytes_per_value
    weights = b * (g.body_params + g.head_params) + b * g.d_model * rec.queries  # the embedding rows gathered
    kv = 2 * g.layers * g.d_kv * b * sum(rec.keys)
    flops = (
        2 * g.body_params * rec.queries
        + 2 * g.head_params * rec.heads
        + 4 * g.layers * g.d_model * rec.query_key_pairs
    )
    memory_s = (weights + kv) / (hw.bandwidth * hw.bandwidth_eff)
    compute_s = flops / (hw.flops * hw.flops_eff)
    return max(memory_s, compute_s), compute_s > memory_s


def decode_logged(model: Any, tokenizer: Any, prompts: list[str], cfg_dict: dict[str, Any], gen_length: int,
                  batch_size: int) -> tuple[list[ForwardRecord], int, dict[str, list[int]]]:  # fmt: skip
    """Decode every prompt with one config, logging its forwards; returns the records, the policy's
    operations after the batches' last forwards, and per item its NFE and query tokens (the engine's
    own counts, for the check that the log saw every query token)."""
    cfg = config_from_dict({"max_new_tokens": gen_length, **cfg_dict})
    cfg.validate()
    counts: dict[str, list[int]] = {"nfe": [], "query_tokens": []}
    with ForwardLog(model) as log, torch.inference_mode():
        for b0 in range(0, len(prompts), batch_size):
            ids, mask = _encode(tokenizer, prompts[b0 : b0 + batch_size], torch.device("cpu"))
            out = model.generate(ids, mask, generation_config=cfg, return_dict_in_generate=True)
            log.end_decode()
            counts["nfe"] += out.nfe.tolist()
            counts["query_tokens"] += [int(st["query_tokens"]) for st in out.stats]
    return log.records, log.tail_ops, counts


def project(
    records: list[ForwardRecord], tail_ops: int, items: int, g: Geometry, hw: Hardware
) -> dict[str, float]:
    """Per item, in three settings of the host: ``gpu`` the forwards' roofline alone (the policy
    overlapped or captured, the forward in a CUDA graph); ``graphed`` plus the policy's operations in
    series; ``eager`` as PyTorch runs today: each forward at least its own operations' host time (at
    the target's depth), plus the policy's. And what the forwards carried."""
    us = hw.op_us * 1e-6
    priced = [price(r, g, hw) for r in records]
    gpu = sum(t for t, _ in priced)
    host_bound = [r.forward_ops(g.layers) * us > t for r, (t, _) in zip(records, priced)]
    eager_forwards = sum(max(t, r.forward_ops(g.layers) * us) for r, (t, _) in zip(records, priced))
    ops = sum(r.policy_ops for r in records) + tail_ops
    policy = ops * us
    n = len(records)
    return {
        "forward_calls": n,
        "query_tokens_per_forward": statistics.fmean(r.queries for r in records),
        "rows_per_forward": statistics.fmean(r.rows for r in records),
        "compute_bound_share": sum(c for _, c in priced) / n,
        "host_bound_share": sum(host_bound) / n,
        "policy_ops_per_forward": ops / n,
        "forward_ops_per_forward": statistics.fmean(r.forward_ops(g.layers) for r in records),
        "gpu_ms_item": 1e3 * gpu / items,
        "policy_ms_item": 1e3 * policy / items,
        "graphed_ms_item": 1e3 * (gpu + policy) / items,
        "eager_ms_item": 1e3 * (eager_forwards + policy) / items,
    }


def render(report: dict[str, Any]) -> str:
    g, hw, base = report["geometry"], report["hardware"], report["baseline"]
    lines = [f"# GPU projection: {report['model']} trajectories priced at {g['name']} on {hw['name']}, batch {report['batch_size']}",
             "", f"{report['limit']} training items per suite. A forward's GPU time is max(bytes / ({hw['bandwidth'] / 1e12:.1f} TB/s × "
             f"{hw['bandwidth_eff']}), flops / ({hw['flops'] / 1e12:.0f} TFLOPS × {hw['flops_eff']})); a tensor operation "
             f"takes {hw['op_us']} µs of host time. *gpu*: the forwards alone; *graphed*: plus the policy's operations "
             "in series; *eager*: each forward at least its own operations' host time, plus the policy's. A projection "
             "from exact counts, not a measurement (the script's docstring says what it leaves out). Ratios "
             f"against `{base}` on the same items.", ""]  # fmt: skip
    for suite, rows in report["suites"].items():
        b = rows[base]
        lines += [f"## {suite}", "", "| config | NFE | NFE × | query tok × | tokens / forward | compute-bound | host-bound "
                  "(eager) | policy ops / forward | gpu ms/item | policy ms/item | gpu × | graphed × | eager × |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, r in rows.items():
            x = {
                k: r[k] / b[k]
                for k in ("nfe", "query_tokens", "gpu_ms_item", "graphed_ms_item", "eager_ms_item")
            }
            lines.append(f"| {name} | {r['nfe']:.2f} | {x['nfe']:.3f} | {x['query_tokens']:.2f} | "
                         f"{r['query_tokens_per_forward']:.0f} | {100 * r['compute_bound_share']:.0f} % | "
                         f"{100 * r['host_bound_share']:.0f} % | {r['policy_ops_per_forward']:.0f} | "
                         f"{r['gpu_ms_item']:.2f} | {r['policy_ms_item']:.2f} | {x['gpu_ms_item']:.3f} | "
                         f"{x['graphed_ms_item']:.3f} | {x['eager_ms_item']:.3f} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--suites", nargs="+", default=["arith", "code", "lists"])
    p.add_argument("--limit", type=int, default=64, help="training items per suite")
    p.add_argument(
        "--configs",
        nargs="+",
        default=["fd_es_b64", "fd_es_b64_sq_r6"],
        help="named configs of benchmarks/beyond_paper.py or entries of --config-file",
    )
    p.add_argument("--config-file", help='JSON {"name": {"strategy": ..., option: value}} of extra configs')
    p.add_argument("--baseline", default="fd_es_b64")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument(
        "--geometry",
        choices=["auto", "llada-8b", "dream-7b"],
        default="auto",
        help="the large model to price at (auto: the checkpoint's family)",
    )
    for field, default in asdict(Hardware()).items():
        if field != "name":
            p.add_argument("--" + field.replace("_", "-"), type=float, default=default)
    p.add_argument("--backend", default="sdpa",
                   help="window attention backend of the logged decodes: the padded one issues the same operations "
                        "per layer whatever the windows, as a GPU's varlen kernel does (the CPU's default, "
                        "sdpa_grouped, calls attention once per distinct window length)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/gpu_projection")
    p.add_argument("--tag", default="", help="suffix of the output files' names")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    configs = dict(beyond_paper.CONFIGS)
    if args.config_file:
        configs.update(json.loads(Path(args.config_file).read_text(encoding="utf-8")))
    names = list(dict.fromkeys([args.baseline, *args.configs]))
    unknown = [c for c in names if c not in configs]
    if unknown:
        p.error(
            f"unknown config(s) {unknown}: name entries of benchmarks/beyond_paper.py's CONFIGS or of --config-file"
        )
    hw = Hardware(**{f: getattr(args, f) for f in asdict(Hardware()) if f != "name"})

    from hf_blockbatch.hub import load_model

    model, tokenizer = load_model(args.model, device="cpu", dtype=torch.float32)
    model.set_attention_backend(args.backend)
    family = "dream-7b" if model.config.model_type.lower() == "dream" else "llada-8b"
    geometry = {"llada-8b": Geometry.llada_8b, "dream-7b": Geometry.dream_7b}[
        family if args.geometry == "auto" else args.geometry]()  # fmt: skip
    chat = bool(getattr(tokenizer, "chat_template", None))
    report: dict[str, Any] = {"model": args.model, "limit": args.limit, "batch_size": args.batch_size, "backend": args.backend,
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
            logged = sum(r.queries for r in records) - model.logit_shift * sum(
                r.rows for r in records if r.kind == "windows"
            )
            if logged != sum(counts["query_tokens"]):  # the log and the engine count the same positions
                raise RuntimeError(f"{suite} {name}: the forwards carried {logged} query tokens, the engine counted "
                                   f"{sum(counts['query_tokens'])}")  # fmt: skip
            row = {"nfe": statistics.fmean(counts["nfe"]), "query_tokens": statistics.fmean(counts["query_tokens"]),
                   **project(records, tail, len(prompts), geometry, hw)}  # fmt: skip
            report["suites"][suite][name] = row
            logger.info("%s %-36s nfe %5.2f  tok/fwd %5.0f  gpu %6.2f  graphed %6.2f  eager %6.2f ms/item", suite, name,
                        row["nfe"], row["query_tokens_per_forward"], row["gpu_ms_item"], row["graphed_ms_item"],
                        row["eager_ms_item"])  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{Path(args.model).name}_{args.limit}_b{args.batch_size}{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(render(report))
    logger.info("wrote %s.{json,md}", stem)
    return report


if __name__ == "__main__":
    main()
