"""A roofline price of one model forward at a given geometry and accelerator.

Why: a forward's load is exact (``forward_log.ForwardRecord``: rows, query tokens, head slots,
keys), its time is not, and on a GPU it is not linear in the tokens either: a forward reads every
weight once, however few tokens it carries, and turns compute-bound only when its tokens' flops
outweigh that read. ``benchmarks/gpu_projection.py`` prices logged decodes with it, and
``benchmarks/gpu_check.py`` puts the same price beside the step times it measures, so that a GPU
run checks the two efficiency constants and the host time per operation.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_blockbatch.eval.forward_log import ForwardRecord

if TYPE_CHECKING:  # the geometries of the real models import them on call
    from hf_blockbatch.models.dream import DreamConfig
    from hf_blockbatch.models.llada import LLaDAConfig

__all__ = ["Geometry", "Hardware", "kv_residency", "price", "project"]


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
        """The LM head's matrix (``d_model × vocab``); the embedding table, untied, has as many."""
        return self.d_model * self.vocab

    @property
    def kv_bytes_per_token(self) -> int:
        """One cached position of one row: a key and a value per layer."""
        return 2 * self.layers * self.d_kv * self.bytes_per_value

    @property
    def weight_bytes(self) -> int:
        """What the weights occupy: the layers, the head and the embedding table (untied, as both models)."""
        return self.bytes_per_value * (self.body_params + 2 * self.head_params)

    @classmethod
    def from_config(cls, config: LLaDAConfig | DreamConfig, name: str | None = None) -> Geometry:
        """From a LLaDA or Dream config (their field names differ)."""
        if hasattr(config, "d_model"):  # LLaDA
            d, layers, heads, kv_heads = (
                config.d_model,
                config.n_layers,
                config.n_heads,
                config.effective_n_kv_heads,
            )
            mlp, vocab = config.effective_mlp_hidden_size, config.embedding_size or config.vocab_size
        else:  # Dream (Qwen2)
            d, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
            kv_heads, mlp, vocab = (
                config.num_key_value_heads or heads,
                config.intermediate_size,
                config.vocab_size,
            )
        return cls(name or config.model_type, layers, d, d // heads * kv_heads, mlp, vocab)

    @classmethod
    def llada_8b(cls) -> Geometry:
        """LLaDA-8B's shape, read from :class:`LLaDAConfig`'s defaults (no download)."""
        from hf_blockbatch.models.llada import LLaDAConfig

        return cls.from_config(LLaDAConfig(), "LLaDA-8B")  # the defaults are LLaDA-8B's

    @classmethod
    def dream_7b(cls) -> Geometry:
        """Dream-v0-7B's shape, read from :class:`DreamConfig`'s defaults (no download)."""
        from hf_blockbatch.models.dream import DreamConfig

        return cls.from_config(DreamConfig(), "Dream-7B")  # the defaults are Dream-v0-7B's (Qwen2.5-7B's)


@dataclass(frozen=True)
class Hardware:
    """Peak rates, the fractions of them a decode's kernels reach, and the host's time per tensor
    operation (the last three are assumptions until a GPU run measures them)."""

    name: str = "H200"
    bandwidth: float = 4.8e12  # bytes/s, HBM3e
    flops: float = 989e12  # dense bf16
    bandwidth_eff: float = 0.8
    flops_eff: float = 0.6
    op_us: float = 5.0  # host time per tensor operation (eager PyTorch: about 5-10 µs per small CUDA op)
    memory: float = 141e9  # bytes of device memory (HBM3e)


def price(rec: ForwardRecord, g: Geometry, hw: Hardware) -> tuple[float, bool]:
    """``(seconds, compute_bound)`` of one forward on ``hw`` at geometry ``g``: the larger of its bytes
    (every weight but the embedding table, of which only the gathered rows; each row's K/V once per
    layer) over the bandwidth and its flops (2 × body parameters per query token, 2 × head parameters
    per head slot, 4 × layers × d per query-key pair) over the peak, each at its efficiency."""
    b = g.bytes_per_value
    weights = b * (g.body_params + g.head_params) + b * g.d_model * rec.queries
    kv = g.kv_bytes_per_token * sum(rec.keys)
    flops = (
        2 * g.body_params * rec.queries
        + 2 * g.head_params * rec.heads
        + 4 * g.layers * g.d_model * rec.query_key_pairs
    )
    memory_s = (weights + kv) / (hw.bandwidth * hw.bandwidth_eff)
    compute_s = flops / (hw.flops * hw.flops_eff)
    return max(memory_s, compute_s), compute_s > memory_s


def kv_residency(rows_per_request: float, g: Geometry, hw: Hardware, length: int) -> dict[str, float | None]:
    """What a decoder's cache keeps resident per request at ``g``, for a canvas of ``length``
    positions, and how many requests' caches fit beside the weights in ``hw.memory`` (activations and
    the allocator's slack not counted: an upper bound). ``rows_per_request``: cache rows a request
    holds (1 for Fast-dLLM, one per branch for BlockBatch, 1 + drafts with lookahead), as logged
    (``ForwardLog.kv_slots``); 0 for a decoder without a cache, whose batch the K/V do not bound
    (``max_batch`` None). A decoder that reads fewer bytes per forward can still hold more."""
    per_request = rows_per_request * length * g.kv_bytes_per_token
    return {"kv_rows_per_request": rows_per_request, "kv_gb_per_request": per_request / 1e9,
            "max_batch": int(max(hw.memory - g.weight_bytes, 0) // per_request) if per_request else None}  # fmt: skip


def project(
    records: list[ForwardRecord], tail_ops: int, g: Geometry, hw: Hardware, items: int = 1
) -> dict[str, float]:
    """A logged decode's milliseconds per item (``items`` requests in all) in four settings of the
    host: ``gpu``, the forwards' roofline alone (the forward in a CUDA graph, the policy overlapped or
    captured); ``graphed``, plus the policy's operations in series; ``async``, the same graphed forward
    with the policy's operations queued while it runs, up to the policy's first host sync (from there
    on the device waits for the host; a forward that syncs after its layers, or the first forward of a
    decode, overlaps nothing); ``eager``, as PyTorch runs today: each forward at least its own
    operations' host time (at ``g``'s depth), plus the policy's. And what the forwards carried, and
    their host syncs."""
    us = hw.op_us * 1e-6
    priced = [price(r, g, hw) for r in records]
    gpu = sum(t for t, _ in priced)
    overlapped, pending, waited = 0.0, 0.0, True  # the last forward's GPU time not yet spent; spent inside it
    for r, (t, _) in zip(records, priced):
        if r.after_forward and not waited:
            overlap = r.policy_ops - r.serial_policy_ops
            overlapped += max(pending, overlap * us) + r.serial_policy_ops * us
        else:
            overlapped += pending + r.policy_ops * us
        pending, waited = t, r.late_syncs > 0
    overlapped += pending + tail_ops * us
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
        "async_ms_item": 1e3 * overlapped / items,
        "policy_syncs_per_forward": statistics.fmean(r.policy_syncs for r in records),
        "serial_ops_per_forward": statistics.fmean(r.serial_policy_ops for r in records),
        "model_syncs_per_forward": statistics.fmean(r.model_syncs for r in records),
        "late_sync_share": sum(r.late_syncs > 0 for r in records) / n,
        "eager_ms_item": 1e3 * (eager_forwards + policy) / items,
    }
