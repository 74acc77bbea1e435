"""LocalLeap (Kong et al. 2025): the vectorised rule against a plain per-position loop, its
properties on random score matrices, its option checks, and a small decode on the tiny models."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from _generation_helpers import peaked, ref_generate
from _localleap_reference import ScriptedModel, ref_localleap, rule_decode
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hf_blockbatch.generation.rules.localleap import (
    ANCHOR_THRESHOLD,
    RADIUS,
    RELAXED_THRESHOLD,
    LocalLeapRule,
    localleap_select,
)
from hf_blockbatch.generation.rules.threshold import threshold_select

NEG = float("-inf")
DEFAULTS = dict(anchor_threshold=ANCHOR_THRESHOLD, relaxed_threshold=RELAXED_THRESHOLD, radius=RADIUS)


def select(rows, **options):
    return localleap_select(torch.tensor(rows, dtype=torch.float64), **{**DEFAULTS, **options}).tolist()


def loop_select(scores: torch.Tensor, anchor: float, relaxed: float, radius: int) -> list[list[bool]]:
    """The plain restatement applied row by row (candidates are the finite slots)."""
    out = []
    for row in scores.tolist():
        conf = {w: c for w, c in enumerate(row) if c != NEG}
        chosen = set(ref_localleap(conf, anchor, relaxed, radius))
        out.append([w in chosen for w in range(len(row))])
    return out


# ----------------------------------------------------------------------------- fixed cases
def test_neighbours_within_radius_commit_at_the_relaxed_threshold():
    # anchor at 0; 0.8 at distances 1..5: radius 4 reaches slot 4, not slot 5
    row = [0.95, 0.8, 0.8, 0.8, 0.8, 0.8, 0.2]
    assert select([row]) == [[True, True, True, True, True, False, False]]
    assert select([row], radius=1) == [[True, True, False, False, False, False, False]]


def test_no_chaining_a_relaxed_commit_is_not_an_anchor():
    # slot 8 is 4 from the relaxed commit at slot 4 but 8 from the anchor: not committed
    row = [0.95, NEG, NEG, NEG, 0.8, NEG, NEG, NEG, 0.8]
    assert select([row]) == [[True, False, False, False, True, False, False, False, False]]


def test_decoded_slots_do_not_stop_the_neighbourhood():
    # the distance is counted in canvas positions, across already-decoded slots
    row = [0.95, NEG, NEG, 0.8, NEG, 0.8]
    assert select([row]) == [[True, False, False, True, False, False]]


def test_decoded_tokens_are_not_anchors():
    # a decoded neighbour (however confident it was when committed) relaxes nothing
    row = [NEG, 0.8, 0.85, 0.6]
    assert select([row]) == [[False, False, True, False]]


def test_below_the_relaxed_threshold_only_the_best_commits():
    assert select([[0.95, 0.7, 0.74]]) == [[True, False, False]]
    assert select([[0.3, 0.1, 0.2]]) == [[True, False, False]]  # no anchor, all below: the best


def test_without_an_anchor_relaxed_candidates_wait():
    assert select([[0.8, 0.85, 0.8]]) == [[False, True, False]]


def test_thresholds_are_inclusive():
    assert select([[0.9, 0.75, 0.7499]]) == [[True, True, False]]


def test_anchors_at_both_edges_and_on_either_side():
    row = [0.8, 0.95, 0.2, 0.2, 0.2, 0.2, 0.2, 0.8, 0.2, 0.95]
    assert select([row], radius=2) == [[True, True, False, False, False, False, False, True, False, True]]


def test_rows_are_independent_and_rows_without_candidates_commit_nothing():
    rows = [[0.95, 0.8, 0.8], [NEG, NEG, NEG], [0.8, 0.8, 0.85]]
    assert select(rows) == [[True, True, True], [False] * 3, [False, False, True]]


def test_ties_commit_the_first_best_only():
    assert select([[0.5, 0.5, 0.5]]) == [[True, False, False]]


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty_shapes(shape):
    out = localleap_select(torch.empty(shape), **DEFAULTS)
    assert out.shape == shape and not out.any()


def test_float32_scores_give_what_the_same_values_give_in_float64():
    torch.manual_seed(0)
    scores = torch.rand(4, 32).masked_fill(torch.rand(4, 32) < 0.3, NEG)
    expected = localleap_select(scores.double(), **DEFAULTS)
    assert torch.equal(localleap_select(scores, **DEFAULTS), expected)


# ----------------------------------------------------------------------------- random matrices
_VALUES = st.one_of(
    st.just(NEG),
    st.sampled_from([0.9, 0.75, 0.5, 1.0]),  # exactly at the thresholds hypothesis picks below
    st.floats(min_value=1e-6, max_value=1.0, allow_nan=False),
)


@st.composite
def cases(draw):
    rows, width = draw(st.integers(1, 5)), draw(st.integers(1, 24))
    scores = torch.tensor(draw(st.lists(st.lists(_VALUES, min_size=width, max_size=width), min_size=rows, max_size=rows)), dtype=torch.float64)  # fmt: skip
    committed_before = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=width, max_size=width), min_size=rows, max_size=rows)))  # fmt: skip
    scores = scores.masked_fill(committed_before, NEG)  # a decoded slot is never a candidate
    anchor = draw(st.sampled_from([0.9, 0.75, 0.5, 1.0]) | st.floats(0.05, 1.0))
    relaxed = draw(st.sampled_from([anchor, 0.75, 0.5]).filter(lambda r: r <= anchor) | st.floats(0.01, anchor))
    radius = draw(st.integers(1, width + 2))
    return scores, committed_before, anchor, relaxed, radius


_SETTINGS = settings(
    max_examples=300, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


@_SETTINGS
@given(cases())
def test_equals_the_per_position_loop(case):
    scores, _, anchor, relaxed, radius = case
    out = localleap_select(scores, anchor_threshold=anchor, relaxed_threshold=relaxed, radius=radius)
    assert out.tolist() == loop_select(scores, anchor, relaxed, radius)


@_SETTINGS
@given(cases())
def test_properties(case):
    scores, _, anchor, relaxed, radius = case
    options = dict(anchor_threshold=anchor, relaxed_threshold=relaxed, radius=radius)
    out = localleap_select(scores, **options)
    candidates = scores > NEG
    assert not (out & ~candidates).any()  # never a non-candidate (so never a decoded slot)
    assert torch.equal(out.any(-1), candidates.any(-1))  # a row with candidates commits at least one
    # below the relaxed threshold: only the row's single best candidate
    low = out & (scores < relaxed)
    assert (low.sum(-1) <= 1).all()
    best = scores.argmax(-1)
    assert all(int(best[a]) == int(w) for a, w in low.nonzero().tolist())
    # between Fast-dLLM's threshold rule at the anchor threshold and at the relaxed one
    assert not (threshold_select(scores, anchor) & ~out).any()
    assert not (out & ~threshold_select(scores, relaxed)).any()
    if relaxed == anchor:
        assert torch.equal(out, threshold_select(scores, anchor))
    # a wider neighbourhood commits a superset
    wider = localleap_select(scores, **{**options, "radius": radius + 1})
    assert not (out & ~wider).any()


# ----------------------------------------------------------------------------- options
def test_defaults_are_the_papers():
    rule = LocalLeapRule()
    assert (rule.anchor_threshold, rule.relaxed_threshold, rule.radius) == (0.9, 0.75, 4)
    rule.validate()
    LocalLeapRule(anchor_threshold=1.0, relaxed_threshold=1.0, radius=1).validate()


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(radius=0), "radius must be a positive integer"),
        (dict(radius=-2), "radius must be a positive integer"),
        (dict(radius=2.5), "radius must be a positive integer"),
        (dict(radius=True), "radius must be a positive integer"),
        (dict(radius="4"), "radius must be a positive integer"),
        (dict(anchor_threshold=0.0), "anchor_threshold must be a number in \\(0, 1\\]"),
        (dict(anchor_threshold=1.5), "anchor_threshold must be"),
        (dict(anchor_threshold=math.nan), "anchor_threshold must be"),
        (dict(anchor_threshold=math.inf), "anchor_threshold must be"),
        (dict(anchor_threshold="0.9"), "anchor_threshold must be"),
        (dict(anchor_threshold=None), "anchor_threshold must be"),
        (dict(relaxed_threshold=-0.1), "relaxed_threshold must be"),
        (dict(relaxed_threshold=math.nan), "relaxed_threshold must be"),
        (dict(relaxed_threshold=True), "relaxed_threshold must be"),
        (dict(relaxed_threshold=0.95), "must not exceed anchor_threshold"),
        (dict(anchor_threshold=0.6, relaxed_threshold=0.75), "must not exceed anchor_threshold"),
    ],
)
def test_bad_options_get_one_line_errors(options, message):
    with pytest.raises(ValueError, match=message) as info:
        LocalLeapRule(**options).validate()
    assert "\n" not in str(info.value) and "paper uses" in str(info.value)


def test_rule_select_is_the_function():
    rule = LocalLeapRule(anchor_threshold=0.8, relaxed_threshold=0.5, radius=2)
    scores = torch.tensor([[0.85, 0.6, 0.55, 0.55, 0.9, NEG]], dtype=torch.float64)
    assert torch.equal(
        rule.select(scores),
        localleap_select(scores, anchor_threshold=0.8, relaxed_threshold=0.5, radius=2),
    )


# ----------------------------------------------------------------------------- decoding
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]]


def check_decode(model, block: int, rule: LocalLeapRule, new: int = 16) -> int:
    """Decode PROMPTS together, each step's commits chosen by the vectorised rule for all rows at
    once, and check: the same tokens and NFE as the plain reference decoder with the per-position
    rule; committed tokens never change; every step commits; only a row's best commits below the
    relaxed threshold. Returns how many tokens were committed at the relaxed threshold."""
    rule.validate()
    canvases, nfe, trace = rule_decode(model, PROMPTS, new, block, rule.select)
    plain = partial(ref_localleap, anchor=rule.anchor_threshold, relaxed=rule.relaxed_threshold, radius=rule.radius)
    for a, prompt in enumerate(PROMPTS):
        assert (canvases[a], nfe[a]) == ref_generate(model, prompt, new, block, "none", select=plain)
    relaxed_commits = 0
    for step in trace:
        assert step.committed and set(step.committed) <= set(step.conf)
        assert all(step.after[p] == step.before[p] for p in range(len(step.before)) if p not in step.conf)
        best = max(step.conf, key=lambda p: (step.conf[p], -p))
        assert all(p == best for p in step.committed if step.conf[p] < rule.relaxed_threshold)
        relaxed_commits += sum(
            rule.relaxed_threshold <= step.conf[p] < rule.anchor_threshold for p in step.committed if p != best
        )
    return relaxed_commits


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("block, options", [(8, DEFAULTS), (4, dict(anchor_threshold=0.7, relaxed_threshold=0.4, radius=2))])
def test_decoding_the_tiny_models(family, block, options):
    check_decode(peaked(family, scale=40.0), block, LocalLeapRule(**options))


@pytest.mark.parametrize("block, radius", [(8, 4), (16, 1), (5, 2)])
def test_decoding_where_the_relaxation_acts(block, radius):
    model = ScriptedModel(len(PROMPTS[0]) + 16)
    assert check_decode(model, block, LocalLeapRule(radius=radius)) > 0


# ----------------------------------------------------------------------------- through generate()
@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("mode", ["none", "prefix", "dual"])
def test_fast_dllm_with_localleap_equals_the_plain_decoder(family, mode):
    """``FastDLLMConfig(rule="localleap")`` decodes as the plain reference decoder with the
    per-position LocalLeap rule, in every cache mode (tokens and NFE)."""
    from _generation_helpers import ref_generate

    import hf_blockbatch as hb

    model = peaked(family, scale=40.0)
    options = dict(threshold=0.7, relaxed_threshold=0.4, leap_radius=2)
    plain = partial(ref_localleap, anchor=0.7, relaxed=0.4, radius=2)
    cfg = hb.FastDLLMConfig(max_new_tokens=16, block_length=8, cache=mode, rule="localleap", **options)
    for prompt in PROMPTS:
        out = model.generate(torch.tensor([prompt]), generation_config=cfg, return_dict_in_generate=True)
        assert (out.sequences[0].tolist(), int(out.nfe[0])) == ref_generate(model, prompt, 16, 8, mode, select=plain)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(rule="localleap", leap_radius=0), "leap_radius must be a positive integer"),
        (dict(rule="localleap", relaxed_threshold=1.5), "relaxed_threshold must be a number in"),
        (dict(rule="localleap", relaxed_threshold=float("nan")), "relaxed_threshold must be a number in"),
        (dict(rule="localleap", threshold=0.6, relaxed_threshold=0.8), "must not exceed threshold"),
        (dict(rule="localleap", threshold=None, factor=1.0), "give threshold"),
        (dict(relaxed_threshold=0.7), "is a LocalLeap option: set rule='localleap'"),
        (dict(leap_radius=3, relaxed_threshold=0.7), "are LocalLeap options"),
        (dict(rule="leap"), "rule must be 'localleap', 'entropy' or unset"),
    ],
)
@pytest.mark.parametrize("strategy", ["fast_dllm", "blockbatch"])
def test_bad_localleap_options_fail_before_any_forward(strategy, options, message):
    import hf_blockbatch as hb

    cls = hb.FastDLLMConfig if strategy == "fast_dllm" else hb.BlockBatchConfig
    with pytest.raises(ValueError, match=message) as info:
        cls(max_new_tokens=8, **options)
    assert "\n" not in str(info.value)


def test_localleap_commits_more_per_step_than_its_anchor_threshold():
    """On a trained checkpoint LocalLeap needs fewer forwards than the threshold rule at its anchor
    threshold (same model, same prompts): the relaxed commits act."""
    import hf_blockbatch as hb
    from hf_blockbatch.tasks import get_suite

    model, tokenizer = hb.load_model("tiny-llada", device="cpu")
    suite = get_suite("code")
    texts = [suite.prompt(item, tokenizer) for item in suite.items("test", limit=8)]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    nfe = {}
    for name, extra in (("threshold", {}), ("localleap", {"rule": "localleap"})):
        cfg = hb.FastDLLMConfig(max_new_tokens=64, block_length=32, early_stop=True, **extra)
        nfe[name] = int(model.generate(**enc, generation_config=cfg, return_dict_in_generate=True).nfe.sum())
    assert nfe["localleap"] < nfe["threshold"]
