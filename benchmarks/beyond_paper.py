"""BlockBatch beyond the paper: candidate configs against a *tuned* Fast-dLLM, on training items.

Why this harness (issue 16): the bench compares methods on the 500-item test splits, which is
where defaults are *reported*; they must be *chosen* elsewhere, or they are fitted to the items
they are judged on. This script decodes items drawn from each suite's training generator
(``task.items("train", limit=N)``, never a test question) with named candidate configs, and puts
each next to Fast-dLLM dual cache with early stop at blocks 32 / 64 / 96 on the same items:
accuracy, mean NFE, mean query tokens per request (positions fed through the model, padding
excluded: ``stats["query_tokens"]``) and wall time per item.

Prompts, answer cuts and scoring are the bench's own (``eval.runner``: ``_encode``,
``answer_texts`` with ``end_token_ids``, ``_score_all``), so a number here means what it means in
``benchmarks/RESULTS.md``. Padded batches give the same tokens as batch 1 (a decoding-core
invariant), so ``--batch-size`` changes only the timing.

    PYTHONPATH=$PWD python benchmarks/beyond_paper.py --model tiny-llada --suites arith code lists \
        --limit 120 --configs fd_es_b32 fd_es_b64 fd_es_b96 bb_default bb_16_64

Every (model, suite, limit, config) result is cached under ``<out>/cache/`` by the config's
content, so adding a candidate decodes only that candidate (``--fresh`` re-decodes). Writes
``<out>/<model>_<limit>.json`` and ``.md``.

``--split test`` decodes the suite's test split instead (the first ``--limit`` of its 500 items), to *report*
what the issue measures there, never to choose: the CPU latency target is judged on the test splits, side by
side, like the other four (RESULTS §47); the files are then named ``<model>_test<limit>...``. ``--interleave`` times a
sitting's configs batch by batch, each batch decoded by every config in turn, so that a time ratio compares decodes
made milliseconds apart rather than whole passes made a minute apart (RESULTS §50).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hf_blockbatch.eval.runner import (
    ALL_TASKS,
    _encode,
    _replace_files,
    _score_all,
    check_scoring,
    key_sampling_noise,
    load_for_benchmark,
    load_task,
    paired_points,
    samples,
    write_report,
)
from hf_blockbatch.eval.script_args import nonnegative_int, out_folder, positive_int, read_json, run_main
from hf_blockbatch.eval.stats import paired_difference, paired_time_ratio
from hf_blockbatch.generation.configs import DRAFTED, DRAFTED_CONTAINED, config_from_dict
from hf_blockbatch.generation.outputs import answer_texts, end_token_ids
from hf_blockbatch.generation.plans import check_config_model

logger = logging.getLogger("beyond_paper")

_FD = {"strategy": "fast_dllm", "cache": "dual", "threshold": 0.9, "early_stop": True}
_BB = {"strategy": "blockbatch"}
#: sparse window queries, the re-query radius spelled out (it keys the cached results)
_SQ = {"window_queries": "sparse", "requery_radius": 3}
#: lean BlockBatch (4, 16, 64) with merge agreement 2 and the widest EOS winner: the base of the third pass
_LEAN3 = {**_BB, "block_sizes": [4, 16, 64], "merge_agreement": 2, "eos_prefer_widest": True}

#: named candidates; ``max_new_tokens`` comes from each suite's default generation length
CONFIGS: dict[str, dict[str, Any]] = {
    # tuned baselines: Fast-dLLM dual, τ 0.9, early stop, at three block sizes (and skipping the
    # official extra forward on a block its block-start forward completed, for fairness)
    "fd_es_b32": {**_FD, "block_length": 32},
    "fd_es_b64": {**_FD, "block_length": 64},
    "fd_es_b96": {**_FD, "block_length": 96},
    "fd_es_b64_skip": {**_FD, "block_length": 64, "skip_completed_block_step": True},
    "fd_es_b32_skip": {**_FD, "block_length": 32, "skip_completed_block_step": True},
    "fd_es_b96_skip": {**_FD, "block_length": 96, "skip_completed_block_step": True},
    # BlockBatch today
    "bb_default": {**_BB},
    "bb_default_skip": {**_BB, "skip_completed_block_step": True},
    # smaller branch sets
    "bb_16_64": {**_BB, "block_sizes": [16, 64]},
    "bb_32_64": {**_BB, "block_sizes": [32, 64]},
    "bb_8_32_96": {**_BB, "block_sizes": [8, 32, 96]},
    "bb_16_64_skip": {**_BB, "block_sizes": [16, 64], "skip_completed_block_step": True},
    "bb_32_64_skip": {**_BB, "block_sizes": [32, 64], "skip_completed_block_step": True},
    "bb_16_64_nomerge": {**_BB, "block_sizes": [16, 64], "merge": False},
    "bb_16_64_r64": {**_BB, "block_sizes": [16, 64], "refresh_interval": 64},
    "bb_default_nomerge": {**_BB, "merge": False},
    "bb_default_m09": {**_BB, "merge_threshold": 0.9},
    "bb_default_roff": {**_BB, "refresh": "off"},
    "bb_16_64_roff": {**_BB, "block_sizes": [16, 64], "refresh": "off"},
    "bb_8_64": {**_BB, "block_sizes": [8, 64]},
    "bb_32_96": {**_BB, "block_sizes": [32, 96]},
    "bb_16_32_64": {**_BB, "block_sizes": [16, 32, 64]},
    "bb_16_64_s4": {**_BB, "block_sizes": [16, 64], "sync_threshold": 4},
    "bb_16_64_s16": {**_BB, "block_sizes": [16, 64], "sync_threshold": 16},
    # the same threshold change given to Fast-dLLM, so a gain from τ alone is not credited to branches
    "fd_es_b64_t08": {**_FD, "block_length": 64, "threshold": 0.8},
    "bb_16_64_t08": {**_BB, "block_sizes": [16, 64], "threshold": 0.8},
    # Prune (policies/prune.py) and the merge's neighbourhood guard (merge_agreement)
    "bb_default_p1": {**_BB, "prune_after_syncs": 1},
    "bb_default_p2": {**_BB, "prune_after_syncs": 2},
    "bb_default_a1": {**_BB, "merge_agreement": 1},
    "bb_default_p1_a1": {**_BB, "prune_after_syncs": 1, "merge_agreement": 1},
    "bb_default_roff_p1_a1": {**_BB, "refresh": "off", "prune_after_syncs": 1, "merge_agreement": 1},
    "bb_default_roff_p1_a1_m03": {**_BB, "refresh": "off", "prune_after_syncs": 1, "merge_agreement": 1,
                                  "merge_threshold": 0.3},
    "bb_16_64_a1": {**_BB, "block_sizes": [16, 64], "merge_agreement": 1},
    "bb_16_64_roff_a1": {**_BB, "block_sizes": [16, 64], "refresh": "off", "merge_agreement": 1},
    "bb_8_32_96_p1_a1": {**_BB, "block_sizes": [8, 32, 96], "prune_after_syncs": 1, "merge_agreement": 1},
    # EOS hitters ranked by block size (eos_prefer_widest)
    "bb_default_w": {**_BB, "eos_prefer_widest": True},
    "bb_16_64_w": {**_BB, "block_sizes": [16, 64], "eos_prefer_widest": True},
    "bb_16_64_nomerge_w": {**_BB, "block_sizes": [16, 64], "merge": False, "eos_prefer_widest": True},
    "bb_16_64_a1_w": {**_BB, "block_sizes": [16, 64], "merge_agreement": 1, "eos_prefer_widest": True},
    "bb_default_p1_a1_w": {**_BB, "prune_after_syncs": 1, "merge_agreement": 1, "eos_prefer_widest": True},
    "bb_default_roff_p1_a1_w": {**_BB, "refresh": "off", "prune_after_syncs": 1, "merge_agreement": 1,
                                "eos_prefer_widest": True},
    "bb_8_32_96_p1_a1_w": {**_BB, "block_sizes": [8, 32, 96], "prune_after_syncs": 1, "merge_agreement": 1,
                           "eos_prefer_widest": True},
    "bb_32_96_a1_w": {**_BB, "block_sizes": [32, 96], "merge_agreement": 1, "eos_prefer_widest": True},
    "bb_default_roff_p1_a2_w": {**_BB, "refresh": "off", "prune_after_syncs": 1, "merge_agreement": 2,
                                "eos_prefer_widest": True},
    "bb_default_roff_p1_a3_w": {**_BB, "refresh": "off", "prune_after_syncs": 1, "merge_agreement": 3,
                                "eos_prefer_widest": True},
    "bb_default_p1_a2_w": {**_BB, "prune_after_syncs": 1, "merge_agreement": 2, "eos_prefer_widest": True},
    "bb_default_a2_w": {**_BB, "merge_agreement": 2, "eos_prefer_widest": True},
    "bb_4to64_a2_w": {**_BB, "block_sizes": [4, 8, 16, 32, 64], "merge_agreement": 2, "eos_prefer_widest": True},
    "bb_4_16_64_a2_w": {**_BB, "block_sizes": [4, 16, 64], "merge_agreement": 2, "eos_prefer_widest": True},
    "bb_4_64_a2_w": {**_BB, "block_sizes": [4, 64], "merge_agreement": 2, "eos_prefer_widest": True},
    "bb_8_64_a2_w": {**_BB, "block_sizes": [8, 64], "merge_agreement": 2, "eos_prefer_widest": True},
    "bb_16_64_a2_w": {**_BB, "block_sizes": [16, 64], "merge_agreement": 2, "eos_prefer_widest": True},
    "bb_32_96_a2_w": {**_BB, "block_sizes": [32, 96], "merge_agreement": 2, "eos_prefer_widest": True},
    # sparse window queries (window_queries="sparse"): the same decoders, each block step querying
    # only the masks it reads and the positions decoded since their K/V were written
    "fd_es_b32_sq": {**_FD, "block_length": 32, **_SQ},
    "fd_es_b64_sq": {**_FD, "block_length": 64, **_SQ},
    "fd_es_b96_sq": {**_FD, "block_length": 96, **_SQ},
    "bb_default_sq": {**_BB, **_SQ},
    "bb_default_a2_w_sq": {**_BB, "merge_agreement": 2, "eos_prefer_widest": True, **_SQ},
    "bb_4_16_64_a2_w_sq": {**_BB, "block_sizes": [4, 16, 64], "merge_agreement": 2, "eos_prefer_widest": True,
                           **_SQ},
    "bb_16_64_a2_w_sq": {**_BB, "block_sizes": [16, 64], "merge_agreement": 2, "eos_prefer_widest": True,
                         **_SQ},
    "bb_4_64_a2_w_sq": {**_BB, "block_sizes": [4, 64], "merge_agreement": 2, "eos_prefer_widest": True,
                        **_SQ},
    "bb_4to64_a2_w_sq": {**_BB, "block_sizes": [4, 8, 16, 32, 64], "merge_agreement": 2, "eos_prefer_widest": True,
                         **_SQ},
    "bb_8_64_a2_w_sq": {**_BB, "block_sizes": [8, 64], "merge_agreement": 2, "eos_prefer_widest": True,
                        **_SQ},
    "bb_4_16_64_96_a2_w_sq": {**_BB, "block_sizes": [4, 16, 64, 96], "merge_agreement": 2, "eos_prefer_widest": True,
                              **_SQ},
    # the re-query radius (0: only the stale positions)
    **{f"{name}_r{r}": {**cfg, "requery_radius": r} for r in (0, 1, 2) for name, cfg in {
        "fd_es_b64_sq": {**_FD, "block_length": 64, **_SQ},
        "bb_4_16_64_a2_w_sq": {**_BB, "block_sizes": [4, 16, 64], "merge_agreement": 2, "eos_prefer_widest": True, **_SQ},
        "bb_4to64_a2_w_sq": {**_BB, "block_sizes": [4, 8, 16, 32, 64], "merge_agreement": 2, "eos_prefer_widest": True,
                             **_SQ},
    }.items()},
    # merges that take only what the source holds confidently (merge_source_confidence)
    **{f"{name}_c{int(c * 10):02d}": {**cfg, "merge_source_confidence": c} for c in (0.7, 0.9) for name, cfg in {
        "bb_default_a2_w_sq": {**_BB, "merge_agreement": 2, "eos_prefer_widest": True, **_SQ},
        "bb_4_16_64_a2_w_sq": {**_BB, "block_sizes": [4, 16, 64], "merge_agreement": 2, "eos_prefer_widest": True, **_SQ},
        "bb_default_sq": {**_BB, **_SQ},
        "bb_4_16_64_a2_w": _LEAN3,
    }.items()},
    # a wider re-query radius: sparse Fast-dLLM lost 2.0 points on tiny-llada arith's test split at r 3
    "fd_es_b64_sq_r6": {**_FD, "block_length": 64, **_SQ, "requery_radius": 6},
    "bb_4_16_64_a2_w_sq_c07_r6": {**_LEAN3, **_SQ, "requery_radius": 6, "merge_source_confidence": 0.7},
    # and retiring a branch once it has been synced to its leader k times (compute that adapts)
    **{f"bb_4_16_64_a2_w_sq_c07_r6_p{k}": {**_LEAN3, **_SQ, "requery_radius": 6, "merge_source_confidence": 0.7,
                                          "prune_after_syncs": k} for k in (1, 2)},
    # and LocalLeap's relaxed commits (anchors 0.9, 0.75 within 4 positions), in Fast-dLLM and in the branches
    "fd_es_b64_ll": {**_FD, "block_length": 64, "rule": "localleap"},
    "fd_es_b64_sq_ll": {**_FD, "block_length": 64, "rule": "localleap", **_SQ},
    "bb_default_a2_w_sq_ll": {**_BB, "merge_agreement": 2, "eos_prefer_widest": True, **_SQ,
                              "rule": "localleap"},
    "bb_4_16_64_a2_w_sq_ll": {**_BB, "block_sizes": [4, 16, 64], "merge_agreement": 2, "eos_prefer_widest": True,
                              **_SQ, "rule": "localleap"},
    "bb_16_64_a2_w_sq_ll": {**_BB, "block_sizes": [16, 64], "merge_agreement": 2, "eos_prefer_widest": True,
                            **_SQ, "rule": "localleap"},
    # lookahead branches (fourth pass): K draft rows per request run the next block step in the same
    # forward; an exact draft is adopted (Fast-dLLM's tokens, fewer forwards, more query tokens)
    **{f"fd_es_b{b}_la{k}": {**_FD, "block_length": b, "lookahead": k} for b in (32, 64) for k in range(1, 7)},
    # ... drafted only while the window has at most m masks left (a draft of one or two tokens rarely
    # matches a step that commits several)
    **{f"fd_es_b64_la{k}_m{m}": {**_FD, "block_length": 64, "lookahead": k, "lookahead_max_masks": m}
       for k in (1, 2, 3, 6) for m in (4, 8, 16)},
    # ... with sparse window queries at radius 6 (fifth pass): a draft row reads its parent's K/V as
    # they will be cached after the forward, so it queries only what sparse Fast-dLLM's next step would
    **{f"fd_es_b{b}_sq_r6_la{k}{'' if m is None else f'_m{m}'}": {
        **_FD, "block_length": b, **_SQ, "requery_radius": 6, "lookahead": k,
        **({} if m is None else {"lookahead_max_masks": m})}
       for b in (32, 64) for k in range(1, 7) for m in (None, 8, 16)},
    "fd_es_b32_sq_r6": {**_FD, "block_length": 32, **_SQ, "requery_radius": 6},
    # sampled decoding (RESULTS §38): the tuned baseline, sparse queries, and the two drafted presets at temperature T
    # (with keyed noise the drafted presets sample sparse Fast-dLLM's answers; a sampled sparse step proposes at the
    # masks alone)
    **{f"{name}_t{int(t * 10):02d}": {**cfg, "temperature": t} for t in (0.5, 1.0) for name, cfg in {
        "fd_es_b64": {**_FD, "block_length": 64},
        "fd_es_b64_sq_r6": {**_FD, "block_length": 64, **_SQ, "requery_radius": 6},
        "fd_es_b64_drafted": {**_FD, "block_length": 64, **DRAFTED},
        "fd_es_b64_drafted_ct": {**_FD, "block_length": 64, **DRAFTED_CONTAINED},
    }.items()},
    # LocalLeap inside branches whose merges take only confident tokens
    "bb_4_16_64_a2_w_sq_c07_ll": {**_LEAN3, **_SQ, "merge_source_confidence": 0.7, "rule": "localleap"},
    "bb_default_a2_w_sq_c07_ll": {**_BB, "merge_agreement": 2, "eos_prefer_widest": True, **_SQ,
                                  "merge_source_confidence": 0.7, "rule": "localleap"},
}


def read_config_file(path: str | os.PathLike[str] | None) -> dict[str, dict[str, Any]]:
    """The named configs of a ``--config-file`` (``{"name": {"strategy": ..., option: value}}``; none without one),
    each built and validated here, so that a file that is missing, not JSON, not an object, or holds an entry that
    is no config is said in one line before the model loads, not as a traceback once the decoding reaches it. The
    one reader of this script's and ``gpu_projection.py``'s ``--config-file``."""
    if path is None:
        return {}
    form = 'an object {"name": {"strategy": "fast_dllm", option: value, ...}}'
    configs = read_json(path, dict, form)
    for name, cfg in configs.items():
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: entry {name!r} is {json.dumps(cfg)}, not a config: expected {form}")
        try:
            config_from_dict({"max_new_tokens": 256, **cfg}).validate()
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: entry {name!r}: {err}") from None
    return configs


def _sampled(cfg: dict[str, Any], gen_length: int) -> bool:
    """Whether a named config draws noise, read from the config it builds at ``gen_length`` (at a length of 1, a
    ``variant='reference'`` config was refused: its block sizes must divide the length)."""
    return samples(config_from_dict({"max_new_tokens": gen_length, **cfg}))


def _key(model: str, suite: str, limit: int, gen_length: int, cfg: dict[str, Any], batch_size: int,
         seed: int = 0, split: str = "train") -> str:  # fmt: skip
    """The cache key of a result; the batch size changes only the timing, and keys a result
    only when it is not the default 16 (so that timing runs at batch 1 / 32 sit beside it). A sampled
    config's result is keyed by its seed too, and by its noise being keyed (results drawn from a generator,
    before keyed noise, are not taken for them), and one with a draft radius by that radius not applying when
    sampling (RESULTS §40: results from before are not taken for it). A test-split result is keyed by its split
    (training items' keys stay as they were)."""
    what = {"model": model, "suite": suite, "limit": limit, "gen": gen_length, "cfg": cfg}
    if split != "train":
        what["split"] = split
    if batch_size != 16:
        what["batch_size"] = batch_size
    if _sampled(cfg, gen_length):
        what["seed"], what["noise"] = seed, "keyed"
        if cfg.get("lookahead_draft_radius") is not None:  # sampled drafts re-query at the main radius (§40)
            what["draft_radius"] = "main when sampled"
    blob = json.dumps(what, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def decode(model: Any, tokenizer: Any, suite: str, items: list, prompts: list[str], gen_length: int,
           cfg_dict: dict[str, Any], batch_size: int, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Decode every item with one config; per-item correctness, NFE and query tokens, the wall time, and
    the part of it spent in model forwards (the engine's own ``forward_seconds``: the rest is the
    decoding policy, so a latency gap says which side it is on). A sampled config samples with keyed noise of
    ``seed`` (unless it names its own): every round, every batch size, and every config that decodes the same
    way (the drafted presets and sparse Fast-dLLM) sample the same answers."""
    return decode_interleaved(model, tokenizer, suite, items, prompts, gen_length, {"": cfg_dict}, batch_size, seed)[""]


def rotation(names: list[str], batch: int) -> list[str]:
    """The order in which an interleaved sitting runs its configs on batch number ``batch``: each config goes first
    on every n-th batch, so that none is always timed straight after the same neighbour (whose memory traffic it
    may inherit)."""
    k = batch % len(names)
    return names[k:] + names[:k]


def decode_interleaved(model: Any, tokenizer: Any, suite: str, items: list, prompts: list[str], gen_length: int,
                       cfg_dicts: dict[str, dict[str, Any]], batch_size: int, seed: int = 0) -> dict[str, dict[str, Any]]:  # fmt: skip
    """:func:`decode` for several configs at once, batch by batch: each batch of items is decoded by every config in
    turn (:func:`rotation`) before the next batch. A latency sitting (``--interleave``) times the configs this way:
    the machine's speed drifts by 10-20 % within a minute here, and a config's whole pass over 500 items takes
    10-60 s, so configs timed one pass after the other see different machines; decoded batch by batch, both sides
    of a ratio are timed within milliseconds of each other (RESULTS §50). The decodes are the same either way."""
    task = load_task(suite)
    cfgs = {}
    for name, cfg_dict in cfg_dicts.items():
        cfg = config_from_dict({"max_new_tokens": gen_length, **cfg_dict})
        key_sampling_noise({"cfg": cfg}, seed)
        cfg.validate()
        cfgs[name] = cfg
    end_ids = end_token_ids(tokenizer, model.config)
    out = {name: {"items": [], "seconds": 0.0, "forward_seconds": 0.0, "batch_size": batch_size} for name in cfgs}
    for k, b0 in enumerate(range(0, len(items), batch_size)):
        idx = list(range(b0, min(b0 + batch_size, len(items))))
        ids, mask = _encode(tokenizer, [prompts[i] for i in idx], torch.device("cpu"))
        decoded = {}
        for name in rotation(list(cfgs), k):  # timed back to back; scored after (code runs tests)
            t0 = time.perf_counter()
            with torch.inference_mode():
                decoded[name] = model.generate(ids, mask, generation_config=cfgs[name], return_dict_in_generate=True)
            out[name]["seconds"] += time.perf_counter() - t0
        for name, gen in decoded.items():
            res = out[name]
            res["forward_seconds"] += gen.stats[0]["forward_seconds"]  # the batch's run: the same for each request
            texts = answer_texts(tokenizer, gen.sequences[:, ids.shape[1] :], end_ids)
            scores = _score_all(task, [items[i] for i in idx], texts)
            for j, (i, sc) in enumerate(zip(idx, scores)):
                st = gen.stats[j]
                res["items"].append({"index": i, "correct": bool(sc.correct), "nfe": int(gen.nfe[j]),
                                     "query_tokens": int(st["query_tokens"]), "syncs": int(st.get("syncs", 0)),
                                     "merged": int(st.get("merged", 0)), "text": texts[j]})  # fmt: skip
    return out


def summarise(res: dict[str, Any]) -> dict[str, float]:
    it = res["items"]
    n = len(it)
    return {"n": n, "acc": 100.0 * sum(r["correct"] for r in it) / n,
            "nfe": statistics.fmean(r["nfe"] for r in it), "qt": statistics.fmean(r["query_tokens"] for r in it),
            "ms_item": 1000.0 * res["seconds"] / n, "syncs": statistics.fmean(r["syncs"] for r in it),
            "merged": statistics.fmean(r["merged"] for r in it),
            # results cached before the split was recorded have no forward time
            "policy_ms_item": (1000.0 * (res["seconds"] - res["forward_seconds"]) / n
                               if "forward_seconds" in res else None),
            "rounds": res.get("rounds")}  # fmt: skip


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The paired accuracy difference of two decodes of the same items (``decode``'s per-item rows)."""
    return paired_difference({r["index"]: r["correct"] for r in a}, {r["index"]: r["correct"] for r in b})


def option_grid(model: Any, tokenizer: Any, cells: list[tuple[str, int]], limit: int, batch_size: int,
                configs: Callable[[int], dict[str, dict[str, Any]]], base: Callable[[str], str]) -> dict[str, Any]:
    """A decoder option measured on training items (never a test question), for the grids of §48-§49: each
    ``suite:block`` cell's decoders (``configs(block)``, the tuned Fast-dLLM named ``tuned`` among them) on ``limit``
    training items; per decoder its accuracy, mean NFE and query tokens, the paired accuracy difference against
    ``tuned`` and against the decoder ``base(name)`` (the same without the option), and the share of answers equal to
    that decoder's."""
    out: dict[str, Any] = {}
    for suite, block in cells:
        task = load_task(suite)
        items = task.items("train", limit=limit)
        prompts = [task.prompt(it, tokenizer) for it in items]
        cfgs = configs(block)
        runs, rows = {}, {}
        for name, cfg in cfgs.items():
            runs[name] = decode(model, tokenizer, suite, items, prompts, int(task.default_gen_length), cfg, batch_size)["items"]
            s = summarise({"items": runs[name], "seconds": 0.0})
            logger.info("%s b%d %s: acc %.1f nfe %.3f qt %.1f", suite, block, name, s["acc"], s["nfe"], s["qt"])
            rows[name] = {"accuracy": s["acc"], "nfe": s["nfe"], "query_tokens": s["qt"]}
        for name, mine in runs.items():  # paired, once all have run
            theirs = runs[base(name)]
            rows[name].update(vs_tuned=paired(mine, runs["tuned"]), vs_preset=paired(mine, theirs),
                              same_answers=sum(a["text"] == b["text"] for a, b in zip(mine, theirs)) / len(items))
        out[f"{suite}:{block}"] = {"configs": cfgs, "rows": rows}
    return out


def option_markdown(res: dict[str, Any], title: str, intro: str, same_answers: bool = False) -> list[str]:
    """:func:`option_grid`'s result as one table per cell: accuracy, Δ against the tuned Fast-dLLM with its paired 95 %
    interval and against the decoder without the option, NFE and query tokens × the tuned one's (and the answers
    equal to the decoder's without the option)."""
    lines = [f"# {title}", "", intro, ""]
    for cell, r in res.items():
        tuned = r["rows"]["tuned"]
        lines += [f"## {cell}", "", "| point | accuracy | Δ tuned [95 %] | Δ preset | NFE × | query tokens × |"
                  + (" same answers |" if same_answers else ""), "|---|---:|---:|---:|---:|---:|" + ("---:|" if same_answers else "")]  # fmt: skip
        for name, row in r["rows"].items():
            vt, vp = row["vs_tuned"], row["vs_preset"]
            lo, hi = vt["ci95"]
            lines.append(f"| {name} | {row['accuracy']:.1f} | {100 * vt['difference']:+.1f} [{100 * lo:+.1f}, "
                         f"{100 * hi:+.1f}] | {100 * vp['difference']:+.1f} | {row['nfe'] / tuned['nfe']:.3f} | "
                         f"{row['query_tokens'] / tuned['query_tokens']:.3f} |"
                         + (f" {100 * row['same_answers']:.1f} % |" if same_answers else ""))  # fmt: skip
        lines.append("")
    return lines


def grid_cell(text: str) -> tuple[str, int]:
    """An argparse type: an :func:`option_grid` cell, ``suite:block`` with a block of at least 1."""
    suite, sep, block = text.partition(":")
    if not sep or not suite or not block.isdigit() or int(block) < 1:
        raise argparse.ArgumentTypeError(f"expected suite:block with a block >= 1, e.g. arith:96 or lists:64, got {text!r}")
    return suite, int(block)


def option_grid_main(argv: list[str] | None, doc: str, out: Path, extra: Callable[[argparse.ArgumentParser], None],
                     run: Callable[[Any, Any, list[tuple[str, int]], argparse.Namespace], dict[str, Any]],
                     markdown: Callable[[str, int, dict[str, Any]], str]) -> None:  # fmt: skip
    """The command line of an :func:`option_grid` script: its common arguments (``extra`` adds its own), then
    ``run(model, tokenizer, cells, args)``, written as ``<out>/<model>_<limit>.json`` and ``.md``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--cells", nargs="+", type=grid_cell, default=[("arith", 96), ("code", 96), ("lists", 64)],
                   metavar="SUITE:BLOCK",
                   help="suite:block, the block each suite's tuned Fast-dLLM uses (RESULTS §35)")
    p.add_argument("--limit", type=positive_int, default=1000, help="training items per suite")
    extra(p)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", type=out_folder, default=str(out), help="folder of the report")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model, tokenizer = load_for_benchmark(args.model, args.threads)
    res = run(model, tokenizer, args.cells, args)
    name = Path(args.model).name
    print(write_report(Path(args.out) / f"{name}_{args.limit}", {"model": args.model, "limit": args.limit, "cells": res},
                       markdown(name, args.limit, res)))  # fmt: skip


def round_ratios(s: dict[str, Any], base: dict[str, Any]) -> list[float] | None:
    """Each round's time over the baseline's in the same round (latency runs, ``--rounds`` > 1): the rounds run
    round-robin (with ``--interleave``, batch by batch within each round), so a slow spell of the machine hits both
    sides of a pair; their spread says how far one sitting's ratio can be read. ``None`` without rounds on both sides."""
    a, b = s.get("rounds"), base.get("rounds")
    if not a or not b or len(a) != len(b) or len(a) < 2:
        return None
    return [x / y for x, y in zip(a, b)]


def time_ratio(s: dict[str, Any], base: dict[str, Any]) -> float:
    """The time of ``s`` over the baseline's: with rounds on both sides, the ratio of their total times over the rounds
    (each round timed both side by side: :func:`~hf_blockbatch.eval.stats.paired_time_ratio`; before §52 the ratio of
    the medians, which can pair one decoder's round with another round of the other's); else of the times per item."""
    if round_ratios(s, base) is not None:
        return paired_time_ratio(s["rounds"], base["rounds"])
    return s["ms_item"] / base["ms_item"]


def _t_ratio(s: dict[str, Any], base: dict[str, Any]) -> str:
    """The time ratio (:func:`time_ratio`), and the range of the rounds' own ratios where there are rounds."""
    r = round_ratios(s, base)
    head = f"{time_ratio(s, base):.2f}"
    return head if r is None or s is base else f"{head} ({min(r):.2f}–{max(r):.2f})"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(model: str, limit: int, table: dict[str, dict[str, dict[str, float]]], baseline: str,
           split: str = "train", interleave: bool = False) -> str:  # fmt: skip
    items = "training items" if split == "train" else f"{split}-split items"
    paired_by = ("rounds interleaved batch by batch: each batch decoded by every config in turn" if interleave else
                 "round-robin rounds, paired by round")
    lines = [f"# beyond_paper: {model}, {limit} {items} per suite", "",
             f"Ratios and Δacc against `{baseline}` (Fast-dLLM dual, τ 0.9, early stop) on the same items "
             "(Δacc in points, with Newcombe's paired 95 % interval: the two decoders scored on the same items). "
             "Latency is wall time per item at the run's batch size (noisy on shared CPUs; NFE and query "
             "tokens are exact); policy is its part outside model forwards (each a median over the rounds). With several "
             f"rounds, t × is the ratio of the total times over the rounds, followed by the range of each round's ratio "
             f"({paired_by}).", ""]  # fmt: skip
    for suite, rows in table.items():
        base = rows.get(baseline)
        lines += [f"## {suite}", "", "| config | acc % | Δacc [paired 95 % CI] | NFE | NFE × | query tok | qt × | ms/item | t × "
                  "| policy ms/item | syncs | merged |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, s in rows.items():
            def r(k: str, s: dict = s, base: dict | None = base) -> str:
                return f"{s[k] / base[k]:.2f}" if base else "-"

            d = (paired_points(s["paired"]) if s.get("paired") else f"{s['acc'] - base['acc']:+.1f}") if base else "-"
            lines.append(f"| {name} | {s['acc']:.1f} | {d} | {s['nfe']:.2f} | {r('nfe')} | {s['qt']:.0f} | {r('qt')} | "
                         f"{s['ms_item']:.0f} | {_t_ratio(s, base) if base else '-'} | {_ms(s.get('policy_ms_item'))} | {s['syncs']:.2f} | "
                         f"{s['merged']:.1f} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--suites", nargs="+", choices=ALL_TASKS, default=["arith", "code", "lists"], metavar="SUITE")
    p.add_argument("--limit", type=positive_int, default=120, help="items per suite (the first of the split)")
    p.add_argument("--split", choices=("train", "test"), default="train",
                   help="train: choose configs on training items; test: report on the test split (never to choose)")
    p.add_argument("--configs", nargs="+", default=["fd_es_b32", "fd_es_b64", "fd_es_b96", "bb_default"],
                   help=f"named configs ({', '.join(CONFIGS)}) or entries of --config-file")
    p.add_argument("--config-file", help='JSON {"name": {"strategy": ..., option: value}} of extra candidates')
    p.add_argument("--baseline", default="fd_es_b64")
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", type=out_folder, default="benchmarks/results/beyond_paper")
    p.add_argument("--fresh", action="store_true", help="ignore cached results")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="decode each config this many times, round-robin, and report the median time (latency "
                        "runs; more than 1 re-decodes every config, cached or not)")
    p.add_argument("--interleave", action="store_true",
                   help="within each round, decode every batch with every config in turn before the next batch "
                        "(rotating which goes first), so that both sides of a time ratio are timed side by side batch "
                        "by batch, not a whole pass apart (RESULTS §50); re-decodes every config, cached or not")
    p.add_argument("--tag", default="", help="suffix of the output files' names")
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="the seed of sampled configs' keyed noise (temperature > 0); it keys their results")
    args = p.parse_args(argv)
    configs = {**CONFIGS, **read_config_file(args.config_file)}
    unknown = [c for c in args.configs if c not in configs]
    if unknown:
        p.error(f"unknown config(s) {unknown}; known: {', '.join(configs)}")
    names = list(dict.fromkeys([args.baseline, *args.configs]))
    if args.baseline not in configs:
        p.error(f"unknown baseline {args.baseline!r}")

    # each config at each suite's generation length, before the model loads: one that a later suite's length
    # refuses (variant='reference' with a block size that does not divide it) was refused at that suite's turn
    tasks = {suite: load_task(suite) for suite in args.suites}
    check_scoring(tasks.values())
    for suite, task in tasks.items():
        gen_length = int(task.default_gen_length)
        for name in names:
            try:
                config_from_dict({"max_new_tokens": gen_length, **configs[name]}).validate()
            except (ValueError, TypeError) as err:
                p.error(f"config {name!r} at {suite}'s generation length ({gen_length} tokens): {err}")

    model, tokenizer = load_for_benchmark(args.model, args.threads)
    # and each against the model, before the first decode (the reference variant on Dream was refused at its turn);
    # the model's check does not depend on the length, which the loop above checked for every suite
    first_length = int(next(iter(tasks.values())).default_gen_length)
    for name in names:
        try:
            check_config_model(config_from_dict({"max_new_tokens": first_length, **configs[name]}), model)
        except ValueError as err:
            p.error(f"config {name!r} on {args.model}: {err}")
    chat = bool(getattr(tokenizer, "chat_template", None))
    out_dir = Path(args.out)
    (out_dir / "cache").mkdir(parents=True, exist_ok=True)
    mname = Path(args.model).name
    table: dict[str, dict[str, dict[str, float]]] = {}
    full: dict[str, Any] = {"model": args.model, "limit": args.limit, "split": args.split, "batch_size": args.batch_size,
                            "rounds": args.rounds, "interleave": args.interleave, "baseline": args.baseline, "configs": {},
                            "suites": {}}  # fmt: skip
    for suite, task in tasks.items():
        items = task.items(args.split, limit=args.limit)
        prompts = [task.prompt(it, tokenizer, chat=chat) for it in items]
        gen_length = int(task.default_gen_length)
        table[suite], full["suites"][suite] = {}, {}
        paths = {name: out_dir / "cache" / f"{mname}_{suite}_{_key(args.model, suite, args.limit, gen_length, configs[name], args.batch_size, args.seed, args.split)}.json"
                 for name in names}  # fmt: skip
        # a latency run (--rounds > 1 or --interleave) times every config in this sitting: a cached time from
        # another sitting is not side by side (timings here move by 10 % between sittings)
        todo = [n for n in names if args.fresh or args.rounds > 1 or args.interleave or not paths[n].exists()]
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in todo}
        # round-robin, so that a slow spell of the machine hits every config; with --interleave, batch by batch
        together = [todo] if args.interleave and todo else [[name] for name in todo]
        for _ in range(args.rounds):
            for group in together:
                done = decode_interleaved(model, tokenizer, suite, items, prompts, gen_length,
                                          {name: configs[name] for name in group}, args.batch_size, args.seed)  # fmt: skip
                for name in group:
                    runs[name].append(done[name])
        for name, rs in runs.items():
            assert all(r["items"] == rs[0]["items"] for r in rs), "a decode changed between rounds"
            res = {**rs[0], "seconds": statistics.median(r["seconds"] for r in rs),
                   "forward_seconds": statistics.median(r["forward_seconds"] for r in rs),
                   "rounds": [r["seconds"] for r in rs]}
            # beside its place first: a cut file (a full disk) counted as decoded, and each later run failed reading it
            _replace_files({paths[name]: json.dumps({"config": configs[name], **res})})
        right: dict[str, dict[int, bool]] = {}
        for name in names:
            cfg = configs[name]
            full["configs"][name] = cfg
            res = json.loads(paths[name].read_text())
            s = summarise(res)
            table[suite][name] = s
            full["suites"][suite][name] = {**s, "correct": [r["correct"] for r in res["items"]],
                                           "nfe_items": [r["nfe"] for r in res["items"]]}  # fmt: skip
            right[name] = {r["index"]: r["correct"] for r in res["items"]}
            logger.info("%s %-22s acc %5.1f  nfe %6.2f  qt %6.0f  %5.0f ms/item", suite, name, s["acc"], s["nfe"],
                        s["qt"], s["ms_item"])  # fmt: skip
        for name in names:  # accuracy minus the baseline's on the same items, with its paired interval
            if name != args.baseline:
                table[suite][name]["paired"] = full["suites"][suite][name]["paired"] = paired_difference(
                    right[name], right[args.baseline])
                full["suites"][suite][name]["t_ratio_rounds"] = round_ratios(table[suite][name], table[suite][args.baseline])
                full["suites"][suite][name]["t_ratio"] = time_ratio(table[suite][name], table[suite][args.baseline])
    split = "" if args.split == "train" else args.split
    stem = out_dir / (f"{mname}_{split}{args.limit}" + (f"_b{args.batch_size}" if args.batch_size != 16 else "") + args.tag)
    text = render(args.model, args.limit, table, args.baseline, args.split, args.interleave)
    write_report(stem, full, text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(run_main(main))
