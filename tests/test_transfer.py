"""The transfer rules and the sampler on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch
from _generation_helpers import ref_quota

from hf_blockbatch.generation.rules import RULES, candidate_scores, make_rule
from hf_blockbatch.generation.rules.entropy import entropy_select
from hf_blockbatch.generation.rules.factor import factor_select
from hf_blockbatch.generation.rules.quota import quota_schedule, quota_select
from hf_blockbatch.generation.rules.threshold import threshold_select
from hf_blockbatch.generation.sampling import eos_probability, row_max, sample_tokens

NEG = float("-inf")


# the rules on (confidence, candidates), through the scores the engine builds for them
def threshold_rule(conf, cand, threshold):
    return threshold_select(candidate_scores(conf, cand), threshold)


def factor_rule(conf, cand, factor):
    return factor_select(candidate_scores(conf, cand), factor)


def quota_rule(conf, cand, count):
    return quota_select(candidate_scores(conf, cand), count)


def test_the_registered_rules_select_as_their_functions():
    conf = _t([[0.95, 0.2, 0.91, 0.5], [0.3, 0.1, 0.2, 0.25]])
    cand = torch.tensor([[True, True, True, False], [True, True, True, True]])
    scores = candidate_scores(conf, cand)
    assert {"threshold", "factor", "quota"} <= set(RULES)
    assert torch.equal(make_rule("threshold", threshold=0.9).select(scores, None, None, None), threshold_rule(conf, cand, 0.9))
    assert torch.equal(make_rule("factor", factor=1.0).select(scores, None, None, None), factor_rule(conf, cand, 1.0))


def _t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def test_threshold_commits_above_and_always_the_best():
    conf = _t([[0.95, 0.2, 0.91, 0.5], [0.3, 0.1, 0.2, 0.25]])
    cand = torch.ones(2, 4, dtype=torch.bool)
    sel = threshold_rule(conf, cand, 0.9)
    assert sel.tolist() == [[True, False, True, False], [True, False, False, False]]


def test_threshold_is_inclusive_and_ignores_non_candidates():
    conf = _t([[0.9, 0.99, 0.1, 0.95]])
    cand = torch.tensor([[True, False, True, True]])
    sel = threshold_rule(conf, cand, 0.9)
    assert sel.tolist() == [[True, False, False, True]]  # 0.9 >= 0.9; the 0.99 is not a candidate


def test_threshold_best_is_a_candidate_even_when_a_non_candidate_is_more_confident():
    conf = _t([[0.99, 0.3, 0.4]])
    cand = torch.tensor([[False, True, True]])
    assert threshold_rule(conf, cand, 0.9).tolist() == [[False, False, True]]


def test_rows_without_candidates_commit_nothing():
    conf = _t([[0.99, 0.98], [0.5, 0.6]])
    cand = torch.tensor([[False, False], [True, False]])
    assert threshold_rule(conf, cand, 0.5).tolist() == [[False, False], [True, False]]
    assert factor_rule(conf, cand, 1.0).tolist() == [[False, False], [True, False]]
    assert quota_rule(conf, cand, torch.tensor([2, 2])).tolist() == [[False, False], [True, False]]


def test_ties_commit_exactly_one_at_the_minimum():
    conf = _t([[0.3, 0.3, 0.3]])
    cand = torch.ones(1, 3, dtype=torch.bool)
    assert int(threshold_rule(conf, cand, 0.9).sum()) == 1
    assert int(factor_rule(conf, cand, 1.0).sum()) == 1
    assert int(quota_rule(conf, cand, torch.tensor([2])).sum()) == 2
    # tied above the threshold: all of them
    assert threshold_rule(_t([[0.95, 0.95, 0.95]]), cand, 0.9).all()


def test_factor_rule_known_example():
    # exact binary fractions; sorted: 0.875, 0.8125, 0.75, 0.5 -> (n+1)(1-c_n): 0.25, 0.5625, 1.0, 2.5
    conf = _t([[0.75, 0.875, 0.5, 0.8125]])
    cand = torch.ones(1, 4, dtype=torch.bool)
    assert factor_rule(conf, cand, 1.0).tolist() == [[False, True, False, True]]  # 1.0 < 1.0 fails: n = 2
    assert factor_rule(conf, cand, 1.01).tolist() == [[True, True, False, True]]  # n = 3
    assert factor_rule(conf, cand, 0.1).tolist() == [[False, True, False, False]]  # none pass: at least one
    assert factor_rule(conf, cand, 3.0).all()


def test_factor_rule_counts_only_candidates():
    conf = _t([[0.99, 0.99, 0.2, 0.97]])
    cand = torch.tensor([[False, False, True, True]])
    # candidates sorted: 0.97 (2*0.03 = 0.06), 0.2 (3*0.8 = 2.4)
    assert factor_rule(conf, cand, 1.0).tolist() == [[False, False, False, True]]


def test_quota_rule_commits_the_most_confident():
    conf = _t([[0.1, 0.7, 0.3, 0.9], [0.6, 0.5, 0.4, 0.3]])
    cand = torch.tensor([[True, True, True, True], [False, True, True, True]])
    sel = quota_rule(conf, cand, torch.tensor([2, 3]))
    assert sel.tolist() == [[False, True, False, True], [False, True, True, True]]


def test_quota_schedule_matches_llada():
    for masked in range(0, 20):
        for steps in range(1, 9):
            got = [int(quota_schedule(torch.tensor(masked), steps, torch.tensor(i))) for i in range(steps)]
            assert got == ref_quota(masked, steps), (masked, steps)
            assert sum(got) == masked


def test_minus_inf_confidences_still_make_progress():
    conf = _t([[NEG, NEG, NEG], [NEG, 0.2, NEG]])
    cand = torch.tensor([[True, True, False], [True, True, True]])
    for sel in (
        threshold_rule(conf, cand, 0.9),
        factor_rule(conf, cand, 1.0),
        quota_rule(conf, cand, torch.tensor([1, 1])),
    ):
        assert sel.sum(-1).tolist() == [1, 1]
        assert not (sel & ~cand).any()
    assert threshold_rule(conf, cand, 0.9)[1].tolist() == [False, True, False]


def test_entropy_rule_takes_the_confident_prefix_within_its_budget():
    """Entropy-bounded commits: candidates by confidence, the longest prefix whose entropies sum to at most
    the bound above their largest; always the best candidate; never a non-candidate; a row without
    candidates commits nothing."""
    conf = _t([[0.9, 0.5, 0.8, 0.7, 0.99], [0.3, 0.2, 0.1, 0.0, 0.0]])
    cand = torch.tensor([[True, True, True, True, False], [False, False, False, False, False]])
    h = _t([[0.1, 0.9, 0.2, 0.4, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    scores = candidate_scores(conf, cand)

    def take(bound):
        return entropy_select(scores, h, bound)[0].nonzero().flatten().tolist()

    assert take(0.0) == [0]  # by confidence 0, 2, 3, 1: sums minus max 0, 0.1, 0.3, 0.7
    assert take(0.11) == [0, 2] and take(0.31) == [0, 2, 3] and take(0.71) == [0, 1, 2, 3]
    assert take(0.29) == [0, 2]  # a prefix: the budget ends at the first candidate past it
    assert not entropy_select(scores, h, 10.0)[1].any()
    rule = make_rule("entropy", bound=0.3)
    assert rule.needs_entropy and torch.equal(rule.select(scores, None, None, None, h), entropy_select(scores, h, 0.3))
    with pytest.raises(ValueError, match="reads each proposal's entropy"):
        rule.select(scores, None, None, None)


def test_sample_tokens_entropy_is_the_proposal_distributions():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    got = sample_tokens(logits, 0.0, "low_confidence", 0, entropy=True, mask_id=39)
    p = torch.softmax(logits.double(), -1)[:, :39]  # the mask id is never proposed; the others keep their mass
    torch.testing.assert_close(got.entropy, -(p * p.log()).sum(-1), atol=1e-5, rtol=0)
    assert sample_tokens(logits, 0.0, "low_confidence", 0).entropy is None


def test_threshold_is_lower_while_a_window_has_many_masks_left():
    """``many_masks_threshold``: a row with more than ``many_masks`` candidates (masks left in its window) commits
    at that threshold, a row with fewer at the threshold; each row counts its own, and the best always commits."""
    conf = _t([[0.87, 0.86, 0.2, 0.84, 0.91], [0.87, 0.86, 0.2, 0.84, 0.5], [0.87, 0.3, 0.2, 0.1, 0.5]])
    cand = torch.tensor([[True] * 5, [True, True, True, True, False], [True, False, False, False, True]])
    rule = make_rule("threshold", threshold=0.9, many_masks_threshold=0.85, many_masks=3)
    got = rule.select(candidate_scores(conf, cand), None, None, None)
    assert got.tolist() == [[True, True, False, False, True],  # 5 masks left: 0.85
                            [True, True, False, False, False],  # 4 left: 0.85 (0.5 is not a candidate)
                            [True, False, False, False, False]]  # 2 left: 0.9, and the best anyway
    at_four = make_rule("threshold", threshold=0.9, many_masks_threshold=0.85, many_masks=4)
    assert at_four.select(candidate_scores(conf, cand), None, None, None)[1].tolist() == [True] + [False] * 4
    plain = make_rule("threshold", threshold=0.9)
    assert torch.equal(plain.select(candidate_scores(conf, cand), None, None, None), threshold_rule(conf, cand, 0.9))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(entropy_bound=0.2), "entropy_bound is the entropy rule's budget: set rule='entropy'"),
        (dict(rule="entropy"), "give a number >= 0"),
        (dict(rule="entropy", entropy_bound=-0.1), "give a number >= 0"),
        (dict(rule="entropy", entropy_bound=float("nan")), "entropy_bound must be a finite number"),
        (dict(rule="entropy", entropy_bound=0.2, factor=1.0), "replaces the threshold, factor and steps rules"),
        (dict(many_masks=8), "set many_masks_threshold"),
        (dict(many_masks_threshold=0.0), "many_masks_threshold must be in"),
        (dict(many_masks_threshold="high"), "many_masks_threshold must be a number"),
        (dict(many_masks_threshold=0.85, many_masks=-1), "many_masks must be a whole number"),
        (dict(many_masks_threshold=0.85, many_masks=2.5), "many_masks must be a whole number"),
        (dict(many_masks_threshold=0.85, threshold=None, factor=1.0), "needs threshold .and no rule., not factor"),
        (dict(many_masks_threshold=0.85, rule="entropy", entropy_bound=0.2), "not rule='entropy'"),
    ],
)
@pytest.mark.parametrize("strategy", ["fast_dllm", "blockbatch"])
def test_bad_rule_options_fail_at_once(strategy, options, message):
    import hf_blockbatch as hb

    cls = hb.FastDLLMConfig if strategy == "fast_dllm" else hb.BlockBatchConfig
    with pytest.raises(ValueError, match=message):
        cls(max_new_tokens=8, **options)


def test_rule_options_save_and_load(tmp_path):
    import hf_blockbatch as hb

    hb.FastDLLMConfig(rule="entropy", entropy_bound=0.25, block_length=32).save_pretrained(tmp_path / "entropy")
    back = hb.FastDLLMConfig.from_pretrained(tmp_path / "entropy")
    assert (back.rule, back.entropy_bound) == ("entropy", 0.25)
    hb.FastDLLMConfig(many_masks_threshold=0.8, many_masks=12, block_length=32).save_pretrained(tmp_path / "many")
    back = hb.FastDLLMConfig.from_pretrained(tmp_path / "many")
    assert (back.many_masks_threshold, back.many_masks) == (0.8, 12)
    assert (hb.FastDLLMConfig().many_masks_threshold, hb.BlockBatchConfig().many_masks) == (None, None)


@pytest.mark.parametrize("shape", [(8, 1024), (64, 1024), (40, 2048), (1024, 96), (33, 96), (50, 1000), (3, 126464)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_max_equals_max_dim_with_ties_and_infinities(shape, dtype):
    """The blocked CPU reduction returns max(dim=-1)'s values and first indices exactly: ties
    inside a block and across blocks, rows all -inf (a suppressed vocabulary), a NaN row."""
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    x = torch.randint(-4, 4, shape, generator=g).to(dtype)  # many exact ties
    x[0] = float("-inf")
    x[1, 5], x[1, shape[1] - 1] = 99.0, 99.0  # two maxima in different blocks: the first wins
    x[2] = torch.randn(shape[1], generator=g, dtype=dtype)
    if shape[0] > 3:
        x[3, shape[1] // 2] = float("nan")
    values, indices = row_max(x)
    ref = x.max(dim=-1)
    assert torch.equal(indices, ref.indices)
    assert torch.equal(values.nan_to_num(7.0), ref.values.nan_to_num(7.0))
    assert indices[1] == 5 and indices[0] == 0


def test_row_max_of_a_non_contiguous_tensor():
    x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(0)).t()  # [64, 1024], strided
    assert torch.equal(row_max(x)[1], x.max(-1).indices)


def test_sample_tokens_refuses_a_negative_temperature_and_an_unknown_remasking():
    """A negative or NaN temperature raised an UnboundLocalError inside the draw; a misspelt remasking was read as
    low_confidence."""
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1.0"):
        sample_tokens(logits, -1.0, "low_confidence", 0)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        sample_tokens(logits, float("nan"), "low_confidence", 0)
    with pytest.raises(ValueError, match="remasking must be one of \\('low_confidence', 'random'\\), got 'low_confidense'"):
        sample_tokens(logits, 0.0, "low_confidense", 0)


def test_sample_tokens_greedy_and_confidence():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    s = sample_tokens(logits, 0.0, "low_confidence", top_k=2)
    assert s.tokens.tolist() == [1, 0]
    expect = torch.softmax(logits.double(), -1).max(-1).values
    assert torch.allclose(s.confidence, expect)
    assert s.confidence.dtype == torch.float64
    assert s.top_ids[:, 0].tolist() == [1, 0]


def test_sample_tokens_suppress_and_low_confidence_ids():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 4.0]])
    s = sample_tokens(logits, 0.0, "low_confidence", 2, suppress_logit_ids=torch.tensor([1]))
    assert s.tokens.tolist() == [2, 2]
    s = sample_tokens(logits, 0.0, "low_confidence", 2, low_confidence_ids=torch.tensor([2]))
    assert s.tokens.tolist() == [1, 2]
    assert s.confidence[1] == NEG and s.confidence[0] > 0.9


def test_sample_tokens_gumbel_is_seeded():
    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    a = sample_tokens(logits, 1.0, "low_confidence", 2, torch.Generator().manual_seed(5)).tokens
    b = sample_tokens(logits, 1.0, "low_confidence", 2, torch.Generator().manual_seed(5)).tokens
    c = sample_tokens(logits, 1.0, "low_confidence", 2, torch.Generator().manual_seed(6)).tokens
    assert torch.equal(a, b) and not torch.equal(a, c)
    r = sample_tokens(logits, 0.0, "random", 2, torch.Generator().manual_seed(5)).confidence
    assert ((r >= 0) & (r < 1)).all()


@pytest.mark.parametrize("top_k", [0, 1, 3])
def test_a_sampled_proposals_confidence_is_the_sampled_tokens_probability(top_k):
    """At a temperature, low_confidence ranks each slot by the softmax probability of the token it drew (LLaDA's
    ``x0_p = gather(p, x0)``), not by the row's best token's: on rows where the draw is not the argmax the two
    differ. For every ``top_k`` (a top-k map or none: the best token is found two ways)."""
    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(0))
    s = sample_tokens(logits, 1.0, "low_confidence", top_k, torch.Generator().manual_seed(1), mask_id=39)
    p = torch.softmax(logits.double(), -1)
    assert int((s.tokens != p[:, :39].argmax(-1)).sum()) > 10  # many draws are not the most probable token
    want = p.gather(1, s.tokens[:, None]).squeeze(1)
    torch.testing.assert_close(s.probability, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(s.confidence, want, atol=1e-6, rtol=0)


def test_gumbel_scores_in_log_space_pick_lladas_tokens():
    """Sampled proposals score ``logits - T log(-log u)``, the logarithm of LLaDA's ``exp(logits) / (-log u)^T``:
    with the same noise the same token on 80,000 rows (logit scales 1-30, temperatures 0.3-2), and where LLaDA's
    exp overflows (logits above 709, every score infinite, the first id taken) still a draw of the softmax."""
    torch.manual_seed(0)
    for scale in (1.0, 3.0, 10.0, 30.0):
        for t in (0.3, 0.5, 1.0, 2.0):
            logits = torch.randn(5000, 96) * scale
            ours = sample_tokens(logits, t, "low_confidence", 1, torch.Generator().manual_seed(7)).tokens
            u = torch.rand(logits.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
            assert torch.equal(ours, (logits.double().exp() / (-torch.log(u)) ** t).argmax(-1))
    big = torch.tensor([[800.0, 801.0]]).expand(4000, 2)
    share = float(sample_tokens(big, 1.0, "low_confidence", 1, torch.Generator().manual_seed(1)).tokens.double().mean())
    assert abs(share - 1 / (1 + math.exp(-1))) < 0.03  # 0.731; LLaDA's overflowing formula gives 0


def test_sample_tokens_maps_and_eos_probability():
    logits = torch.randn(6, 9, generator=torch.Generator().manual_seed(3))
    probs = torch.softmax(logits.double(), -1)
    eos = torch.tensor([4, 7])
    none = sample_tokens(logits, 0.0, "low_confidence", 0)
    assert none.top_probs is None and none.top_ids is None
    assert torch.allclose(eos_probability(logits, eos).double(), probs[:, [4, 7]].sum(-1), atol=1e-6)
    one = sample_tokens(logits, 0.0, "low_confidence", 1)
    assert torch.equal(one.top_ids[:, 0], probs.argmax(-1))
    assert torch.allclose(one.top_probs[:, 0].double(), probs.max(-1).values, atol=1e-6)
    three = sample_tokens(logits, 0.0, "low_confidence", 3)
    assert torch.equal(three.top_ids, probs.topk(3, -1).indices)
    for s in (none, one, three):  # every map size proposes the same greedy tokens
        assert torch.equal(s.tokens, probs.argmax(-1))


def test_probability_map_size_is_exact_for_the_merge_threshold():
    import hf_blockbatch as hb
    from hf_blockbatch.generation.plans import map_size, plan_from_config

    for t, k in ((0.5, 1), (0.9, 1), (0.4, 2), (1 / 3, 2), (0.3, 3), (0.25, 3), (0.2, 4)):
        assert map_size(t) == k
        assert plan_from_config(hb.BlockBatchConfig(merge_threshold=t), [1], []).map_k == k
        # fewer than 1/t tokens can each exceed t, so the top k always holds any token above t
        assert (k + 1) * t >= 1 - 1e-12
    assert plan_from_config(hb.FastDLLMConfig(), [1], []).map_k == 0
    assert plan_from_config(hb.BlockBatchConfig(merge=False), [1], []).map_k == 0


@pytest.mark.parametrize("temperature,remasking,top_k,entropy", [
    (0.0, "low_confidence", 0, False), (0.0, "low_confidence", 1, True), (0.0, "low_confidence", 3, False),
    (0.7, "low_confidence", 2, True), (1.0, "random", 0, False),
])  # fmt: skip
@pytest.mark.parametrize("keyed", [False, True], ids=["generator", "keyed"])
def test_sample_tokens_in_row_chunks_proposes_the_same(monkeypatch, temperature, remasking, top_k, entropy, keyed):
    """Rows proposed in chunks (what bounds the float copies of a large vocabulary's logits) give the same
    proposals, confidences and maps as one pass, sampled noise included (a CPU draws it in the same order; keyed
    noise: each chunk hashes its own rows' keys)."""
    from hf_blockbatch.generation import sampling

    logits = torch.randn(23, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    kwargs = dict(suppress_logit_ids=torch.tensor([4]), low_confidence_ids=torch.tensor([7, 9]), mask_id=39,
                  entropy=entropy)  # fmt: skip
    if keyed:
        kwargs["noise_keys"] = torch.randint(0, 2**32, (23,), generator=torch.Generator().manual_seed(6))
    whole = sample_tokens(logits, temperature, remasking, top_k, None if keyed else torch.Generator().manual_seed(5), **kwargs)
    monkeypatch.setattr(sampling, "SAMPLE_CHUNK_ELEMENTS", 5 * 40)  # rows in chunks of 5 (the last of 3)
    chunked = sample_tokens(logits, temperature, remasking, top_k, None if keyed else torch.Generator().manual_seed(5),
                            **kwargs)  # fmt: skip
    for name in ("tokens", "confidence", "probability", "top_probs", "top_ids", "entropy"):
        a, b = getattr(whole, name), getattr(chunked, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert chunked.top_probs is None or chunked.top_probs.shape[0] == 23
