"""Random combinations of the decoders' options on the trained tiny checkpoints.

The other tests pin each option's meaning, mostly one option at a time. Here one seeded generator draws whole
configurations (Fast-dLLM with its caches, sparse steps, transfer rules, drafts and refreshes; BlockBatch with its
branch policies and both variants; vanilla), keeps those that validate, and decodes training prompts of mixed
suites and lengths in one left-padded batch. Whatever validates must decode, and keep the invariants of the
decoding core:

* the prompt untouched, no mask before the first end token;
* each request decodes in the batch exactly as alone: tokens, NFE and query tokens (greedy, or sampled with a
  ``seed``; a repeated prompt draws its own numbers then, and is left out);
* with a trace (no drafts): every commit inside its window, none twice without a sync, merges only into masks,
  the winner decoded what the output holds; single-row Fast-dLLM's NFE = 1 + block steps + refreshes;
* exact lookahead drafts: the tokens of the same decoder without drafts, in that decoder's NFE less the steps
  the drafts stood in for (``lookahead_adopted``).

Such a search found that sparse steps with ``refresh_after_commits`` failed when a window completed by its
block-start forward was refreshed (RESULTS §54). The default run decodes thirty configurations; ``pytest -m slow``
draws many more (``HB_COMBO_SEEDS`` seeds from ``HB_COMBO_SEED``).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from _generation_helpers import run_padded
from test_blockbatch import _replay

import hf_blockbatch as hb
from hf_blockbatch.tasks import get_suite

SUITES = ("arith", "code", "lists")


def _some(rng: random.Random, options: dict, table) -> None:
    """Each ``(name, p, values)`` of ``table``: with probability ``p``, one of ``values`` as option ``name``."""
    for name, p, values in table:
        if rng.random() < p:
            options[name] = rng.choice(values)


def _fast_dllm(rng: random.Random) -> dict:
    c = dict(max_new_tokens=rng.choice([1, 3, 16, 24, 33, 48, 64]), block_length=rng.choice([1, 4, 8, 16, 24, 32, 64]),
             cache=rng.choice(["dual", "dual", "prefix", "none"]), early_stop=rng.random() < 0.7,
             skip_completed_block_step=rng.random() < 0.3)  # fmt: skip
    if c["cache"] == "dual" and rng.random() < 0.6:
        c.update(window_queries="sparse", requery_radius=rng.choice([0, 2, 6]))
    rule = rng.random()
    if rule < 0.1:
        c["threshold"] = rng.choice([0.5, 0.7, 0.99])
    elif rule < 0.18:
        c["factor"] = rng.choice([1.0, 2.0])
    elif rule < 0.26:
        c["rule"] = "localleap"
    elif rule < 0.32:
        c.update(rule="entropy", entropy_bound=rng.choice([0.1, 1.0]))
    elif rule < 0.4:
        c.update(many_masks_threshold=0.85, many_masks=rng.choice([0, 8, 16]))
    if rng.random() < 0.5:
        c["lookahead"] = rng.choice([1, 2, 3, 4, 6])
        _some(rng, c, (("lookahead_max_masks", 0.5, [2, 8, 16]), ("lookahead_accept", 0.4, ["contained"]),
                       ("lookahead_draft_radius", 0.3, [0, 2]), ("lookahead_query_budget", 0.3, [1.0, 2.0]),
                       ("lookahead_runner_up", 0.4, [True])))  # fmt: skip
    elif rng.random() < 0.25:
        c["refresh_after_commits"] = rng.choice([1, 4, 16])
    if rng.random() < 0.15:
        c.update(temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(1000))
    c["output_trace"] = rng.random() < 0.5
    return c


def _blockbatch(rng: random.Random) -> dict:
    c = dict(max_new_tokens=rng.choice([1, 5, 16, 32, 64]),
             block_sizes=tuple(sorted(rng.sample([1, 2, 4, 8, 16, 32, 64, 128], rng.randint(1, 4)))))  # fmt: skip
    _some(rng, c, (("refresh", 0.3, ["off", "divergence"]), ("refresh_interval", 0.3, [1, 8, 32]),
                   ("merge", 0.2, [False]), ("sync", 0.2, [False]), ("eos_confidence", 0.3, ["commit"]),
                   ("merge_agreement", 0.3, [1, 2]), ("eos_prefer_widest", 0.3, [True]),
                   ("prune_after_syncs", 0.3, [1, 2]), ("merge_source_confidence", 0.3, [0.7]),
                   ("rule", 0.2, ["localleap"]), ("variant", 0.15, ["reference"]), ("early_stop", 0.2, [False]),
                   ("skip_completed_block_step", 0.2, [True])))  # fmt: skip
    if rng.random() < 0.4:
        c.update(window_queries="sparse", requery_radius=rng.choice([0, 6]))
    if rng.random() < 0.15:
        c.update(temperature=0.5, seed=rng.randrange(100))
    c["output_trace"] = rng.random() < 0.5
    return c


def _vanilla(rng: random.Random) -> dict:
    n = rng.choice([4, 8, 16, 32])
    return dict(max_new_tokens=n, steps=rng.choice([n, n // 2, max(1, n // 4)]), block_length=rng.choice([None, n, n // 2]))


KINDS = ((0.65, hb.FastDLLMConfig, _fast_dllm), (0.9, hb.BlockBatchConfig, _blockbatch),
         (1.0, hb.VanillaDiffusionConfig, _vanilla))  # fmt: skip


def random_config(rng: random.Random):
    """``(config, options)``, or ``(None, options)`` when the drawn options do not validate."""
    r = rng.random()
    cls, draw = next((cls, draw) for bound, cls, draw in KINDS if r < bound)
    options = draw(rng)
    try:
        cfg = cls(**options)
        cfg.validate()
    except (ValueError, TypeError):
        return None, options
    return cfg, options


@pytest.fixture(scope="module")
def checkpoints():
    out = {}
    for family in ("llada", "dream"):
        model, tok = hb.load_model(f"tiny-{family}", device="cpu")
        prompts = {s: [tok(get_suite(s).prompt(it, tok), add_special_tokens=False).input_ids
                       for it in get_suite(s).items("train", limit=24)] for s in SUITES}  # fmt: skip
        out[family] = (model, tok, prompts)
    return out


def _check(model, tok, prompts: list[list[int]], cfg, options: dict) -> None:
    G, mask_id = cfg.max_new_tokens, model.config.mask_token_id
    ends = set(hb.end_token_ids(tok, model.config))
    sampled_unkeyed = bool(cfg.temperature) and cfg.seed is None
    batch = run_padded(model, prompts, cfg)
    width = batch.sequences.shape[1] - G
    for i, p in enumerate(prompts):
        seq = batch.sequences[i].tolist()
        assert seq[width - len(p) : width] == p, options
        gen = seq[width:]
        first_end = next((k for k, t in enumerate(gen) if t in ends), G)
        assert mask_id not in gen[:first_end], options
        if getattr(cfg, "output_trace", False) and not getattr(cfg, "lookahead", 0):  # (drafts are re-drafted
            st = batch.stats[i]  # every step: their trace is not a branch replay; test_lookahead replays it)
            block_steps, refresh_steps, decoded = _replay(st["trace"], G, len(st["branches"]))
            if isinstance(cfg, hb.FastDLLMConfig):
                assert st["nfe"] == 1 + len(block_steps) + len(refresh_steps), options
            if st["stopped_by"] != "eos":  # the winner decoded what the output holds
                assert decoded[st["winner_branch"]] == {k: t for k, t in enumerate(gen) if t != mask_id}, options
        if sampled_unkeyed or (cfg.temperature and p in prompts[:i]):
            continue
        alone = run_padded(model, [p], cfg)
        assert alone.sequences[0, len(p) :].tolist() == gen, (options, i)
        assert int(alone.nfe[0]) == int(batch.nfe[i]), (options, i)
        assert alone.stats[0]["query_tokens"] == batch.stats[i]["query_tokens"], (options, i)
    if isinstance(cfg, hb.FastDLLMConfig) and cfg.lookahead and cfg.lookahead_accept == "exact" and not sampled_unkeyed:
        plain = run_padded(model, prompts, hb.FastDLLMConfig(**{k: v for k, v in options.items() if not k.startswith("lookahead")}))
        adopted = torch.tensor([st["lookahead_adopted"] for st in batch.stats])
        assert torch.equal(plain.sequences, batch.sequences), options
        assert torch.equal(plain.nfe, batch.nfe + adopted), options


def _run(checkpoints, seed: int, cases: int) -> set[str]:
    """Decode ``cases`` random configurations that validate (drawn from ``seed``); returns what they covered."""
    rng = random.Random(seed)
    covered: set[str] = set()
    while cases:
        family, suite = rng.choice(["llada", "dream"]), rng.choice(SUITES)
        cfg, options = random_config(rng)
        if cfg is None:
            covered.add("refused")
            continue
        model, tok, prompts = checkpoints[family]
        pool = prompts[suite] + (prompts[rng.choice(SUITES)] if rng.random() < 0.4 else [])
        batch = rng.sample(pool, rng.randint(1, 4))
        if rng.random() < 0.2:
            batch.append(batch[0])  # a repeated prompt
        _check(model, tok, batch, cfg, options)
        covered.add(type(cfg).__name__)
        covered.update(k for k in ("lookahead", "refresh_after_commits", "temperature") if options.get(k))
        covered.update(v for v in (options.get("window_queries"), options.get("variant")) if v)
        cases -= 1
    return covered


def test_random_option_combinations_keep_the_invariants(checkpoints):
    """Thirty random configurations that validate; they cover every config class and the main options, and some
    drawn configurations are refused by validation, as they should be."""
    assert _run(checkpoints, seed=0, cases=30) >= {"FastDLLMConfig", "BlockBatchConfig", "VanillaDiffusionConfig",
                                                   "lookahead", "sparse", "refused"}  # fmt: skip


@pytest.mark.slow
def test_random_option_combinations_sweep(checkpoints):
    """200 more (10 seeds of 20 by default; about 40 s)."""
    first = int(os.environ.get("HB_COMBO_SEED", "100"))
    for seed in range(first, first + int(os.environ.get("HB_COMBO_SEEDS", "10"))):
        _run(checkpoints, seed, cases=20)
