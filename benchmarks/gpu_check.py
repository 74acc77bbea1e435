"""GPU check of the model layer (one H200, under 8 minutes; random weights, no download).

1. Agreement: every window-attention backend available on the GPU (flash varlen, torch varlen,
   padded SDPA) against the float32 reference path, on a 2-layer model of LLaDA-8B width in bf16,
   with left-padded rows and a row subset. Reports max |Δ logits| per backend.
2. Latency: LLaDA-8B geometry (32 layers, d 4096, vocab 126464) in bf16, canvas 512 + 256; one
   packed window step with windows 4+8+16+32+64+128 (BlockBatch's branches) against one window
   of 32 (Fast-dLLM dual), per backend; one window of 32 or 64 with 0..3 lookahead draft rows;
   and one full forward for scale.
3. Decoding: ``generate`` end to end on the GPU in bf16 (LLaDA-8B width, ``--decode-layers``
   layers, random weights), every strategy and cache mode, a batch of 4 left-padded prompts and
   one of them alone: NFE, wall time and the policy's share per call, whether the padded batch
   gives the alone tokens (bf16 kernels may round differently per shape: reported, not asserted),
   and whether the window backends decode the same tokens; with dense and sparse window queries, and sampled with
   keyed noise (``seed``: the padded batch and the drafts should sample the alone and plain tokens).
   Section 2 also times a sparse query step (a quarter of each window's positions).

Writes ``benchmarks/results/gpu_check.json`` (or ``$OUT/gpu_check.json`` when ``OUT`` is set)
after every section, and a section that fails is recorded with its error while the others still
run: a lease is never spent for nothing. Usage, from the repository root (on a machine where the
package is not installed, ``PYTHONPATH=.`` finds it)::

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py [--layers 32] [--repeats 20] [--decode-layers 8]

4. Overlay: the lookahead drafts' K/V as a tail of their main row (``overlay_attention.py``, RESULTS §36), the last
   layer's attention of captured drafted steps in the model's backend against the overlay's masked SDPA, at batch
   1, 8 and 32.

5. Out of memory: a drafted batch whose K/V cache is twice the free GPU memory, at LLaDA-8B width (2 layers): the
   error ``generate`` raises (its type, and whether it gives the free memory and the requests that fit:
   ``generation/memory.py``). Not in the dry run: a CPU allocation that size may succeed lazily and be killed later.

``--dry-run`` runs sections 2 to 4 on this machine's CPU at a small width, to check the script.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

import hf_blockbatch as hb
from hf_blockbatch.attention import available_backends
from hf_blockbatch.eval.forward_log import ForwardLog
from hf_blockbatch.eval.roofline import Geometry, Hardware, price, project
from hf_blockbatch.eval.script_args import positive_int, probability, run_main


def llada_config(layers: int, vocab: int = 126464) -> hb.LLaDAConfig:
    return hb.LLaDAConfig(n_layers=layers, vocab_size=vocab, embedding_size=vocab, max_sequence_length=4096)


def priced(model, fn, measured_ms: float) -> dict:
    """A measured step beside its roofline price (``hf_blockbatch.eval.roofline``, H200 defaults) and its
    host operations, from one more, logged call: how far the projection of RESULTS §20 is off, and the
    host time per operation a launch-bound step implies."""
    with ForwardLog(model) as log:
        fn()
    rec = log.records[-1]
    seconds, compute_bound = price(rec, Geometry.from_config(model.config), Hardware())
    ops = rec.forward_ops()
    return {"measured_ms": measured_ms, "roofline_ms": 1e3 * seconds, "compute_bound": compute_bound,
            "query_tokens": rec.queries, "forward_ops": ops, "us_per_op_if_launch_bound": 1e3 * measured_ms / ops}  # fmt: skip


def agreement(device: torch.device) -> dict:
    torch.manual_seed(0)
    with device:
        model = hb.LLaDAModelLM(llada_config(2, vocab=32000)).to(torch.bfloat16).eval()
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
            # the same windows as sparse queries (forward_positions): the same packed metadata
            pos = torch.arange(L, device=device)
            inside = (pos >= starts[:, None]) & (pos < ends[:, None])
            cache = model.new_cache(B, L, mask)
            model(ids, attention_mask=mask, cache=cache)
            sparse = model.forward_positions(ids, inside, inside, cache, rows=rows).logits.float()
        if ref is None:
            ref = out
        results[name] = float((out - ref).abs().max())
        results[f"{name}_positions"] = float((sparse - ref).abs().max())
    return results


def latency(device: torch.device, layers: int, repeats: int, config: hb.LLaDAConfig | None = None,
            dtype: torch.dtype = torch.bfloat16) -> dict:  # fmt: skip
    """Section 2, at LLaDA-8B geometry (``config``: another one, as the dry run's small width)."""
    torch.manual_seed(0)
    config = config or llada_config(layers)
    with device:  # 8B parameters: made on the GPU, not initialised on the CPU first
        model = hb.LLaDAModelLM(config).to(dtype).eval()
    Lp, G = 512, 256
    L = Lp + G
    sizes = [4, 8, 16, 32, 64, 128]
    ids = torch.randint(0, config.vocab_size - 8, (len(sizes), L), device=device)
    starts = torch.full((len(sizes),), Lp, device=device)
    ends = starts + torch.tensor(sizes, device=device)
    out = {"params_billion": sum(p.numel() for p in model.parameters()) / 1e9, "canvas": L}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        sync()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        return (time.perf_counter() - t) / repeats * 1000

    with torch.no_grad():
        cache = model.new_cache(len(sizes), L)
        model(ids, cache=cache)
        out["full_forward_6rows_ms"] = timed(lambda: model(ids))
        out["full_forward_1row_ms"] = timed(lambda: model(ids[:1]))
        out["projection"] = {"full_forward_1row": priced(model, lambda: model(ids[:1]), out["full_forward_1row_ms"])}
        for name in available_backends(device, dtype):
            if name == "reference":
                continue
            model.set_attention_backend(name)
            packed = timed(lambda: model.forward_windows(ids, starts, ends, cache))
            single = timed(
                lambda: model.forward_windows(ids, starts[3:4], ends[3:4], cache, rows=torch.tensor([3], device=device))
            )
            # sparse window queries: the same six windows, each querying a quarter of its positions
            # (a window mid-decoding), spread over it
            pos = torch.arange(L, device=device)
            inside = (pos >= starts[:, None]) & (pos < ends[:, None])
            quarter = inside & ((pos - Lp) % 4 == 0)
            sparse = timed(lambda q=quarter: model.forward_positions(ids, q, None, cache))
            # lookahead (issue 16): one request's window of 32 and of 64 with 0..3 draft rows beside it;
            # drafts save forwards only while a step with them costs about what one without them does
            drafts = {}
            for w in (32, 64):
                for k in range(4):
                    rows = torch.arange(k + 1, device=device)
                    s0, e0 = torch.full_like(rows, Lp), torch.full_like(rows, Lp + w)
                    # (looked up at each call: a log of the call wraps the model's method)
                    def step(r=rows, a=s0, b=e0):
                        return model.forward_windows(ids, a, b, cache, rows=r)
                    drafts[f"b{w}_rows{k + 1}_ms"] = timed(step)
                    out["projection"][f"{name}_b{w}_rows{k + 1}"] = priced(model, step, drafts[f"b{w}_rows{k + 1}_ms"])
            out["projection"][f"{name}_packed_4_to_128"] = priced(
                model, lambda: model.forward_windows(ids, starts, ends, cache), packed)
            out["projection"][f"{name}_sparse_quarter"] = priced(
                model, lambda q=quarter: model.forward_positions(ids, q, None, cache), sparse)  # fmt: skip
            out[name] = {"packed_4_to_128_ms": packed, "single_32_ms": single, "ratio": packed / single,
                         "sparse_quarter_4_to_128_ms": sparse, "sparse_query_tokens": int(quarter.sum()),
                         "lookahead": drafts}  # fmt: skip
    return out


def random_llada(device: torch.device, dtype: torch.dtype, layers: int, width: int) -> tuple[hb.LLaDAModelLM, int]:
    """A LLaDA of ``width`` (heads of 128) with random weights, seeded, and its vocabulary size (LLaDA-8B's on a GPU)."""
    torch.manual_seed(0)
    vocab = 126464 if device.type == "cuda" else 4096
    cfg = hb.LLaDAConfig(d_model=width, n_heads=width // 128, n_kv_heads=width // 128, n_layers=layers,
                         mlp_hidden_size=width * 11 // 4, vocab_size=vocab, embedding_size=vocab,
                         max_sequence_length=4096, mask_token_id=vocab - 1, eos_token_id=vocab - 2,
                         pad_token_id=vocab - 2)  # fmt: skip
    with device:  # parameters made where they run (an 8B-wide model is slow to initialise on the CPU)
        return hb.LLaDAModelLM(cfg).to(dtype).eval(), vocab


def overlay(device: torch.device, dtype: torch.dtype, layers: int, width: int, threshold: float, G: int,
            batches: tuple[int, ...] = (1, 8, 32), steps: int = 4, repeats: int = 10) -> dict:  # fmt: skip
    """Section 4. The drafts' K/V as a tail of their main row (``benchmarks/overlay_attention.py``, RESULTS §36), on
    the GPU: on this project's CPU the overlay's masked attention lost at batch 32 (query x key work), but a GPU
    reads keys in place and is memory-bound at these query counts, and the overlay holds 1.7-1.8 rows of K/V per
    request instead of 4. Per batch size, the first ``steps`` drafted steps of a random-weight decode
    (``drafted(exact=False)``, prompts of 64 tokens), the last layer's attention timed in the model's own backend
    against the overlay's masked SDPA, with their largest difference."""
    import overlay_attention as probe  # benchmarks/ is the script's folder

    model, vocab = random_llada(device, dtype, layers, width)
    config = hb.FastDLLMConfig.drafted(exact=False, max_new_tokens=G, threshold=threshold)
    out: dict = {"backend": model.attention_backend.name}
    for batch in batches:
        ids = torch.randint(0, vocab - 8, (batch, 64), device=device)
        with torch.inference_mode():
            captured, _ = probe.capture(model, [(ids, torch.ones_like(ids))], config, steps)
            per_step = [probe.measure_step(c, repeats, model.attention_backend) for c in captured]
        out[f"batch_{batch}"] = probe.summarize(per_step) if per_step else {"error": "no step carried a draft"}
        del captured
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def out_of_memory(device: torch.device, G: int = 256, prompt: int = 768) -> dict:
    """Section 5. ``drafted()`` on a batch whose cache needs twice the free memory: the cache is allocated before any
    forward, so this spends no compute. Reports the error ``generate`` raised."""
    from hf_blockbatch.generation.memory import cache_bytes_per_row

    model, vocab = random_llada(device, torch.bfloat16, 2, 4096)
    per_request = 4 * cache_bytes_per_row(model, prompt + G)
    batch = -(-2 * torch.cuda.mem_get_info(device)[0] // per_request)
    ids = torch.randint(0, vocab - 8, (batch, prompt), device=device)
    try:
        model.generate(ids, generation_config=hb.FastDLLMConfig.drafted(max_new_tokens=G))
    except RuntimeError as error:
        text = str(error)
        return {"requests": batch, "type": type(error).__name__, "explained": text.startswith("Out of memory for the K/V"),
                "says_what_fits": "is free there" in text, "message": text}  # fmt: skip
    return {"requests": batch, "error": "no out-of-memory error"}


def decoding(device: torch.device, dtype: torch.dtype, layers: int, width: int, threshold: float, G: int) -> dict:
    """Section 3. With random weights the softmax is near uniform, so a step commits about one token
    even at the low default threshold (as ``policy_overhead.py --random``): the policy's worst case,
    many cheap steps. Correctness (batch vs alone, backends agreeing) does not depend on it."""
    model, vocab = random_llada(device, dtype, layers, width)
    lengths = [96, 64, 80, 96]
    Lp = max(lengths)
    ids = torch.randint(0, vocab - 8, (len(lengths), Lp), device=device)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, Lp - n :] = 1
    ids = ids.masked_fill(mask == 0, vocab - 2)
    configs = {
        "vanilla": hb.VanillaDiffusionConfig(max_new_tokens=G, steps=G // 2, block_length=32),
        "fast_dllm_none": hb.FastDLLMConfig(max_new_tokens=G, cache="none", threshold=threshold),
        "fast_dllm_prefix": hb.FastDLLMConfig(max_new_tokens=G, cache="prefix", threshold=threshold),
        "fast_dllm_dual": hb.FastDLLMConfig(max_new_tokens=G, threshold=threshold),
        "blockbatch": hb.BlockBatchConfig(max_new_tokens=G, threshold=threshold),
        "blockbatch_divergence": hb.BlockBatchConfig(max_new_tokens=G, threshold=threshold, refresh="divergence"),
        "fast_dllm_dual_sparse": hb.FastDLLMConfig(max_new_tokens=G, threshold=threshold, window_queries="sparse"),
        "blockbatch_sparse": hb.BlockBatchConfig(max_new_tokens=G, threshold=threshold, window_queries="sparse"),
        # the shipped beyond-the-paper point (RESULTS §11): three branches, guards, sparse r 6, pruning
        "blockbatch_lean": hb.BlockBatchConfig.lean(max_new_tokens=G, threshold=threshold),
        # lookahead draft rows (RESULTS §12): Fast-dLLM's tokens in fewer forwards (bf16 may round a
        # draft row differently from the row alone: reported as same_tokens_as_fast_dllm_dual)
        "fast_dllm_dual_lookahead2": hb.FastDLLMConfig(max_new_tokens=G, threshold=threshold, lookahead=2),
        # ... with sparse queries (RESULTS §13): sparse Fast-dLLM's tokens, the parents' K/V echoed
        "fast_dllm_dual_sparse_lookahead3": hb.FastDLLMConfig(max_new_tokens=G, threshold=threshold, lookahead=3,
                                                              window_queries="sparse", requery_radius=6),
        "fast_dllm_dual_sparse_r6": hb.FastDLLMConfig(max_new_tokens=G, threshold=threshold, window_queries="sparse",
                                                      requery_radius=6),
        # contained drafts (RESULTS §16): fewer forwards again, no longer sparse Fast-dLLM's tokens
        "fast_dllm_drafted_contained": hb.FastDLLMConfig.drafted(exact=False, max_new_tokens=G, threshold=threshold,
                                                                 early_stop=False),
        # the same drafts with dense window queries (RESULTS §22): projected faster than the sparse ones at
        # batch 1 under eager PyTorch (fewer host operations), slower once forwards are graphed (more tokens)
        "fast_dllm_drafted_contained_dense": hb.FastDLLMConfig(max_new_tokens=G, threshold=threshold, lookahead=3,
                                                               lookahead_max_masks=16, lookahead_accept="contained"),
        # sampled with keyed noise (generation/noise.py): the padded batch samples what each request samples alone,
        # and the drafts sample sparse Fast-dLLM's tokens (up to bf16 rounding at a near tie)
        "fast_dllm_dual_sparse_r6_sampled": hb.FastDLLMConfig(max_new_tokens=G, threshold=threshold, temperature=0.7,
                                                              seed=0, window_queries="sparse", requery_radius=6),
        "fast_dllm_dual_sparse_lookahead3_sampled": hb.FastDLLMConfig(
            max_new_tokens=G, threshold=threshold, temperature=0.7, seed=0, lookahead=3, window_queries="sparse",
            requery_radius=6),
    }
    backends = [b for b in available_backends(device, dtype) if b != "reference"]
    out: dict = {"params_billion": sum(p.numel() for p in model.parameters()) / 1e9, "backends": backends}
    for name, gen_cfg in configs.items():
        runs = {}
        for backend in backends:
            model.set_attention_backend(backend)
            model.generate(ids[:1], attention_mask=mask[:1], generation_config=gen_cfg)  # warm-up
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            batch = model.generate(ids, attention_mask=mask, generation_config=gen_cfg, return_dict_in_generate=True)
            wall = time.perf_counter() - t
            alone = model.generate(ids[1:2, Lp - lengths[1] :], generation_config=gen_cfg, return_dict_in_generate=True)
            forward = batch.stats[0]["forward_seconds"]
            runs[backend] = {
                "nfe": batch.nfe.tolist(),
                "batch_seconds": wall,
                "policy_share": 1 - forward / wall,
                "padded_equals_alone": bool(torch.equal(batch.sequences[1, Lp:], alone.sequences[0, lengths[1] :])),
                "tokens": batch.sequences[:, Lp:],
            }
            if backend == backends[0]:  # the decode priced by the roofline of RESULTS §20, beside its time
                with ForwardLog(model) as log:
                    model.generate(ids, attention_mask=mask, generation_config=gen_cfg)
                    log.end_decode()
                p = project(log.records, log.tail_ops, Geometry.from_config(model.config), Hardware())
                keep = ("gpu_ms_item", "graphed_ms_item", "async_ms_item", "eager_ms_item", "policy_ops_per_forward",
                        "forward_ops_per_forward", "policy_syncs_per_forward", "serial_ops_per_forward")
                runs[backend]["projection"] = {"measured_ms": 1e3 * wall, **{k: p[k] for k in keep}}
        first = runs[backends[0]]["tokens"]
        for r in runs.values():
            r["same_tokens_as_" + backends[0]] = bool(torch.equal(r.pop("tokens"), first))
        out[name] = runs
        if name == "fast_dllm_dual":
            dual_tokens = first
        if name.startswith("fast_dllm_dual_lookahead"):
            runs["same_tokens_as_fast_dllm_dual"] = bool(torch.equal(first, dual_tokens))
        if name == "fast_dllm_dual_sparse_lookahead3":
            sparse_lookahead_tokens = first
        if name == "fast_dllm_dual_sparse_r6":
            runs["same_tokens_as_fast_dllm_dual_sparse_lookahead3"] = bool(torch.equal(first, sparse_lookahead_tokens))
        if name == "fast_dllm_dual_sparse_r6_sampled":
            sampled_tokens = first
        if name == "fast_dllm_dual_sparse_lookahead3_sampled":
            runs["same_tokens_as_fast_dllm_dual_sparse_r6_sampled"] = bool(torch.equal(first, sampled_tokens))
        print(name, json.dumps(runs), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=20)
    parser.add_argument("--decode-layers", type=positive_int, default=8)
    parser.add_argument("--threshold", type=probability, default=0.02)
    parser.add_argument("--decode-new-tokens", type=positive_int, default=128)
    parser.add_argument("--dry-run", action="store_true", help="sections 2 to 4 only, on the CPU, at width 256")
    args = parser.parse_args(argv)
    if args.dry_run:
        cpu = torch.device("cpu")
        small = hb.LLaDAConfig(d_model=256, n_heads=2, n_kv_heads=2, n_layers=2, mlp_hidden_size=704, vocab_size=4096,
                               embedding_size=4096, max_sequence_length=4096, mask_token_id=4095, eos_token_id=4094,
                               pad_token_id=4094)  # fmt: skip
        report = {"dry_run_cpu": {"latency": latency(cpu, 2, 1, small, torch.float32),
                                  **decoding(cpu, torch.float32, 2, 256, args.threshold, 32),
                                  "overlay": overlay(cpu, torch.float32, 2, 256, args.threshold, 32, (1, 4), 2, 2)}}  # fmt: skip
        print(json.dumps(report, indent=1))
        return
    if not torch.cuda.is_available():
        raise SystemExit("No CUDA device: this check needs a GPU.")
    device = torch.device("cuda")
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "backends": available_backends(device, torch.bfloat16),
    }
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    sections = {
        "agreement_max_abs_logit_diff_vs_reference": lambda: agreement(device),
        "latency": lambda: latency(device, args.layers, args.repeats),
        "decoding": lambda: decoding(
            device, torch.bfloat16, args.decode_layers, 4096, args.threshold, args.decode_new_tokens
        ),
        "overlay": lambda: overlay(device, torch.bfloat16, args.decode_layers, 4096, args.threshold, args.decode_new_tokens),
        "out_of_memory": lambda: out_of_memory(device),
    }
    for name, section in sections.items():
        try:
            report[name] = section()
        except Exception as error:  # recorded, and the next section still runs
            logging.exception("section %s failed", name)
            report[name] = {"error": f"{type(error).__name__}: {error}"}
        torch.cuda.empty_cache()
        out.write_text(json.dumps(report, indent=1))
        print(json.dumps({name: report[name]}, indent=1), flush=True)


if __name__ == "__main__":
    raise SystemExit(run_main(main))
