"""From a generation config to the decoding core's plan: the parts each strategy is made of.

* vanilla: full forwards (no cache), one block size, the fixed-quota rule, no refresh;
* Fast-dLLM: one block size, threshold / factor / quota rule, a cache mode; its block-start full
  forward is a refresh with ``interval = block_length``; with ``lookahead`` K, K draft rows of the
  same block size per request (``policies.Lookahead``);
* BlockBatch: one branch per block size; advance, merge and sync policies; a refresh policy; EOS
  early stop ranking the hitting branches.

The engine runs any plan without knowing which strategy it came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_blockbatch.generation.configs import (
    BlockBatchConfig,
    DiffusionGenerationConfig,
    FastDLLMConfig,
    VanillaDiffusionConfig,
)
from hf_blockbatch.generation.policies import Advance, BranchPolicy, Lookahead, Merge, Prune, Sync
from hf_blockbatch.generation.refresh import Off, Periodic, ReferenceRefresh, make_refresh
from hf_blockbatch.generation.rules import TransferRule, make_rule
from hf_blockbatch.generation.rules.threshold import MANY_MASKS
from hf_blockbatch.generation.stop import StopRule

__all__ = ["DecodePlan", "check_model", "map_size", "plan_from_config"]


@dataclass
class DecodePlan:
    """Everything the core needs to know about a strategy: its parts and its settings."""

    strategy: str
    max_new_tokens: int
    block_sizes: list[int]
    rule: TransferRule
    policies: list[BranchPolicy]
    refresh: Periodic | ReferenceRefresh | Off = field(default_factory=Off)  # refresh.py (AfterCommits, Divergence: Periodic)
    stop: StopRule = field(default_factory=StopRule)
    cache: str = "dual"  # "none" | "prefix" | "dual"
    temperature: float = 0.0
    remasking: str = "low_confidence"
    seed: int | None = None  # keyed sampling noise (noise.py); None: the generator's stream
    advance_after_full: bool = True  # see policies.advance.Advance
    map_k: int = 0  # entries per position of the probability map (0: none is kept)
    # full forwards update the map over the whole generated region (BlockBatch's merges read it
    # anywhere); off, only inside the windows (Lookahead reads its main row's window alone)
    map_everywhere: bool = True
    suppress_logit_ids: list[int] = field(default_factory=list)
    low_confidence_ids: list[int] = field(default_factory=list)
    end_ids: list[int] = field(default_factory=list)  # where a streamed answer ends
    output_trace: bool = False
    # the authors' BlockBatch (``_reference_plan``): a block step skips rows whose window holds no
    # mask (none: no forward); every read slot updates the probability map, decoded ones too
    step_complete_windows: bool = True
    read_all_slots: bool = False
    unshifted_only: bool = False  # the plan restates an algorithm defined only for unshifted models
    # block steps query only the masks they read and the stale decoded positions of the windows
    # (``window_queries="sparse"``, forward.Forwards.positions)
    sparse_queries: bool = False
    requery_radius: int = 0  # and the decoded positions within this many of a read slot
    # draft rows written before each block step (policies/lookahead.py); also one of ``policies``
    lookahead: Lookahead | None = None


def check_model(plan: DecodePlan, model: Any) -> None:
    """Refuse, before any forward, a plan the model cannot run as intended (``model``: any model that implements
    the forward contract of :mod:`hf_blockbatch.models.base`)."""
    if plan.unshifted_only and model.logit_shift:
        raise ValueError(
            "variant='reference' reproduces the authors' LLaDA decoder; their Dream decoder is another algorithm "
            "(docs/reference_variant.md): use variant='ours' with a shifted model such as Dream."
        )
    if plan.sparse_queries and not getattr(model, "supports_position_queries", False):
        raise ValueError(
            f"window_queries='sparse' needs a model with forward_positions ({type(model).__name__} has none): "
            "set window_queries='all'."
        )


def check_config_model(cfg: DiffusionGenerationConfig, model: Any) -> None:
    """:func:`check_model` for a config ``validate()`` accepted: what ``generate`` refuses before its first forward,
    for a run of many configs to refuse before its first decode (the bench and the benchmark scripts, right after the
    model loads), not at that config's turn."""
    check_model(plan_from_config(cfg, [], []), model)


def map_size(merge_threshold: float) -> int:
    """Entries per position in the probability map. A merge takes a token only when the map rates
    it above ``merge_threshold`` t, and fewer than 1/t tokens can each hold more than t, so the top
    ``ceil(1/t) - 1`` entries are exact (the top-1 alone at the default t = 0.5)."""
    return max(1, math.ceil(1.0 / merge_threshold) - 1)


def _rule(cfg: FastDLLMConfig | BlockBatchConfig, steps_per_block: int | None) -> TransferRule:
    if cfg.rule == "localleap":
        from hf_blockbatch.generation.rules.localleap import LocalLeapRule

        rule = LocalLeapRule.from_config(cfg)
        return make_rule("localleap", anchor_threshold=float(rule.anchor_threshold),
                         relaxed_threshold=float(rule.relaxed_threshold), radius=int(rule.radius))  # fmt: skip
    if cfg.rule == "entropy":
        return make_rule("entropy", bound=float(cfg.entropy_bound))
    if getattr(cfg, "threshold", None) is not None:
        many = getattr(cfg, "many_masks_threshold", None)
        if many is None:
            return make_rule("threshold", threshold=float(cfg.threshold))
        masks = cfg.many_masks if cfg.many_masks is not None else MANY_MASKS
        return make_rule("threshold", threshold=float(cfg.threshold), many_masks_threshold=float(many), many_masks=int(masks))
    if getattr(cfg, "factor", None) is not None:
        return make_rule("factor", factor=float(cfg.factor))
    return make_rule("quota", steps_per_block=steps_per_block)


def _eos_rank(cfg: BlockBatchConfig) -> str:
    """What ranks a request's EOS hitters (``stop.StopRule``)."""
    return "widest" if cfg.eos_prefer_widest else cfg.eos_confidence


def plan_from_config(cfg: DiffusionGenerationConfig, eos_ids: list[int], eot_ids: list[int]) -> DecodePlan:
    """The plan of a config that ``validate()`` accepted (its options are not checked again here; a config class
    not of this package is refused). ``eos_ids``, ``eot_ids``: the resolved token ids."""
    common = dict(
        strategy=cfg.strategy,
        max_new_tokens=cfg.max_new_tokens,
        temperature=float(cfg.temperature or 0.0),
        remasking=cfg.remasking,
        seed=None if cfg.seed is None else int(cfg.seed),
        output_trace=bool(cfg.output_trace),
        end_ids=list(eos_ids),
    )
    if isinstance(cfg, VanillaDiffusionConfig):
        steps, block = cfg.resolved()
        steps_per_block = steps // -(-cfg.max_new_tokens // block)
        return DecodePlan(
            **common, block_sizes=[block], cache="none", rule=make_rule("quota", steps_per_block=steps_per_block),
            policies=[Advance()],
            suppress_logit_ids=list(eos_ids) if cfg.logits_eos_inf else [],
            low_confidence_ids=list(eos_ids) + list(eot_ids) if cfg.confidence_eos_eot_inf else [],
        )  # fmt: skip
    if isinstance(cfg, FastDLLMConfig):
        steps_per_block = None if cfg.steps is None else cfg.steps // -(-cfg.max_new_tokens // cfg.block_length)
        after_full = cfg.cache == "none" or bool(cfg.skip_completed_block_step)
        max_masks = None if cfg.lookahead_max_masks is None else int(cfg.lookahead_max_masks)
        # a sampled decode's drafts re-query at the main radius: a forced commit samples from the draft's logits,
        # and staler neighbours spliced forms there (`max(b, b)`; RESULTS §40)
        greedy = common["temperature"] == 0
        radius = None if cfg.lookahead_draft_radius is None or not greedy else int(cfg.lookahead_draft_radius)
        budget = None if cfg.lookahead_query_budget is None else float(cfg.lookahead_query_budget)
        lookahead = (Lookahead(int(cfg.lookahead), max_masks, cfg.lookahead_accept, radius, budget, bool(cfg.lookahead_runner_up))
                     if cfg.lookahead else None)  # fmt: skip
        return DecodePlan(
            **common, block_sizes=[cfg.block_length] * (1 + int(cfg.lookahead)), cache=cfg.cache,
            rule=_rule(cfg, steps_per_block), lookahead=lookahead, map_k=1 if lookahead else 0, map_everywhere=False,
            policies=[*([lookahead] if lookahead else []), Advance(after_full=after_full)], advance_after_full=after_full,
            refresh=make_refresh("periodic", cfg.block_length, 0.0, cached=cfg.cache != "none",
                                 after_commits=cfg.refresh_after_commits),
            stop=StopRule(early_stop=bool(cfg.early_stop)), sparse_queries=cfg.window_queries == "sparse",
            requery_radius=int(cfg.requery_radius),
        )  # fmt: skip
    if isinstance(cfg, BlockBatchConfig) and cfg.variant == "reference":
        return _reference_plan(cfg, common)
    if isinstance(cfg, BlockBatchConfig):
        n = len(cfg.block_sizes)
        after_full = bool(cfg.skip_completed_block_step)
        policies: list[BranchPolicy] = [Advance(after_full=after_full)]
        if n > 1 and cfg.merge:
            confident = None if cfg.merge_source_confidence is None else float(cfg.merge_source_confidence)
            policies.append(Merge(float(cfg.merge_threshold), int(cfg.merge_agreement), confident))
            if not cfg.sync:  # else the sync's advance moves the windows past the merged tokens too
                policies.append(Advance(always=True))
        if n > 1 and cfg.sync:
            policies.append(Sync(int(cfg.sync_threshold)))
            if cfg.prune_after_syncs is not None:  # reads the sync's synced_now: right after it
                policies.append(Prune(int(cfg.prune_after_syncs)))
        return DecodePlan(
            **common, block_sizes=list(cfg.block_sizes), cache="dual", rule=_rule(cfg, None), policies=policies,
            refresh=make_refresh(cfg.refresh, int(cfg.refresh_interval), float(cfg.divergence_threshold), cached=True),
            stop=StopRule(bool(cfg.early_stop), _eos_rank(cfg) if cfg.early_stop and n > 1 else None),
            advance_after_full=after_full, map_k=map_size(float(cfg.merge_threshold)) if cfg.merge else 0,
            sparse_queries=cfg.window_queries == "sparse",
            requery_radius=int(cfg.requery_radius),
        )  # fmt: skip
    raise TypeError(f"Unsupported generation config {type(cfg).__name__}; use one of hf_blockbatch's configs.")


def _reference_plan(cfg: BlockBatchConfig, common: dict) -> DecodePlan:
    """The authors' bulk BlockBatch (docs/reference_variant.md) from the same parts as ours, with
    their options: block sizes sorted (branch 0 = the smallest block, which wins ties); advance
    before the merge after the initial forward too, and after the merge the windows it completed;
    a sync measured in the rule's commits that copies canvas and K/V only; their refresh; EOS
    detected only after block steps and checked before the policies, in bfloat16, ties to the
    smallest block. Their probability map reads a probability <= 0.1 as 0, so a merge takes only
    tokens above ``max(merge_threshold, 0.1)``."""
    sizes = sorted(int(b) for b in cfg.block_sizes)
    n = len(sizes)
    policies: list[BranchPolicy] = [Advance(after_full=True)]
    merge_threshold = max(float(cfg.merge_threshold), 0.1)
    if n > 1 and cfg.merge:
        policies += [Merge(merge_threshold), Advance(always=True)]
    if n > 1 and cfg.sync:
        policies.append(Sync(int(cfg.sync_threshold), count="rule", copy_map=False))
    stop = StopRule(True, "completion" if n > 1 else None, eos_phases=("block",), before_policies=True,
                    eos_dtype=torch.bfloat16, ties="branch")  # fmt: skip
    refresh = make_refresh("reference" if cfg.refresh == "periodic" else "off", int(cfg.refresh_interval), 0.0, True)
    return DecodePlan(
        **common, block_sizes=sizes, cache="dual", rule=_rule(cfg, None), policies=policies, refresh=refresh,
        stop=stop, advance_after_full=True, map_k=map_size(merge_threshold) if n > 1 and cfg.merge else 0,
        step_complete_windows=False, read_all_slots=True, unshifted_only=True,
    )  # fmt: skip
