"""The plain restatement of the authors' bulk BlockBatch (tests/_reference_blockbatch.py) on its own.

Its agreement with the authors' code itself is measured by benchmarks/reference_side_by_side.py
(their code is never imported here); these tests pin what must hold without it.
"""

from __future__ import annotations

import pytest
import torch
from _generation_helpers import output_head, peaked, ref_generate
from _reference_blockbatch import reference_blockbatch

import hf_blockbatch as hb
from hf_blockbatch.tasks import get_suite

G = 64


@pytest.fixture(scope="module", params=["tiny-llada", "tiny-dream"])
def trained(request):
    model, tokenizer = hb.load_model(request.param, device="cpu", dtype=torch.float32)
    prompts = []
    for suite, n in (("arith", 4), ("code", 2), ("lists", 2)):
        task = get_suite(suite)
        for item in task.items("test", n):
            prompts.append(
                tokenizer(task.prompt(item, tokenizer, chat=True), add_special_tokens=False).input_ids
            )
    return model, prompts


def no_mask_proposals(model):
    """A peaked random model whose head never ranks the mask token first (its row is zero: logit 0,
    below the best of the other rows), so that the authors' rule, which does not exclude the mask
    token, always makes progress."""
    with torch.no_grad():
        output_head(model).weight[model.config.mask_token_id] = 0.0
    return model


def check_invariants(model, prompt, tokens, nfe_ours, nfe_authors, stats, gen_length: int = G) -> None:
    mask, eos = model.config.mask_token_id, model.config.eos_token_id
    Lp = len(prompt)
    assert len(tokens) == Lp + gen_length
    assert tokens[:Lp] == prompt, "the prompt must come back untouched"
    gen = tokens[Lp:]
    if stats["stop"] == "eos":
        assert eos in gen
        first = gen.index(eos)
        assert mask not in gen[: first + 1], "no mask before the EOS that stopped the request"
        # the stopping window is fully decoded: no mask up to the end of the winner's EOS block
        block_end = (first // stats["winner_block"] + 1) * stats["winner_block"]
        assert mask not in gen[:block_end]
    else:
        assert stats["stop"] == "all_done" and mask not in gen
    assert nfe_ours == 1 + stats["block_steps"] + stats["refreshes"]
    assert stats["forwards"] == nfe_ours
    assert nfe_authors == sum(stats["nfe_winner"].values())
    assert stats["nfe_winner"]["init"] == 1
    assert 1 <= nfe_authors <= nfe_ours
    assert stats["nfe_winner"]["refresh"] <= stats["refreshes"]


def test_trained_checkpoints_invariants(trained):
    model, prompts = trained
    seen = {"eos": 0, "syncs": 0, "refreshes": 0, "merged_tokens": 0}
    for prompt in prompts:
        stats: dict = {}
        tokens, nfe_ours, nfe_authors = reference_blockbatch(model, prompt, G, stats=stats)
        check_invariants(model, prompt, tokens, nfe_ours, nfe_authors, stats)
        seen["eos"] += stats["stop"] == "eos"
        for key in ("syncs", "refreshes", "merged_tokens"):
            seen[key] += stats[key]
    # the prompts exercise every policy of the algorithm (otherwise this test checks little)
    assert all(seen.values()), seen


def test_block_size_order_does_not_matter(trained):
    """The authors sort the block sizes: the order they are given in changes nothing."""
    model, prompts = trained
    for prompt in prompts[:3]:
        assert reference_blockbatch(model, prompt, G, block_sizes=(64, 4, 32, 8, 16)) == reference_blockbatch(
            model, prompt, G
        )


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_whole_block_branch_is_dual_cache_decoding(family, seed):
    """One branch whose block is the whole generation has nothing to merge, sync or refresh, and
    its EOS stop is the natural end: it is Fast-dLLM dual-cache decoding with one block (the
    plain decoder of the generation tests, written independently; random peaked models, whose
    special ids are the ones that decoder knows)."""
    model = no_mask_proposals(peaked(family, seed=seed))
    prompt = [5 + seed, 17, 23, 41, 8, 60][: 3 + seed]
    for gen_length, threshold in ((16, 0.9), (24, 0.5), (32, 0.99)):
        stats: dict = {}
        tokens, nfe_ours, nfe_authors = reference_blockbatch(
            model, prompt, gen_length, block_sizes=(gen_length,), threshold=threshold, stats=stats
        )
        want, want_nfe = ref_generate(
            model, prompt, gen_length, block=gen_length, mode="dual", threshold=threshold
        )
        assert tokens == want
        assert nfe_ours == nfe_authors == want_nfe
        assert stats["syncs"] == stats["refreshes"] == stats["merged_tokens"] == 0


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_models_small_configs(family, seed):
    """Random peaked models, small configs: the invariants hold whatever the tokens are."""
    model = no_mask_proposals(peaked(family, seed=seed))
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 60, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
    for sizes, sync, refresh in (((2, 4, 8), 2, 4), ((8, 16), 3, 8), ((1, 2, 4, 16), 1, 2)):
        stats: dict = {}
        tokens, nfe_ours, nfe_authors = reference_blockbatch(
            model, prompt, 16, block_sizes=sizes, threshold=0.7, sync_threshold=sync, refresh_interval=refresh,
            stats=stats,
        )  # fmt: skip
        check_invariants(model, prompt, tokens, nfe_ours, nfe_authors, stats, gen_length=16)
        assert stats["winner_block"] in sizes


def test_refresh_interval_counts_block_moves(trained):
    """A branch is due when its completed blocks x block size reach the interval: with an interval
    no block move can reach there is never a refresh; with interval 1 every block move makes its
    branch due."""
    model, prompts = trained
    total = {"never": 0, "default": 0, "often": 0}
    for prompt in prompts[:4]:
        for name, interval in (("never", 10**6), ("default", 32), ("often", 1)):
            stats: dict = {}
            reference_blockbatch(model, prompt, G, refresh_interval=interval, stats=stats)
            total[name] += stats["refreshes"]
    assert total["never"] == 0 < total["default"] < total["often"], total


def test_a_model_that_proposes_the_mask_token_forever_is_an_error_not_a_hang():
    """The authors' rule may commit the mask token (the position stays masked): a model that does
    so forever would loop forever in their code; the restatement says so instead."""
    model = peaked("llada")
    with torch.no_grad():
        output_head(model).weight[model.config.mask_token_id] = 1e4 * output_head(model).weight[5]
        output_head(model).weight[5] = 0.0
    with pytest.raises(RuntimeError, match="mask token"):
        reference_blockbatch(model, [5, 6, 7], 8, block_sizes=(4, 8))


def test_bad_block_sizes_fail_before_any_forward():
    model = peaked("llada")
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="divide gen_length"):
        reference_blockbatch(model, [5, 6, 7], 24, block_sizes=(4, 16))
    with pytest.raises(ValueError, match="divide gen_length"):
        reference_blockbatch(model, [5, 6, 7], 24, block_sizes=())
    assert not calls


def _side_by_side_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "reference_side_by_side.py"
    spec = importlib.util.spec_from_file_location("_reference_side_by_side", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_side_by_side_scores_what_it_is_given(tmp_path):
    """The comparison half of benchmarks/reference_side_by_side.py (the authors' half needs their
    code): fed results equal to the restatement on one item and altered on the other, it reports
    exactly that."""
    import json

    sbs = _side_by_side_module()
    _, items, model, _ = sbs._items("llada", ["lists"], 2)
    fake = []
    for k, item in enumerate(items):
        tokens, _, nfe_authors = reference_blockbatch(model, item["prompt_ids"], 32, block_sizes=(4, 8, 32))
        if k == 1:
            tokens = tokens[:-1] + [tokens[-1] + 1]
        fake.append({"key": item["key"], "tokens": tokens, "nfe_authors": nfe_authors + k, "stats": {}})
    results, out = tmp_path / "theirs.json", tmp_path / "out.json"
    results.write_text(json.dumps(fake))
    argv = ["--reference-results", str(results), "--suites", "lists", "--items", "2", "--gen-length", "32",
            "--block-sizes", "4", "8", "32", "--out", str(out)]  # fmt: skip
    assert sbs.main(argv) == 0
    summary = json.loads(out.read_text())["summary"]["all"]
    assert summary["items"] == 2
    assert summary["identical_tokens_pct"] == summary["identical_nfe_pct"] == 50.0
    with pytest.raises(SystemExit):
        sbs.main(["--reference-results", str(results), "--gen-length", "32", "--block-sizes", "5"])
