"""Which window-attention path is fastest on this CPU for BlockBatch's windows?

Compares, for one layer's attention over a cache of ``L`` positions and the six BlockBatch windows
(4, 8, 16, 32, 64, 128):

* ``sdpa``: the library's padded path (every row padded to the longest window, one SDPA call);
* ``sdpa_grouped``: the library's grouped path (one SDPA call per distinct window length);
* ``per_row``: one SDPA call per row on its exact window (no padding waste, a Python loop);
* ``reference``: the library's explicit float32 softmax path;
* ``single_32``: one row, one window of 32 (Fast-dLLM dual), for scale.

Writes ``benchmarks/results/attention_cpu.json``. Usage:
``python benchmarks/attention_cpu.py [--length 384] [--heads 4] [--head-dim 32] [--repeats 200]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_blockbatch.attention import build_window_batch, get_backend
from hf_blockbatch.cache import BranchCache


def timed(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=384)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sizes = [4, 8, 16, 32, 64, 128]
    R, L, H, D = len(sizes), args.length, args.heads, args.head_dim
    cache = BranchCache(1, R, L, H, D)
    cache.layers[0].keys.normal_()
    cache.layers[0].values.normal_()
    starts = torch.full((R,), L - 256)
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
    print(json.dumps(results, indent=1))
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "attention_cpu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
