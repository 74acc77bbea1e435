"""Sparse window queries (``window_queries="sparse"``): a block step queries only the masks it
reads and the decoded positions whose cached K/V are stale.

Checked here: the model's ``forward_positions`` computes exactly what a window forward computes
for the same queries (every backend, both families, padded rows) and leaves every other K/V in
place; the query tokens of a decode, by hand and against a replay of the trace; padded batch ≡
alone; and clear errors. The decoding invariants with the option on are in ``test_blockbatch.py``.
"""

from __future__ import annotations

import pytest
import torch
from _generation_helpers import peaked, run_padded
from conftest import MASK_ID, load_benchmark, make_tiny_dream, make_tiny_llada
from test_models import BACKEND_CASES, BACKEND_IDS, canvas, snapshot

import hf_blockbatch as hb
from hf_blockbatch.generation.trace import CommitEvent

ATOL = 1e-5


def _model(family: str):
    return make_tiny_llada() if family == "llada" else make_tiny_dream()


@pytest.mark.parametrize("device,backend", BACKEND_CASES, ids=BACKEND_IDS)
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_positions_forward_equals_the_window_forward(family, device, backend):
    """Predicting every position of each row's window and refreshing the window's K/V is the window
    forward (for Dream, whose queries are [start - 1, end), too): the same logits, the same K/V
    written; on left-padded rows and a subset of rows."""
    model = _model(family).to(device)
    model.set_attention_backend(backend)
    L, rows = 20, torch.tensor([0, 2, 3], device=device)
    ids = canvas(4, L).to(device)
    mask = torch.ones(4, L, dtype=torch.bool, device=device)
    mask[1, :3] = mask[3, :5] = False
    starts, ends = torch.tensor([8, 12, 6], device=device), torch.tensor([12, 20, 15], device=device)
    caches = []
    for _ in range(2):
        cache = model.new_cache(4, L, mask)
        model(ids, attention_mask=mask, cache=cache)
        caches.append(cache)
    new = ids.clone()
    new[:, 6:] = MASK_ID  # the windows now hold masks their cached K/V did not see
    dense = model.forward_windows(new, starts, ends, caches[0], rows=rows)
    pos = torch.arange(L, device=device)
    predict = (pos >= starts[:, None]) & (pos < ends[:, None])
    out = model.forward_positions(new, predict, predict, caches[1], rows=rows)
    torch.testing.assert_close(out.logits, dense.logits, atol=ATOL, rtol=0)
    for (k0, v0), (k1, v1) in zip(snapshot(caches[0]), snapshot(caches[1])):
        torch.testing.assert_close(k0, k1, atol=ATOL, rtol=0)
        torch.testing.assert_close(v0, v1, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_positions_forward_writes_only_its_queries(family):
    """Queries are the positions predicting ``predict`` (p - logit_shift) and the ``refresh``
    positions; only their K/V change, and only the predicted positions' logits come back."""
    model = _model(family)
    L = 16
    ids = canvas(2, L, seed=3)
    cache = model.new_cache(2, L)
    model(ids, cache=cache)
    before = snapshot(cache)
    new = ids.clone()
    new[:, 8:] = MASK_ID
    predict = torch.zeros(2, L, dtype=torch.bool)
    predict[0, [9, 11]] = predict[1, [8, 15]] = True
    refresh = torch.zeros(2, L, dtype=torch.bool)
    refresh[0, 4] = refresh[1, 12] = True
    out = model.forward_positions(new, predict, refresh, cache)
    s = model.logit_shift
    expected = refresh.clone()
    expected[predict.nonzero(as_tuple=True)[0], predict.nonzero(as_tuple=True)[1] - s] = True
    assert torch.equal(out.query_mask, expected)
    assert out.logits.shape[0] == 4
    for (k0, v0), layer in zip(before, cache.layers):
        untouched = ~expected
        assert torch.equal(layer.keys[untouched], k0[untouched]) and torch.equal(layer.values[untouched], v0[untouched])
        assert not torch.equal(layer.keys[expected], k0[expected])


def test_positions_forward_errors():
    model = make_tiny_dream()
    cache = model.new_cache(1, 12)
    ids = canvas(1, 12)
    first = torch.zeros(1, 12, dtype=torch.bool)
    first[0, 0] = True
    with pytest.raises(ValueError, match="cannot predict position 0"):
        model.forward_positions(ids, first, None, cache)
    with pytest.raises(ValueError, match="predict must be a bool"):
        model.forward_positions(ids, first.long(), None, cache)
    with pytest.raises(ValueError, match="at least one query position"):
        model.forward_positions(ids, torch.zeros(1, 12, dtype=torch.bool), None, cache)


def test_sparse_query_tokens_counted_by_hand():
    """Dual cache, one block of 8, a quota of 2 per step. The initial forward (the whole canvas)
    commits 2, so the first block step queries 6 masks and those 2 (their K/V were computed for
    masks): 8, as dense. Then 4 masks + the 2 just committed, then 2 + 2: a 4-token prompt costs
    12 + 8 + 6 + 4 = 30 (dense: 12 + 3 × 8 = 36); a 2-token prompt beside it 10 + 18 = 28."""
    model = make_tiny_llada()
    sparse = hb.FastDLLMConfig(max_new_tokens=8, block_length=8, threshold=None, steps=4, window_queries="sparse",
                               requery_radius=0)  # fmt: skip
    dense = hb.FastDLLMConfig(max_new_tokens=8, block_length=8, threshold=None, steps=4)
    out = run_padded(model, [[5, 6, 7, 8], [9, 10]], sparse)
    assert out.nfe.tolist() == [4, 4]
    assert [st["query_tokens"] for st in out.stats] == [30, 28]
    assert [st["query_tokens"] for st in run_padded(model, [[5, 6, 7, 8], [9, 10]], dense).stats] == [36, 34]


def _replayed_queries(trace: list, prompt: int, gen: int, shift: int, radius: int) -> int:
    """Query tokens of one Fast-dLLM request, replayed from its trace with sets: a full forward
    queries the canvas and leaves every decoded position's K/V fresh; a block step queries its
    window's masks (and, shifted by ``shift``, the positions predicting them), the window's decoded
    positions that are not fresh and those within ``radius`` of a mask, and leaves the decoded ones
    it queried fresh. Commits come
    after the forward that made them."""
    length = prompt + gen
    decoded, fresh, total = set(range(prompt)), set(), 0
    for ev in trace:
        assert isinstance(ev, CommitEvent)
        if ev.phase in ("init", "refresh"):
            total += length
            fresh = set(decoded)
        else:
            window = set(range(prompt + ev.window[0], prompt + ev.window[1]))  # events: generated positions
            masks = window - decoded
            near = {q for p in masks for q in range(p - radius, p + radius + 1)}
            queried = {p - shift for p in masks} | masks | ((window & decoded) - fresh) | (window & near)
            total += len(queried)
            fresh |= queried & decoded
        decoded |= {prompt + p for p in ev.committed}
    return total


@pytest.mark.parametrize("radius", [0, 1, 3])
@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("block,temperature,remasking", [(4, 0.0, "low_confidence"), (8, 0.0, "low_confidence"),
                                                         (24, 0.0, "low_confidence"), (8, 0.8, "low_confidence"),
                                                         (24, 0.8, "low_confidence"), (8, 0.0, "random"),
                                                         (24, 0.8, "random")])  # fmt: skip
def test_sparse_query_tokens_equal_the_replayed_trace(family, block, temperature, remasking, radius):
    """Threshold 0.47 on a peaked model: steps commit a varying number of positions, anywhere in
    the window. Every block step commits (the rule always takes the best), so the trace names all.
    Sampled or randomly remasked steps too: they propose at the masks alone, as greedy ones do (one
    that read every slot of its window queried the whole window, and sparse queries saved nothing)."""
    model = peaked(family)
    cfg = hb.FastDLLMConfig(max_new_tokens=24, block_length=block, threshold=0.47, window_queries="sparse",
                            requery_radius=radius, skip_completed_block_step=True, output_trace=True,
                            temperature=temperature, remasking=remasking)  # fmt: skip
    torch.manual_seed(0)
    for prompt in ([5, 3, 8, 1, 9, 2], [7, 7, 1]):
        st = run_padded(model, [prompt], cfg).stats[0]
        assert st["query_tokens"] == _replayed_queries(st["trace"], len(prompt), 24, model.logit_shift, radius)


SPARSE_CONFIGS = [
    hb.FastDLLMConfig(max_new_tokens=16, block_length=8, threshold=0.47, window_queries="sparse", early_stop=True),
    hb.BlockBatchConfig(max_new_tokens=16, block_sizes=[2, 4, 8], threshold=0.47, sync_threshold=2,
                        refresh_interval=8, window_queries="sparse"),  # fmt: skip
    hb.BlockBatchConfig(max_new_tokens=16, block_sizes=[2, 8], threshold=0.47, sync_threshold=2, refresh="off",
                        window_queries="sparse", rule="localleap", relaxed_threshold=0.3, merge_agreement=1,
                        eos_prefer_widest=True, prune_after_syncs=1, requery_radius=0),  # fmt: skip
]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cfg", SPARSE_CONFIGS, ids=["fast_dllm", "blockbatch", "blockbatch-beyond"])
def test_sparse_padded_batch_equals_alone(family, cfg):
    model = peaked(family)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9], [7, 9, 3, 2, 3, 8, 4, 6, 2, 6]]
    batch = run_padded(model, prompts, cfg)
    for i, p in enumerate(prompts):
        alone = run_padded(model, [p], cfg)
        width = batch.sequences.shape[1] - len(p) - 16
        assert batch.sequences[i, width:].tolist() == alone.sequences[0].tolist()
        assert int(batch.nfe[i]) == int(alone.nfe[0])
        assert batch.stats[i]["query_tokens"] == alone.stats[0]["query_tokens"]


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: hb.FastDLLMConfig(window_queries="masked"), "window_queries must be 'all' or 'sparse'"),
        (lambda: hb.FastDLLMConfig(window_queries="sparse", cache="prefix"), "needs cache='dual'"),
        (lambda: hb.BlockBatchConfig(window_queries=True), "window_queries must be 'all' or 'sparse'"),
        (lambda: hb.FastDLLMConfig(window_queries="sparse", requery_radius=-1), "requery_radius must be an integer"),
        (lambda: hb.BlockBatchConfig(window_queries="sparse", requery_radius=1.5), "requery_radius must be an integer"),
        (lambda: hb.FastDLLMConfig(requery_radius=1), "it needs window_queries='sparse'"),
        (lambda: hb.BlockBatchConfig(window_queries="sparse", variant="reference", max_new_tokens=128),
         "an option beyond the paper"),
    ],
)
def test_window_queries_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make().validate()


@pytest.mark.parametrize("make", [lambda: hb.FastDLLMConfig(max_new_tokens=8, window_queries="sparse"),
                                  lambda: hb.BlockBatchConfig(max_new_tokens=8, window_queries="sparse")])
def test_sparse_queries_on_a_model_without_position_forwards_fail_before_any_forward(make):
    """A model that declares no ``forward_positions`` (``supports_position_queries = False``) is refused sparse
    queries with what to set, before its first forward."""
    model = make_tiny_llada()
    model.supports_position_queries = False
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"window_queries='sparse' needs a model with forward_positions \(LLaDA"):
        model.generate(torch.tensor([[5, 6, 7]]), generation_config=make())
    assert not calls
    assert model.generate(torch.tensor([[5, 6, 7]]), generation_config=hb.FastDLLMConfig(max_new_tokens=8)).shape == (1, 11)


def test_sparse_config_saves_and_loads(tmp_path):
    cfg = hb.BlockBatchConfig(window_queries="sparse")
    cfg.save_pretrained(tmp_path)
    assert hb.BlockBatchConfig.from_pretrained(tmp_path).window_queries == "sparse"


def test_lean_preset_is_the_benchmarked_configuration(tmp_path):
    """``BlockBatchConfig.lean()`` is the point RESULTS §11 measured: the bench's JSON entry and
    beyond_paper.py's candidate spell out the same options (so a result cannot silently belong to
    another configuration), it validates, overrides win, and it saves and loads whole."""
    import json
    from pathlib import Path

    from hf_blockbatch.generation.configs import LEAN

    root = Path(__file__).resolve().parents[1]
    bench = json.loads((root / "benchmarks" / "beyond_paper_configs.json").read_text())["bb_lean_sparse_confident_r6_p1"]
    candidate = load_benchmark("beyond_paper").CONFIGS["bb_4_16_64_a2_w_sq_c07_r6_p1"]
    for spelled in (bench, candidate):
        assert spelled["strategy"] == "blockbatch"
        assert {k: v for k, v in spelled.items() if k != "strategy"} == LEAN
    cfg = hb.BlockBatchConfig.lean(max_new_tokens=32, threshold=0.8)
    cfg.validate()
    assert (cfg.max_new_tokens, cfg.threshold, cfg.block_sizes, cfg.requery_radius) == (32, 0.8, [4, 16, 64], 6)
    cfg.block_sizes.append(128)  # the preset hands out its own list
    assert LEAN["block_sizes"] == [4, 16, 64]
    cfg = hb.BlockBatchConfig.lean(max_new_tokens=32)
    cfg.save_pretrained(tmp_path)
    loaded = hb.BlockBatchConfig.from_pretrained(tmp_path)
    assert {k: getattr(loaded, k) for k in LEAN} == LEAN


def test_kv_records_change_only_where_the_step_wrote():
    """``DecodeState.kv_written(rows, where)``: a sparse step rewrites the K/V of the positions it queried only, so only
    those records take the canvas's tokens (a mask: -1); elsewhere the records stay, and a position committed since
    its K/V were written (here a merged token ahead of the window, never queried) stays stale until a step queries
    it. Recording it as fresh left its K/V, computed over a mask, unread by every later step (fewer query tokens on
    the lean preset's code prompts)."""
    from hf_blockbatch.generation.state import DecodeState

    mask = 9
    prompt = torch.tensor([[1, 2], [3, 4]])
    s = DecodeState.start(prompt, torch.ones_like(prompt), [2], 6, mask, features=frozenset({"kv_tokens"}))
    s.kv_written(None)  # a full forward: every record is the canvas's
    assert s.kv_tokens[:, 2:].tolist() == [[-1] * 6] * 2 and s.kv_tokens[:, :2].tolist() == prompt.tolist()
    s.canvas[:, 2] = 5  # committed in the window (positions 2, 3)
    s.canvas[:, 6] = 7  # merged ahead of it
    where = torch.zeros(2, 8, dtype=torch.bool)
    where[:, 2:4] = True  # the step queried its window only
    s.kv_written(torch.tensor([1]), where[1:])
    assert s.kv_tokens[0, 2:].tolist() == [-1] * 6  # a row the step did not carry keeps its records
    assert s.kv_tokens[1, 2:].tolist() == [5, -1, -1, -1, -1, -1]
    assert s.stale_kv(torch.tensor([1]))[0].tolist() == [False] * 3 + [True] * 5
