"""From a generation config to the decoding core's plan: where each strategy's choices live.

* vanilla: full forwards (no cache), one block size, fixed quota per step;
* Fast-dLLM: one block size, threshold/factor/quota, a cache mode; its block-start full forward
  is a refresh with ``refresh_interval = block_length``;
* BlockBatch: one branch per block size, merge, sync, refresh policy, EOS early stop.
"""

from __future__ import annotations

from hf_blockbatch.generation.configs import (
    BlockBatchConfig,
    DiffusionGenerationConfig,
    FastDLLMConfig,
    VanillaDiffusionConfig,
)
from hf_blockbatch.generation.engine import DecodePlan

__all__ = ["plan_from_config"]


def plan_from_config(cfg: DiffusionGenerationConfig, eos_ids: list[int], eot_ids: list[int]) -> DecodePlan:
    common = dict(
        strategy=cfg.strategy,
        max_new_tokens=cfg.max_new_tokens,
        temperature=float(cfg.temperature or 0.0),
        remasking=cfg.remasking,
        output_trace=bool(cfg.output_trace),
    )
    if isinstance(cfg, VanillaDiffusionConfig):
        steps, block = cfg.resolved()
        num_blocks = -(-cfg.max_new_tokens // block)
        return DecodePlan(
            **common,
            block_sizes=[block],
            cache="none",
            threshold=None,
            steps_per_block=steps // num_blocks,
            refresh="off",
            suppress_logit_ids=list(eos_ids) if cfg.logits_eos_inf else [],
            low_confidence_ids=list(eos_ids) + list(eot_ids) if cfg.confidence_eos_eot_inf else [],
        )
    if isinstance(cfg, FastDLLMConfig):
        steps_per_block = None
        if cfg.steps is not None:
            steps_per_block = cfg.steps // -(-cfg.max_new_tokens // cfg.block_length)
        return DecodePlan(
            **common,
            block_sizes=[cfg.block_length],
            cache=cfg.cache,
            threshold=cfg.threshold,
            factor=cfg.factor,
            steps_per_block=steps_per_block,
            refresh="off" if cfg.cache == "none" else "periodic",
            refresh_interval=cfg.block_length,
            early_stop=bool(cfg.early_stop),
            advance_after_full=cfg.cache == "none" or bool(cfg.skip_completed_block_step),
        )
    if isinstance(cfg, BlockBatchConfig):
        return DecodePlan(
            **common,
            block_sizes=list(cfg.block_sizes),
            cache="dual",
            threshold=cfg.threshold,
            factor=cfg.factor,
            merge=bool(cfg.merge),
            merge_threshold=float(cfg.merge_threshold),
            sync=bool(cfg.sync),
            sync_threshold=int(cfg.sync_threshold),
            refresh=cfg.refresh,
            refresh_interval=int(cfg.refresh_interval),
            divergence_threshold=float(cfg.divergence_threshold),
            early_stop=bool(cfg.early_stop),
            eos_confidence=cfg.eos_confidence,
            advance_after_full=bool(cfg.skip_completed_block_step),
            prob_map=bool(cfg.merge),
        )
    raise TypeError(f"Unsupported generation config {type(cfg).__name__}; use one of hf_blockbatch's configs.")
