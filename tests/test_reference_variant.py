"""``BlockBatchConfig(variant="reference")``: the authors' bulk BlockBatch from our vectorised parts.

The oracle is the plain restatement ``tests/_reference_blockbatch.py`` (loops over branches and
positions; measured equal to the authors' own code, see docs/reference_variant.md). The variant
must give the same tokens, the same winning branch, the same authors' NFE (``stats["nfe_authors"]``)
and, as ``.nfe``, the restatement's count of every forward of the request.

The restatement leaves the positions after an EOS stop masked; the library fills them with the
pad id (EOS), so the comparison does the same to the restatement's canvas.
"""

from __future__ import annotations

import pytest
import torch
from _generation_helpers import eos_model, peaked
from _reference_blockbatch import reference_blockbatch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_reference_blockbatch import no_mask_proposals

import hf_blockbatch as hb
from hf_blockbatch.generation import BlockBatchConfig
from hf_blockbatch.tasks import get_suite

AUTHORS_SIZES = [4, 8, 16, 32, 64]


def _generate(model, prompts: list[list[int]], **options):
    """Our variant on left-padded ``prompts``; returns (rows of tokens without padding, nfe, stats)."""
    cfg = BlockBatchConfig(variant="reference", **options)
    width = max(len(p) for p in prompts)
    pad = model.config.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)
    rows = [seq[width - len(p) :] for seq, p in zip(out.sequences.tolist(), prompts)]
    return rows, out.nfe.tolist(), out.stats


def _restated(model, prompt: list[int], gen_length: int, merge=True, sync=True, refresh="periodic", **options):
    """The restatement, with our switches expressed in its parameters (a merge never above 1, a
    lag never above 10**9, an interval never reached)."""
    if not merge:
        options["merge_threshold"] = 1.0
    if not sync:
        options["sync_threshold"] = 10**9
    if refresh == "off":
        options["refresh_interval"] = 10**9
    stats: dict = {}
    tokens, nfe_ours, nfe_authors = reference_blockbatch(model, prompt, gen_length, stats=stats, **options)
    mask, pad = model.config.mask_token_id, model.config.eos_token_id
    return [pad if t == mask else t for t in tokens], nfe_ours, (nfe_authors, stats["winner_block"])


def _suite_prompts(tokenizer, per_suite: int) -> list[list[int]]:
    prompts = []
    for suite in ("arith", "code", "lists"):
        task = get_suite(suite)
        for item in task.items("test", per_suite):
            prompts.append(tokenizer(task.prompt(item, tokenizer, chat=True), add_special_tokens=False).input_ids)
    return prompts


@pytest.fixture(scope="module")
def tiny_llada():
    model, tokenizer = hb.load_model("tiny-llada", device="cpu", dtype=torch.float32)
    return model, _suite_prompts(tokenizer, 6)


@pytest.mark.parametrize("gen_length,sizes", [(64, AUTHORS_SIZES), (32, [2, 4, 8, 16])])
def test_trained_checkpoint_suite_items_equal_the_restatement(tiny_llada, gen_length, sizes):
    model, prompts = tiny_llada
    for prompt in prompts:
        want, want_nfe, want_authors = _restated(model, prompt, gen_length, block_sizes=sizes)
        rows, nfe, stats = _generate(model, [prompt], max_new_tokens=gen_length, block_sizes=sizes)
        assert rows[0] == want
        assert (stats[0]["nfe_authors"], stats[0]["winner_block_size"]) == want_authors
        assert nfe[0] == want_nfe


def test_padded_batch_equals_each_prompt_alone(tiny_llada):
    model, prompts = tiny_llada
    batch = prompts[::3][:5]
    assert len({len(p) for p in batch}) > 1, "the batch must need padding"
    rows, nfe, stats = _generate(model, batch, max_new_tokens=64, block_sizes=AUTHORS_SIZES)
    for prompt, row, n, st_ in zip(batch, rows, nfe, stats):
        want, want_nfe, want_authors = _restated(model, prompt, 64, block_sizes=AUTHORS_SIZES)
        alone = _generate(model, [prompt], max_new_tokens=64, block_sizes=AUTHORS_SIZES)
        assert row == want == alone[0][0]
        assert n == want_nfe == alone[1][0]
        assert (st_["nfe_authors"], st_["winner_block_size"]) == want_authors


_MODELS: dict[str, torch.nn.Module] = {}


def _random_model(kind: str, seed: int):
    key = f"{kind}-{seed}"
    if key not in _MODELS:
        _MODELS[key] = no_mask_proposals(peaked("llada", seed=seed) if kind == "peaked" else eos_model("llada", seed))
    return _MODELS[key]


configs = st.fixed_dictionaries(
    {
        "block_sizes": st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=1, max_size=4, unique=True),
        "threshold": st.sampled_from([0.3, 0.5, 0.7, 0.9]),
        "merge_threshold": st.sampled_from([0.05, 0.3, 0.5, 0.8]),
        "sync_threshold": st.integers(0, 6),
        "refresh_interval": st.sampled_from([1, 2, 4, 8, 32]),
        "merge": st.booleans(),
        "sync": st.booleans(),
        "refresh": st.sampled_from(["periodic", "periodic", "off"]),
    }
)


@settings(max_examples=40, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    cfg=configs,
    kind=st.sampled_from(["peaked", "eos"]),
    seed=st.integers(0, 2),
    prompt=st.lists(st.integers(5, 91), min_size=2, max_size=9),
)
def test_random_small_configs_equal_the_restatement(cfg, kind, seed, prompt):
    """Random peaked models (the mask token never ranked first, as the restatement's rule does
    not exclude it), block sizes in any order, every switch."""
    model = _random_model(kind, seed)
    want, want_nfe, want_authors = _restated(model, prompt, 16, **cfg)
    rows, nfe, stats = _generate(model, [prompt], max_new_tokens=16, **cfg)
    assert rows[0] == want
    assert (stats[0]["nfe_authors"], stats[0]["winner_block_size"]) == want_authors
    assert nfe[0] == want_nfe


def test_the_default_variant_is_ours():
    assert BlockBatchConfig().variant == "ours"


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(factor=1.0, threshold=None), "factor"),
        (dict(rule="localleap"), "rule='localleap'"),
        (dict(refresh="divergence"), "divergence"),
        (dict(skip_completed_block_step=True), "skip_completed_block_step"),
        (dict(temperature=0.7), "temperature"),
        (dict(remasking="random"), "remasking"),
        (dict(early_stop=False), "early_stop"),
        (dict(eos_confidence="commit"), "eos_confidence"),
        (dict(merge_agreement=2), "merge_agreement=2"),
        (dict(eos_prefer_widest=True), "eos_prefer_widest=True"),
        (dict(prune_after_syncs=1), "prune_after_syncs=1"),
        (dict(block_sizes=[4, 6]), r"divide max_new_tokens \(16\).*\[6\]"),
        (dict(variant="theirs"), "variant must be"),
    ],
)
def test_unsupported_options_fail_before_any_forward(options, message):
    model = peaked("llada")
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    options = {"variant": "reference", "block_sizes": [4, 8], **options}
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[5, 6, 7]]), generation_config=BlockBatchConfig(max_new_tokens=16, **options))
    assert not calls


def test_a_shifted_model_is_refused_before_any_forward():
    """The authors' Dream decoder is another algorithm (docs/reference_variant.md): the LLaDA one
    with our shift would be neither theirs nor ours."""
    model = peaked("dream")
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    cfg = BlockBatchConfig(max_new_tokens=16, block_sizes=[4, 8], variant="reference")
    with pytest.raises(ValueError, match="Dream"):
        model.generate(torch.tensor([[5, 6, 7]]), generation_config=cfg)
    assert not calls


def _state(decoded: list[int], G: int = 8):
    """One request, one branch per entry of ``decoded`` (block 4), each with that many tokens."""
    from hf_blockbatch.generation.state import DecodeState

    mask = 99
    state = DecodeState.start(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long), [4] * len(decoded), G, mask,
                              map_k=1, features=frozenset({"count_offset", "moves"}))  # fmt: skip
    for row, n in enumerate(decoded):
        state.canvas[row, 2 : 2 + n] = 7
        state.committed[row] = n
    state.advance()
    return state


def test_eos_ties_go_to_the_lowest_branch_not_the_most_decoded():
    """(g) Equal EOS probabilities: ours prefers the most decoded branch, the authors' the lowest."""
    from hf_blockbatch.generation.stop import pick_winners

    state = _state([4, 4, 8])
    state.eos_hit[:] = True
    state.eos_prob[:] = 0.5
    finished = torch.tensor([True])
    assert pick_winners(state, finished, True, ties="decoded")[0].tolist() == [2]
    assert pick_winners(state, finished, True, ties="branch")[0].tolist() == [0]


@pytest.mark.parametrize("copy_map", [True, False])
def test_a_reference_sync_copies_the_canvas_only_and_counts_rule_commits(copy_map):
    """(c, d) The lag is in rule commits (merged tokens excluded); a synced row keeps its own map
    unless ``copy_map``, and takes its leader's count."""
    from hf_blockbatch.generation.policies.sync import counts, sync_to_leader

    state = _state([8, 1, 6])
    state.committed[2] = 2  # four of its six tokens were merged: 8 - 2 > 3 but 6 is within 8 - 3
    state.prob_p[0], state.prob_p[1], state.prob_p[2] = 0.9, 0.2, 0.3
    synced = sync_to_leader(state, None, 3, count="rule", copied=("canvas", "prob_p") if copy_map else ("canvas",))
    assert synced.tolist() == [False, True, True]
    assert counts(state, "rule").tolist() == [8, 8, 8]
    assert torch.equal(state.canvas[1], state.canvas[0]) and torch.equal(state.canvas[2], state.canvas[0])
    want = [0.9, 0.9, 0.9] if copy_map else [0.9, 0.2, 0.3]
    assert state.prob_p[:, 0, 0].tolist() == pytest.approx(want)
    assert sync_to_leader(_state([8, 1, 6]), None, 3).tolist() == [False, True, False]  # ours: decoded tokens
