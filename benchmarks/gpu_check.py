"""GPU check of the model layer (one H200, under 8 minutes; random weights, no download).

1. Agreement: every window-attention backend available on the GPU (flash varlen, torch varlen,
   padded SDPA) against the float32 reference path, on a 2-layer model of LLaDA-8B width in bf16,
   with left-padded rows and a row subset. Reports max |Δ logits| per backend.
2. Latency: LLaDA-8B geometry (32 layers, d 4096, vocab 126464) in bf16, canvas 512 + 256; one
   packed window step with windows 4+8+16+32+64+128 (BlockBatch's branches) against one window
   of 32 (Fast-dLLM dual), per backend; and one full forward for scale.

Writes ``benchmarks/results/gpu_check.json`` (or ``$OUT/gpu_check.json`` when ``OUT`` is set).
Usage: ``python benchmarks/gpu_check.py [--layers 32] [--repeats 20]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import hf_blockbatch as hb
from hf_blockbatch.attention import available_backends


def llada_config(layers: int, vocab: int = 126464) -> hb.LLaDAConfig:
    return hb.LLaDAConfig(n_layers=layers, vocab_size=vocab, embedding_size=vocab, max_sequence_length=4096)


def agreement(device: torch.device) -> dict:
    torch.manual_seed(0)
    model = hb.LLaDAModelLM(llada_config(2, vocab=32000)).to(device, torch.bfloat16).eval()
    B, L = 3, 384
    ids = torch.randint(0, 32000, (B, L), device=device)
    mask = torch.ones(B, L, dtype=torch.long, device=device)
    mask[1, :40] = 0
    rows = torch.tensor([0, 1, 2], device=device)
    starts = torch.tensor([300, 256, 320], device=device)
    ends = torch.tensor([304, 384, 352], device=device)
    results = {}
    ref = None
    for name in ["reference", *[b for b in available_backends(device, torch.bfloat16) if b != "reference"]]:
        model.set_attention_backend(name)
        cache = model.new_cache(B, L, mask)
        with torch.no_grad():
            model(ids, attention_mask=mask, cache=cache)
            out = model.forward_windows(ids, starts, ends, cache, rows=rows).logits.float()
        if ref is None:
            ref = out
        results[name] = float((out - ref).abs().max())
    return results


def latency(device: torch.device, layers: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = hb.LLaDAModelLM(llada_config(layers)).to(device, torch.bfloat16).eval()
    Lp, G = 512, 256
    L = Lp + G
    sizes = [4, 8, 16, 32, 64, 128]
    ids = torch.randint(0, 126000, (len(sizes), L), device=device)
    starts = torch.full((len(sizes),), Lp, device=device)
    ends = starts + torch.tensor(sizes, device=device)
    out = {"params_billion": sum(p.numel() for p in model.parameters()) / 1e9, "canvas": L}

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / repeats * 1000

    with torch.no_grad():
        cache = model.new_cache(len(sizes), L)
        model(ids, cache=cache)
        out["full_forward_6rows_ms"] = timed(lambda: model(ids))
        out["full_forward_1row_ms"] = timed(lambda: model(ids[:1]))
        for name in available_backends(device, torch.bfloat16):
            if name == "reference":
                continue
            model.set_attention_backend(name)
            packed = timed(lambda: model.forward_windows(ids, starts, ends, cache))
            single = timed(
                lambda: model.forward_windows(ids, starts[3:4], ends[3:4], cache, rows=torch.tensor([3], device=device))
            )
            out[name] = {"packed_4_to_128_ms": packed, "single_32_ms": single, "ratio": packed / single}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("No CUDA device: this check needs a GPU.")
    device = torch.device("cuda")
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "backends": available_backends(device, torch.bfloat16),
    }
    report["agreement_max_abs_logit_diff_vs_reference"] = agreement(device)
    print(json.dumps(report, indent=1), flush=True)
    report["latency"] = latency(device, args.layers, args.repeats)
    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
