"""Refreshes of Fast-dLLM's cache: the block-start forward, ``refresh_after_commits``, and early stop
between refreshes (``Run.settle``)."""

from __future__ import annotations

import random

import pytest
import torch
from _generation_helpers import eos_model, peaked, run_padded, spy_caches
from conftest import EOS_ID, MASK_ID
from test_blockbatch import _replay

import hf_blockbatch as hb
from hf_blockbatch.eval.runner import load_task


def _settings(rng: random.Random) -> dict:
    options = dict(max_new_tokens=rng.choice([3, 5, 13, 24]), block_length=rng.choice([1, 3, 4, 8, 16]),
                   threshold=rng.choice([0.3, 0.6, 0.9]), early_stop=rng.random() < 0.5)  # fmt: skip
    if rng.random() < 0.35:  # entropy-bounded commits: the rule whose cache loss the refresh was built for (§33)
        options.update(rule="entropy", entropy_bound=rng.choice([0.0, 0.2, 1.0, 5.0]))
    return options


def _prompts(rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, 90) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(1, 3))]


def _same(a, b) -> bool:
    return (torch.equal(a.sequences, b.sequences) and torch.equal(a.nfe, b.nfe)
            and [s["query_tokens"] for s in a.stats] == [s["query_tokens"] for s in b.stats])  # fmt: skip


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_a_refresh_after_every_commit_is_the_uncached_decoder(family, cache, monkeypatch):
    """``refresh_after_commits=1``, where a full forward that completes its block is followed by the next
    block's at once (``skip_completed_block_step``): every step is a full forward, so the decode is
    ``cache="none"``'s: tokens, forwards and query tokens, in padded batches, early stop or not. The K/V
    storage starts as NaN: nothing reads K/V no forward wrote."""
    spy_caches(monkeypatch, fill=float("nan"))
    _check_uncached(peaked(family).double(), cache, seed=3)  # float64: no near ties between two batches' roundings


def _check_uncached(model, cache: str, seed: int, settings: int = 12) -> None:
    """``settings`` random settings drawn from ``seed`` (see the test above)."""
    rng = random.Random(seed)
    for _ in range(settings):
        options, prompts = _settings(rng), _prompts(rng)
        uncached = run_padded(model, prompts, hb.FastDLLMConfig(cache="none", **options))
        out = run_padded(model, prompts, hb.FastDLLMConfig(cache=cache, refresh_after_commits=1,
                                                           skip_completed_block_step=True, **options))  # fmt: skip
        assert _same(out, uncached), (seed, options)


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_the_shipped_checkpoints_refresh_as_their_uncached_decoder(name):
    """The same on the trained checkpoints and the lists suite, whose first forward commits a whole tail of
    end tokens (RESULTS §33)."""
    model, tok = hb.load_model(name, device="cpu")
    task = load_task("lists")
    for item in task.items("train", limit=3):
        ids = tok(task.prompt(item, tok), add_special_tokens=False, return_tensors="pt").input_ids
        kw = dict(max_new_tokens=64, block_length=32, early_stop=True)
        uncached = model.generate(ids, generation_config=hb.FastDLLMConfig(cache="none", **kw), return_dict_in_generate=True)
        out = model.generate(ids, generation_config=hb.FastDLLMConfig(refresh_after_commits=1, skip_completed_block_step=True,
                                                                      **kw), return_dict_in_generate=True)  # fmt: skip
        assert _same(out, uncached)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_refresh_after_commits_keeps_the_invariants_per_request(family):
    """Random settings and budgets, dual or prefix cache (dense or sparse steps), the threshold or the entropy
    rule, with or without the completed block's step, on a model whose EOS is often confident: the prompt untouched,
    no mask before the first EOS, NFE = 1 + block steps + refreshes (from the trace), at least
    Fast-dLLM's block-start refreshes where it decodes the same tokens, more query tokens than without,
    and each request decodes in a left-padded batch exactly as alone (a refresh is per request)."""
    assert _check_invariants(eos_model(family).double(), seed=11) > 0


def _check_invariants(model, seed: int, settings: int = 12) -> int:
    """``settings`` random settings drawn from ``seed`` (see the test above); how many requests took more
    query tokens than without the option."""
    rng = random.Random(seed)
    more = 0
    for _ in range(settings):
        options, prompts = _settings(rng), _prompts(rng)
        options.update(cache=rng.choice(["dual", "prefix"]), skip_completed_block_step=rng.random() < 0.5)
        if options["cache"] == "dual" and rng.random() < 0.4:  # sparse steps (a completed window kept for the extra
            options.update(window_queries="sparse", requery_radius=rng.choice([0, 3]))  # step once failed them)
        cfg = hb.FastDLLMConfig(refresh_after_commits=rng.choice([1, 2, 4, 16]), output_trace=True, **options)
        base = run_padded(model, prompts, hb.FastDLLMConfig(output_trace=True, **options))
        batch = run_padded(model, prompts, cfg)
        width, G = max(map(len, prompts)), options["max_new_tokens"]
        for i, p in enumerate(prompts):
            alone = run_padded(model, [p], cfg)
            assert torch.equal(batch.sequences[i, width:], alone.sequences[0, len(p) :]), (seed, options)
            assert int(batch.nfe[i]) == int(alone.nfe[0]) and batch.stats[i]["query_tokens"] == alone.stats[0]["query_tokens"]
            seq, st = batch.sequences[i].tolist(), batch.stats[i]
            assert seq[width - len(p) : width] == p
            gen = seq[width:]
            first_eos = gen.index(EOS_ID) if EOS_ID in gen else G
            assert MASK_ID not in gen[:first_eos]
            block_steps, refresh_steps, _ = _replay(st["trace"], G, 1)
            assert st["nfe"] == 1 + len(block_steps) + len(refresh_steps)
            if torch.equal(batch.sequences[i], base.sequences[i]):  # the same blocks decoded: their block-start
                # refreshes, and more. (With early stop, fresher K/V can reach EOS in an earlier block, after fewer
                # block starts: seed 7025 of the slow sweep, 2 refreshes without the option and 1 with it.)
                assert st["nfe_refresh"] >= base.stats[i]["nfe_refresh"]
            more += st["query_tokens"] > base.stats[i]["query_tokens"]
    return more


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_refresh_after_commits_sweep(family, monkeypatch):
    """The two random-settings checks above on many more settings (``HB_SWEEP_SEEDS`` seeds of 12 each,
    default 24, from ``HB_SWEEP_SEED``, default 3000; ``pytest -m slow``), K/V storage starting as NaN."""
    import os

    spy_caches(monkeypatch, fill=float("nan"))
    plain, eos = peaked(family).double(), eos_model(family).double()
    first = int(os.environ.get("HB_SWEEP_SEED", "3000"))
    for seed in range(first, first + int(os.environ.get("HB_SWEEP_SEEDS", "24"))):
        _check_uncached(plain, "dual" if seed % 2 else "prefix", seed)
        _check_invariants(eos, seed)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_skipping_the_completed_block_step_stops_at_the_block_holding_eos(family):
    """``skip_completed_block_step`` with early stop: a block-start forward that completes a block holding
    EOS ends the request there. (Before, the next block's forward ran first, and the option meant to save
    a forward cost 38 % more of them on tiny-dream's code at block 16.) The same tokens as without the
    option, never more forwards, and fewer in all."""
    model, tok = hb.load_model(f"tiny-{family}", device="cpu")
    task = load_task("code")
    prompts = [tok(task.prompt(it, tok), add_special_tokens=False).input_ids for it in task.items("train", limit=12)]
    kw = dict(max_new_tokens=96, block_length=16, early_stop=True)
    official = run_padded(model, prompts, hb.FastDLLMConfig(**kw))
    skipped = run_padded(model, prompts, hb.FastDLLMConfig(skip_completed_block_step=True, **kw))
    assert torch.equal(skipped.sequences, official.sequences)
    assert bool((skipped.nfe <= official.nfe).all()) and int(skipped.nfe.sum()) < int(official.nfe.sum())


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_a_completed_window_takes_no_commit_refresh(name):
    """A window that the block-start forward completed is kept for the official extra step, which commits
    nothing; the block its row moves to next starts with a full forward. ``refresh_after_commits`` counts that
    forward's commits, but refreshes no such window: a refresh there changed no token, cost a forward and, with
    sparse queries, left the extra step with no position to query (the decode failed; code at block 16, whose
    first forward completes the first window). Every refresh's window holds a mask; sparse decodes run, and each
    request decodes in a padded batch as alone."""
    model, tok = hb.load_model(name, device="cpu")
    task = load_task("code")
    prompts = [tok(task.prompt(it, tok), add_special_tokens=False).input_ids for it in task.items("train", limit=6)]
    G = 48
    for queries in ({}, {"window_queries": "sparse", "requery_radius": 6}):
        cfg = hb.FastDLLMConfig(max_new_tokens=G, block_length=16, early_stop=True, refresh_after_commits=16,
                                output_trace=True, **queries)  # fmt: skip
        batch = run_padded(model, prompts, cfg)
        width = batch.sequences.shape[1] - G
        refreshes = 0
        for i, p in enumerate(prompts):
            decoded: set[int] = set()
            for ev in batch.stats[i]["trace"]:
                if ev.phase == "refresh":
                    lo, hi = ev.window
                    assert not set(range(lo, min(hi, G))) <= decoded, (queries, i, ev)
                    refreshes += 1
                decoded.update(ev.committed)
            alone = run_padded(model, [p], cfg)
            assert torch.equal(batch.sequences[i, width:], alone.sequences[0, len(p) :]), queries
            assert int(batch.nfe[i]) == int(alone.nfe[0])
        assert refreshes  # the block starts' own refreshes

@pytest.mark.parametrize("options,message", [
    (dict(refresh_after_commits=0), "an integer >= 1"),
    (dict(refresh_after_commits=2.5), "an integer >= 1"),
    (dict(refresh_after_commits=True), "an integer >= 1"),
    (dict(refresh_after_commits=4, cache="none"), "every step is already a full forward"),
    (dict(refresh_after_commits=4, lookahead=2), "does not combine with lookahead"),
])  # fmt: skip
def test_refresh_after_commits_refuses_what_it_cannot_do(options, message):
    with pytest.raises(ValueError, match=message):
        hb.FastDLLMConfig(max_new_tokens=32, **options).validate()
    with pytest.raises(TypeError, match="refresh_after_commits.*FastDLLMConfig"):
        hb.BlockBatchConfig(refresh_after_commits=4)


def test_refresh_after_commits_saves_and_loads(tmp_path):
    cfg = hb.FastDLLMConfig(refresh_after_commits=16, rule="entropy", entropy_bound=0.2)
    cfg.save_pretrained(tmp_path)
    assert hb.FastDLLMConfig.from_pretrained(tmp_path).refresh_after_commits == 16
    assert hb.FastDLLMConfig().refresh_after_commits is None


def test_a_row_synced_in_a_step_is_not_refreshed_in_it(monkeypatch):
    """BlockBatch: a synced row took its leader's canvas, cache row and refresh age, so it is due whenever its
    leader is; it is still left out of the refresh that follows its sync (``Periodic.due``), the sync having given it
    the leader's cache already. Here (a small interval on a checkpoint) such steps happen and no refresh carries a
    row synced in its step."""
    from hf_blockbatch.generation.engine import Run

    model, tok = hb.load_model("tiny-llada", device="cpu")
    suite = load_task("arith")
    cfg = hb.BlockBatchConfig(max_new_tokens=64, block_sizes=[2, 8], refresh_interval=16, sync_threshold=1)
    aged, carried, full_step = [], [], Run.full_step

    def spy(self, rows, phase):
        s = self.state
        if phase == "refresh" and s.synced_now is not None:
            aged.append(int((s.since_refresh >= 16)[s.synced_now].sum()))
            carried.append(int(s.synced_now[rows].sum()))
        return full_step(self, rows, phase)

    monkeypatch.setattr(Run, "full_step", spy)
    for item in suite.items("train", limit=3):
        enc = tok([suite.prompt(item, tok)], add_special_tokens=False, return_tensors="pt")
        model.generate(**enc, generation_config=cfg)
    assert sum(aged) > 0 and sum(carried) == 0


def test_the_reference_refresh_resets_the_moves_of_the_rows_it_refreshed():
    """``ReferenceRefresh``: once a row's window moves x its block size reach the interval, every active row of its
    request is refreshed in one full forward and their move counts restart at 0 (so the next refresh waits for the
    interval again); another request's rows keep their counts. Without the reset every later step was a refresh."""
    from types import SimpleNamespace

    from hf_blockbatch.generation.refresh import ReferenceRefresh
    from hf_blockbatch.generation.state import DecodeState

    prompt = torch.tensor([[1, 2]] * 2)
    s = DecodeState.start(prompt, torch.ones_like(prompt), [4, 8], 16, MASK_ID, features=frozenset({"moves"}))
    s.moves.copy_(torch.tensor([4, 1, 3, 1]))  # request 0: row 0 is due (4 x 4 >= 16); request 1: none (3 x 4, 1 x 8)
    full = []
    run = SimpleNamespace(state=s, cache=None, full_step=lambda rows, phase: full.append((rows.tolist(), phase)))
    policy = ReferenceRefresh(16)
    assert policy.refresh(run) and full == [([0, 1], "refresh")]
    assert s.moves.tolist() == [0, 0, 3, 1]
    assert not policy.refresh(run) and len(full) == 1


def test_the_divergence_refresh_is_due_where_keys_drift_past_the_threshold():
    """``Divergence``: a row is due when its last-layer keys over the generated region drift from its request's mean
    by more than ``threshold`` (relative), whatever its window's age: request 0's rows agree (no drift), request 1's
    drift by 0.5 from their mean (keys 1 and 3 against 2)."""
    from types import SimpleNamespace

    from hf_blockbatch.generation.refresh import Divergence
    from hf_blockbatch.generation.state import DecodeState

    prompt = torch.tensor([[1, 2]] * 2)
    s = DecodeState.start(prompt, torch.ones_like(prompt), [2, 4], 4, MASK_ID)  # rows 0, 1: request 0; 2, 3: request 1
    keys = torch.ones(4, 6, 2, 3)  # [R, L, heads, dim]
    keys[3, 2:] = 3.0
    keys[:, :2] = 50.0  # the prompt's keys are not compared
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=keys)])
    assert Divergence(10**6, 0.1).due(s, cache).tolist() == [False, False, True, True]
    assert Divergence(10**6, 0.6).due(s, cache).tolist() == [False] * 4


def test_the_divergence_refresh_reads_nothing_back_from_the_device_and_groups_by_request_after_retirements():
    """``Divergence`` is asked after every step: it must not read a tensor back to the host (it read
    ``int(state.request.max())``, a device sync per step on a GPU). After request 0 retired its rows, the rows left are
    requests 1 and 2's (ids not from 0): each is still compared with its own request's mean only."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_blockbatch.generation.refresh import Divergence
    from hf_blockbatch.generation.state import DecodeState

    class HostReads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.reads += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    prompt = torch.tensor([[1, 2]] * 3)
    s = DecodeState.start(prompt, torch.ones_like(prompt), [2, 4], 4, MASK_ID)
    keep = torch.tensor([2, 3, 4, 5])  # request 0 (rows 0, 1) retired
    s.request, s.since_refresh = s.request[keep], s.since_refresh[keep]
    keys = torch.ones(4, 6, 2, 3)  # rows 0, 1: request 1 (agree); rows 2, 3: request 2 (keys 1 and 3 against 2)
    keys[3, 2:] = 3.0
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=keys)])
    with HostReads() as mode:
        due = Divergence(10**6, 0.1).stale(s, cache)
    assert mode.reads == 0
    assert due.tolist() == [False, False, True, True]
