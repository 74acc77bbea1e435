"""Lookahead branches (``FastDLLMConfig(lookahead=K)``, ``policies/lookahead.py``).

A draft row holds a guess of the request's next canvas and is queried in the same forward as the
request's own row; an exact guess is adopted and saves a forward. Checked here, on both embedded
checkpoints and on random peaked models: the tokens are those of Fast-dLLM without drafts, and every
adoption saves exactly one forward (NFE + adopted = NFE without drafts); drafts do happen and do get
adopted; a padded batch decodes each prompt as alone (tokens, NFE, query tokens, adoptions); the
answer is always the main row's; the trace records each adoption; clear errors for settings under
which a draft cannot be exact; the option saves and loads.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from _generation_helpers import eos_model, homogeneity_p, peaked, run_padded, spy_caches
from conftest import MASK_ID

import hf_blockbatch as hb
from hf_blockbatch.generation import forward
from hf_blockbatch.generation.policies.lookahead import DRAFT_SHAPES
from hf_blockbatch.generation.trace import CommitEvent, SyncEvent
from hf_blockbatch.tasks import get_suite


def _run(s, sparse: bool = False, radius: int = 0) -> SimpleNamespace:
    """The parts of an engine run that ``Lookahead.draft`` reads: the state, no cache, the forwards'
    column offsets (built once per run) and the plan's window queries (for a query budget)."""
    return SimpleNamespace(state=s, cache=None, fwd=SimpleNamespace(offsets=torch.arange(s.length + 1)),
                           plan=SimpleNamespace(sparse_queries=sparse, requery_radius=radius))  # fmt: skip


@pytest.fixture(scope="module", params=["tiny-llada", "tiny-dream"])
def trained(request):
    model, tok = hb.load_model(request.param, device="cpu")
    tok.padding_side = "left"
    return model, tok


def _batch(tok, suite: str, n: int):
    s = get_suite(suite)
    texts = [s.prompt(item, tok) for item in s.items("train", limit=n)]
    return tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)


def _decode(model, enc, **options):
    cfg = hb.FastDLLMConfig(max_new_tokens=64, **options)
    return model.generate(**enc, generation_config=cfg, return_dict_in_generate=True)


def _adopted(out) -> torch.Tensor:
    return torch.tensor([st["lookahead_adopted"] for st in out.stats])


@pytest.mark.parametrize("options", [
    {"block_length": 32, "early_stop": True},
    {"block_length": 64, "early_stop": True},
    {"block_length": 32, "early_stop": False, "factor": 1.0},
    {"block_length": 32, "early_stop": True, "rule": "localleap"},
    {"block_length": 64, "early_stop": True, "rule": "entropy", "entropy_bound": 0.3},
    {"block_length": 64, "early_stop": False, "skip_completed_block_step": True, "threshold": 0.7},
    {"block_length": 64, "early_stop": True, "window_queries": "sparse", "requery_radius": 6},
    {"block_length": 32, "early_stop": False, "window_queries": "sparse", "requery_radius": 0},
], ids=["b32-es", "b64-es", "factor", "localleap", "entropy", "skip-t0.7", "sparse-r6", "sparse-r0"])  # fmt: skip
@pytest.mark.parametrize("drafts", [1, 3])
def test_lookahead_decodes_fast_dllms_tokens_in_fewer_forwards(trained, options, drafts):
    """The same tokens as Fast-dLLM without drafts; each adopted draft is one forward less, exactly;
    on eight arithmetic prompts some drafts are adopted; the drafts' windows are query tokens."""
    model, tok = trained
    enc = _batch(tok, "arith", 8)
    base = _decode(model, enc, **options)
    out = _decode(model, enc, lookahead=drafts, **options)
    assert torch.equal(out.sequences, base.sequences)
    adopted = _adopted(out)
    assert torch.equal(out.nfe + adopted, base.nfe)
    assert int(adopted.sum()) > 0
    qt, base_qt = (torch.tensor([st["query_tokens"] for st in o.stats]) for o in (out, base))
    assert bool((qt >= base_qt).all()) and int(qt.sum()) > int(base_qt.sum())
    assert all(st["winner_branch"] == 0 and len(st["branches"]) == 1 + drafts for st in out.stats)
    # draft rows are reported as drafts, not as pruned branches
    assert all(st["pruned"] == 0 and [b["draft"] for b in st["branches"]] == [False] + [True] * drafts for st in out.stats)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("queries", [{}, {"window_queries": "sparse", "requery_radius": 2}], ids=["dense", "sparse"])
def test_lookahead_is_exact_on_random_models(family, queries):
    """A random peaked model (confidences spread over (0, 1)): still Fast-dLLM's tokens, NFE + adopted
    = its NFE, for every number of drafts (with sparse queries: sparse Fast-dLLM's, chains of drafts
    three deep included)."""
    model = peaked(family)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    base = run_padded(model, prompts, hb.FastDLLMConfig(max_new_tokens=24, block_length=8, threshold=0.6, **queries))
    for drafts in range(1, len(DRAFT_SHAPES) + 1):
        cfg = hb.FastDLLMConfig(max_new_tokens=24, block_length=8, threshold=0.6, lookahead=drafts, **queries)
        out = run_padded(model, prompts, cfg)
        assert torch.equal(out.sequences, base.sequences), drafts
        assert torch.equal(out.nfe + _adopted(out), base.nfe), drafts


@pytest.mark.parametrize("queries", [{}, {"window_queries": "sparse", "requery_radius": 6},
                                     {"window_queries": "sparse", "requery_radius": 6, "lookahead_accept": "contained"}],
                         ids=["dense", "sparse", "sparse-contained"])  # fmt: skip
def test_lookahead_padded_batch_equals_alone(trained, queries):
    """Drafts, adoptions and their query tokens are per request: each prompt decodes inside a
    left-padded batch exactly as alone (contained acceptance included)."""
    model, tok = trained
    s = get_suite("lists")
    prompts = [tok(s.prompt(item, tok), add_special_tokens=False).input_ids for item in s.items("train", limit=4)]
    cfg = hb.FastDLLMConfig(max_new_tokens=64, block_length=32, early_stop=True, lookahead=3, **queries)
    batch = run_padded(model, prompts, cfg)
    width = batch.sequences.shape[1] - 64
    for i, p in enumerate(prompts):
        alone = run_padded(model, [p], cfg)
        assert torch.equal(batch.sequences[i, width:], alone.sequences[0, len(p) :])
        assert int(batch.nfe[i]) == int(alone.nfe[0])
        for key in ("query_tokens", "lookahead_adopted"):
            assert batch.stats[i][key] == alone.stats[0][key], key


def test_lookahead_trace_records_each_adoption(trained):
    """An adoption is a sync of the main row (branch 0) to the draft it took: the trace shows one per
    adoption, a chain's in turn (a chain was one sync to its last draft, hiding the forwards its earlier
    adoptions saved), each saving one forward; the tokens it gained follow as an "adopt" commit, so the
    main row's commits alone replay its answer."""
    model, tok = trained
    enc = _batch(tok, "arith", 4)
    out = _decode(model, enc, block_length=32, early_stop=True, lookahead=3, output_trace=True)
    end = hb.end_token_ids(tok, model.config)
    for i, st in enumerate(out.stats):
        syncs = [ev for ev in st["trace"] if isinstance(ev, SyncEvent)]
        assert all(ev.branch == 0 and 1 <= ev.leader <= 3 for ev in syncs)
        assert len(syncs) == st["lookahead_adopted"]
        # each adoption's tokens are an "adopt" commit of the main row, right after its sync; replaying
        # the main row's commits alone rebuilds its answer
        adopts = [ev for ev in st["trace"] if isinstance(ev, CommitEvent) and ev.phase == "adopt"]
        assert [ev.step for ev in adopts] == [ev.step for ev in syncs] and all(ev.branch == 0 for ev in adopts)
        assert all(ev.committed for ev in adopts)
        canvas = {}
        for ev in st["trace"]:
            if isinstance(ev, CommitEvent) and ev.branch == 0:
                assert not canvas.keys() & set(ev.committed)  # a position is committed once
                canvas.update(zip(ev.committed, ev.tokens))
        row = out.sequences[i, enc.input_ids.shape[1] :].tolist()
        assert all(row[p] == t for p, t in canvas.items())
        answer = next((p for p, t in enumerate(row) if t in end), len(row))
        assert set(range(answer + 1 if answer < len(row) else answer)) <= canvas.keys()
    assert any(st["lookahead_adopted"] for st in out.stats)
    steps = [ev.step for st in out.stats for ev in st["trace"] if isinstance(ev, SyncEvent)]
    assert len(steps) > len(set(steps)), "no chain: these items adopted in every step at most once"


@pytest.mark.parametrize("options,message", [
    ({"cache": "prefix"}, "cache='dual'"),
    ({"remasking": "random"}, "remasking='low_confidence'"),
    ({"steps": 16, "threshold": None}, "threshold, factor, LocalLeap or entropy rule"),
])  # fmt: skip
def test_lookahead_refuses_settings_where_a_draft_is_not_exact(options, message):
    with pytest.raises(ValueError, match=message) as info:
        hb.FastDLLMConfig(max_new_tokens=32, lookahead=2, **options).validate()
    assert "lookahead=0" in str(info.value) and "\n" not in str(info.value)


def test_sampled_drafts_decode_the_same_distribution():
    """Sampling (temperature 0.7): a draft is adopted on the main row's sampled commit, and its own commit is drawn
    with its own noise, so the decoded sequences (and the forwards without drafts, NFE + adopted) follow the
    distribution of the decoder without drafts, though not its samples. 2,000 draws of one prompt on a peaked model,
    8 new tokens: the outcomes of both decoders pass a chi-square test of one distribution, while the same test
    tells temperature 0.7 from 0.8 apart (its power, checked each run). Every row keeps the prompt and ends with no
    mask; contained acceptance (not the same law) adopts as often."""
    model = peaked("llada")
    ids = torch.tensor([[5, 6, 7]] * 2000)

    def draws(seed: int, temperature: float = 0.7, rows: int = 2000, **drafts) -> tuple[Counter, float]:
        cfg = hb.FastDLLMConfig(max_new_tokens=8, block_length=8, threshold=0.9, temperature=temperature,
                                window_queries="sparse", **drafts)  # fmt: skip
        out = model.generate(ids[:rows], generation_config=cfg, return_dict_in_generate=True,
                             generator=torch.Generator().manual_seed(seed))  # fmt: skip
        adopted = torch.tensor([st.get("lookahead_adopted", 0) for st in out.stats])
        assert bool((out.sequences[:, :3] == ids[:rows]).all()) and not bool((out.sequences == MASK_ID).any())
        keys = Counter(map(tuple, torch.cat([out.sequences[:, 3:], (out.nfe + adopted)[:, None]], 1).tolist()))
        return keys, float(adopted.float().mean())

    plain, _ = draws(1)
    drafted, adopted = draws(2, lookahead=3)
    _, adopted_ct = draws(3, rows=400, lookahead=3, lookahead_accept="contained")  # the invariants, not the same law
    assert adopted > 1.0 and adopted_ct > 1.0  # about 2.6 of the 8 steps a row
    # on this machine: 0.93, and 4e-8 for 0.8 against 0.7 (adopting a draft whose canvas differs from the main
    # row's at one position gives 4e-188)
    assert homogeneity_p(plain, drafted) > 1e-3
    assert homogeneity_p(plain, draws(4, temperature=0.8)[0]) < 1e-5


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_sampled_drafts_keep_the_decoding_invariants(family):
    """Random sampled settings (temperature 0.5 or 1, every rule a draft accepts, dense or sparse, exact or contained,
    a gate, a budget, early stop or not) on a model whose EOS is often confident: the prompt untouched, no mask before
    the first EOS (none at all without early stop), NFE = 1 + block steps + refreshes, each main-row position committed
    once and the output made of those commits. Drafts are adopted."""
    assert _check_sampled_invariants(eos_model(family), seed=5) > 0


def _check_sampled_invariants(model, seed: int, settings: int = 12) -> int:
    """``settings`` random sampled settings drawn from ``seed`` (see the test above); returns the drafts adopted."""
    import random

    from _generation_helpers import EOS_ID

    rng, spare, adopted = random.Random(seed), random.Random(seed + 2), 0
    for _ in range(settings):
        options = dict(max_new_tokens=rng.choice([5, 13, 24]), block_length=rng.choice([3, 4, 8, 16]),
                       threshold=rng.choice([0.3, 0.6, 0.9]), early_stop=rng.random() < 0.5,
                       temperature=rng.choice([0.5, 1.0]), lookahead=rng.randint(1, len(DRAFT_SHAPES)),
                       lookahead_max_masks=rng.choice([None, 2, 8]), output_trace=True,
                       lookahead_accept=rng.choice(["exact", "contained"]))  # fmt: skip
        if rng.random() < 0.5:
            options.update(window_queries="sparse", requery_radius=rng.choice([0, 3, 6]))
        rule = rng.choice(["threshold", "factor", "localleap", "entropy"])
        if rule == "factor":
            options.update(threshold=None, factor=rng.choice([0.5, 1.0, 2.0]))
        elif rule == "localleap":
            options.update(rule="localleap", relaxed_threshold=0.8 * options["threshold"])
        elif rule == "entropy":
            options.update(rule="entropy", entropy_bound=rng.choice([0.0, 0.3, 1.0]))
        elif rng.random() < 0.5:
            options.update(many_masks_threshold=rng.choice([0.2, 0.5, 0.8]), many_masks=rng.choice([None, 0, 2, 5]))
        if rng.random() < 0.5:
            options["lookahead_query_budget"] = rng.choice([1.0, 2.5])
        if rng.random() < 0.5:  # keyed noise
            options["seed"] = rng.randrange(2**40)
        if options["lookahead"] >= 3 and spare.random() < 0.5:  # runner-up drafts in spare rows (their own draws)
            options["lookahead_runner_up"] = True
        prompts = [[rng.randrange(3, 90) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(1, 3))]
        torch.manual_seed(rng.randrange(1000))
        out = run_padded(model, prompts, hb.FastDLLMConfig(**options))
        G, width = options["max_new_tokens"], out.sequences.shape[1] - options["max_new_tokens"]
        for i, p in enumerate(prompts):
            seq, st = out.sequences[i].tolist(), out.stats[i]
            assert seq[width - len(p) : width] == p, (seed, options)
            gen = seq[width:]
            first = gen.index(EOS_ID) if EOS_ID in gen else G
            assert MASK_ID not in gen[:first] and (options["early_stop"] or MASK_ID not in gen), (seed, options)
            assert st["nfe"] == int(out.nfe[i]) == 1 + st["nfe_block"] + st["nfe_refresh"], (seed, options)
        _main_row_replay(out, width, [EOS_ID])
        adopted += int(_adopted(out).sum())
    return adopted


@pytest.mark.parametrize("value", [-1, len(DRAFT_SHAPES) + 1, True, "2", 1.5])
def test_lookahead_count_errors(value):
    with pytest.raises(ValueError, match="lookahead must be an integer from 0 to"):
        hb.FastDLLMConfig(max_new_tokens=32, lookahead=value).validate()


def test_lookahead_config_saves_and_loads(tmp_path):
    cfg = hb.FastDLLMConfig(max_new_tokens=64, block_length=64, early_stop=True, lookahead=3)
    cfg.save_pretrained(tmp_path)
    loaded = hb.FastDLLMConfig.from_pretrained(tmp_path)
    assert loaded.lookahead == 3 and loaded.block_length == 64
    loaded.validate()
    assert hb.FastDLLMConfig().lookahead == 0


def test_drafts_commit_the_ranked_masks_and_park_when_too_few_remain():
    """Draft j holds the main row's canvas plus ranks DRAFT_SHAPES[j] of its open window masks (by
    the probability map, with its top-1 tokens); a draft that would fill the window or needs more
    masks than remain is parked and mirrors its main row."""
    from hf_blockbatch.generation.policies.lookahead import Lookahead
    from hf_blockbatch.generation.state import DecodeState

    mask = 9
    ids = torch.tensor([[1, 2], [3, 4]])
    s = DecodeState.start(ids, torch.ones_like(ids), [4] * 4, 8, mask, map_k=1, features=frozenset(Lookahead().needs))
    s.prob_p[:, :, 0] = torch.tensor([0.2, 0.9, 0.5, 0.7, 0.1, 0.1, 0.1, 0.1]).repeat(8, 1)
    s.prob_ids[:, :, 0] = torch.arange(20, 28).repeat(8, 1)
    s.canvas[4:8, 2:6] = torch.tensor([5, 5, mask, 5])  # request 1: one open mask in its window
    changed = Lookahead(3).draft(_run(s))
    gen = s.canvas[:, 2:6]
    # request 0, ranks by confidence: position 1 (0.9), 3 (0.7), 2 (0.5), 0 (0.2)
    assert gen[1].tolist() == [mask, 21, mask, mask]  # (0,)
    assert gen[2].tolist() == [mask, mask, mask, 23]  # (1,)
    assert gen[3].tolist() == [mask, 21, mask, 23]  # (0, 1)
    assert s.pruned[:4].tolist() == [False, False, False, False] and s.done[:4].tolist() == [False] * 4
    # request 1: a single open mask: every draft would fill the window, so all are parked
    assert s.pruned[5:8].all() and s.done[5:8].all()
    assert torch.equal(s.canvas[5:8], s.canvas[4:5].expand(3, -1))
    assert torch.equal(s.drafted[1:4], s.canvas[1:4]) and changed


def test_parking_reaches_every_draft_row_after_finished_requests_leave():
    """Parking fills the state's draft-row mask (``draft_row``): it must still name the draft rows, and only them,
    once finished requests' rows are dropped (``DecodeState.select``), so that a step parks its own drafts."""
    from hf_blockbatch.generation.policies.lookahead import Lookahead, _park
    from hf_blockbatch.generation.state import DecodeState

    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    s = DecodeState.start(ids, torch.ones_like(ids), [4] * 3, 8, 9, map_k=1, features=frozenset(Lookahead().needs))
    s.select(torch.tensor([3, 4, 5, 6, 7, 8]))  # request 0 finished: requests 1 and 2 are left
    s.pruned.zero_()
    s.done.zero_()
    _park(s)
    assert s.pruned.tolist() == s.done.tolist() == [False, True, True] * 2


@pytest.mark.parametrize("suite,options,gate", [
    # lookahead_max_masks: drafts only while the window has at most m masks left
    ("arith", {"block_length": 64, "early_stop": True, "lookahead": 2}, {"lookahead_max_masks": 4}),
    # lookahead_query_budget: drafts only while the request's step fits b windows of query tokens
    ("lists", {"block_length": 32, "early_stop": True, "window_queries": "sparse", "requery_radius": 6, "lookahead": 3},
     {"lookahead_query_budget": 1.5}),
], ids=["max_masks", "query_budget"])  # fmt: skip
def test_a_draft_gate_is_still_exact_and_cheaper(trained, suite, options, gate):
    """A gate on drafts only parks them, so with exact acceptance the tokens are still (sparse)
    Fast-dLLM's with NFE + adopted = its NFE; it feeds fewer positions than drafting at every step, and
    still adopts drafts."""
    model, tok = trained
    enc = _batch(tok, suite, 8)
    base = _decode(model, enc, **{**options, "lookahead": 0})
    every = _decode(model, enc, **options)
    gated = _decode(model, enc, **options, **gate)
    assert torch.equal(gated.sequences, base.sequences)
    assert torch.equal(gated.nfe + _adopted(gated), base.nfe) and int(_adopted(gated).sum()) > 0
    qt = {name: sum(st["query_tokens"] for st in o.stats) for name, o in (("every", every), ("gated", gated))}
    assert qt["gated"] < qt["every"]


def test_a_window_with_more_masks_than_max_masks_gets_no_draft():
    from hf_blockbatch.generation.policies.lookahead import Lookahead
    from hf_blockbatch.generation.state import DecodeState

    ids = torch.tensor([[1, 2]])
    for max_masks, parked in ((3, True), (4, False)):
        s = DecodeState.start(ids, torch.ones_like(ids), [4] * 3, 8, 9, map_k=1, features=frozenset(Lookahead().needs))
        Lookahead(2, max_masks).draft(_run(s))  # 4 masks in the first window
        assert s.pruned[1:].tolist() == [parked, parked]


@pytest.mark.parametrize("options,message", [
    ({"lookahead": 2, "lookahead_max_masks": 1}, "lookahead_max_masks must be an integer >= 2"),
    ({"lookahead": 2, "lookahead_max_masks": True}, "lookahead_max_masks must be an integer >= 2"),
    ({"lookahead": 2, "lookahead_max_masks": "8"}, "lookahead_max_masks must be an integer >= 2"),
    ({"lookahead_max_masks": 8}, "it needs lookahead >= 1"),
])  # fmt: skip
def test_lookahead_max_masks_errors(options, message):
    with pytest.raises(ValueError, match=message):
        hb.FastDLLMConfig(max_new_tokens=32, **options).validate()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_lookahead_is_exact_on_random_settings(family, monkeypatch):
    """Seeded random settings, the edges included (one-token canvases and blocks, threshold 1, blocks
    that do not divide the canvas, the gate at its smallest; the threshold or the entropy rule): Fast-dLLM's
    tokens, NFE + adopted = its NFE.
    The K/V storage starts as NaN, so a draft row reading K/V that nothing wrote fails too."""
    spy_caches(monkeypatch, fill=float("nan"))
    _check_exact_on_random_settings(peaked(family), seed=7)


def _check_exact_on_random_settings(model, seed: int, settings: int = 16) -> None:
    """``settings`` random settings drawn from ``seed`` (see the test above)."""
    import random

    rng, spare = random.Random(seed), random.Random(seed + 2)  # runner-up drafts: their own draws
    for _ in range(settings):
        options = dict(max_new_tokens=rng.choice([1, 3, 5, 13, 24]), block_length=rng.choice([1, 3, 4, 8, 16]),
                       threshold=rng.choice([0.3, 0.6, 0.9, 1.0]), early_stop=rng.random() < 0.5,
                       skip_completed_block_step=rng.random() < 0.3)  # fmt: skip
        prompts = [[rng.randrange(3, 90) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.5:  # sparse queries: exact against sparse Fast-dLLM
            options.update(window_queries="sparse", requery_radius=rng.choice([0, 1, 3, 6]))
        if rng.random() < 0.25:  # entropy-bounded commits (a rule of the row's own proposals): exact as well
            options.update(rule="entropy", entropy_bound=rng.choice([0.0, 0.3, 1.0, 5.0]))
        elif rng.random() < 0.4:  # a lower threshold while many masks are left: a row's own count, exact as well
            options.update(many_masks_threshold=rng.choice([0.2, 0.5, 0.8]), many_masks=rng.choice([None, 0, 2, 5]))
        base = run_padded(model, prompts, hb.FastDLLMConfig(**options))
        drafts, max_masks = rng.randint(1, len(DRAFT_SHAPES)), rng.choice([None, 2, 8])
        budget = rng.choice([None, None, 0.5, 1.5, 3.0])  # a query budget only gates drafts: still exact
        runner = drafts >= 3 and spare.random() < 0.5  # runner-up drafts in spare rows: drafts too, still exact
        out = run_padded(model, prompts, hb.FastDLLMConfig(**options, lookahead=drafts, lookahead_max_masks=max_masks,
                                                           lookahead_query_budget=budget, lookahead_runner_up=runner))  # fmt: skip
        assert torch.equal(out.sequences, base.sequences), (options, drafts, max_masks, budget, runner)
        assert torch.equal(out.nfe + _adopted(out), base.nfe), (options, drafts, max_masks, budget, runner)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_echoed_queries_read_as_if_cached_first(family):
    """``forward_positions(echo=...)``: a row that receives another row's fresh K/V (where it does not
    query itself) computes what it would after that row's forward had been cached, and its cache then
    holds that row's K/V there, its own elsewhere. This is how a sparse draft row sees the cache its
    main row will hold."""
    from _generation_helpers import MASK_ID

    model = peaked(family)
    L = 14
    canvas = torch.tensor([[1, 2, 3, 4, 5, 6] + [MASK_ID] * 8] * 2)
    canvas[1, 7] = 40  # row 1: one guess more
    first = torch.zeros(2, L, dtype=torch.bool)
    first[:, 8:] = True
    q0 = torch.zeros(L, dtype=torch.bool)
    q0[[2, 3, 6, 7, 9, 10, 11]] = True
    q1 = torch.zeros(L, dtype=torch.bool)
    q1[[7, 8, 10, 12, 13]] = True
    predict = torch.zeros(2, L, dtype=torch.bool)
    predict[:, 12:] = True
    start = canvas.clone()
    start[1] = canvas[0]  # both rows' K/V start as row 0's canvas
    # sequentially: row 0 writes its queries, row 1 then starts from row 0's cache
    seq = model.new_cache(2, L)
    model(start, cache=seq)
    model.forward_positions(canvas, predict[:1], q0[None], seq, rows=torch.tensor([0]))
    seq.copy_rows(torch.tensor([0]), torch.tensor([1]))
    alone = model.forward_positions(canvas, predict[1:], q1[None], seq, rows=torch.tensor([1]))
    # together, with row 0's K/V echoed into row 1
    cache = model.new_cache(2, L)
    model(start, cache=cache)
    echo = torch.where(q0 & ~q1, 0, -1).expand(2, L).clone()
    echo[0] = -1
    both = model.forward_positions(canvas, predict, torch.stack([q0, q1]), cache, echo=echo)
    n = int(predict[0].sum())
    torch.testing.assert_close(both.logits[n:], alone.logits)
    for layer, ref in zip(cache.layers, seq.layers):
        torch.testing.assert_close(layer.keys, ref.keys)
        torch.testing.assert_close(layer.values, ref.values)
    with pytest.raises(ValueError, match="echo must be a long"):
        model.forward_positions(canvas, predict, torch.stack([q0, q1]), cache, echo=echo[:, :3])


@pytest.mark.parametrize("sparse", [False, True])
def test_with_sparse_queries_a_draft_stands_only_for_its_parents_next_step(sparse):
    """Draft (0, 1) extends draft (0,). When the main row commits both ranks at once, (0, 1) holds its
    next canvas: dense steps adopt it (its window was recomputed whole), sparse steps must not (its
    K/V outside its queries are (0,)'s after this forward, not the main row's)."""
    from hf_blockbatch.generation.policies import StepContext
    from hf_blockbatch.generation.policies.lookahead import Lookahead
    from hf_blockbatch.generation.state import DecodeState

    mask = 9
    ids = torch.tensor([[1, 2]])
    features = frozenset(Lookahead().needs) | ({"kv_tokens"} if sparse else frozenset())
    s = DecodeState.start(ids, torch.ones_like(ids), [4] * 4, 8, mask, map_k=1, features=features)
    s.prob_p[:, :, 0] = torch.tensor([0.2, 0.9, 0.5, 0.7, 0.1, 0.1, 0.1, 0.1]).repeat(4, 1)
    s.prob_ids[:, :, 0] = torch.arange(20, 28).repeat(4, 1)
    Lookahead(3).draft(_run(s))
    assert s.draft_parent.tolist() == [-1, 0, 0, 1]
    s.canvas[0, 2:6] = torch.tensor([mask, 21, mask, 23])  # the main row commits ranks 0 and 1
    ctx = StepContext(s, None, SimpleNamespace(tracing=False), False, True)
    moved = Lookahead(3).apply(ctx)  # an adoption moves no window itself (the Advance policy does)
    assert moved is False and int(s.adopted[0]) == (0 if sparse else 1)


def _bench_options(name: str) -> dict:
    """A benchmark entry of ``benchmarks/beyond_paper_configs.json`` less its strategy and block."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bench = json.loads((root / "benchmarks" / "beyond_paper_configs.json").read_text())[name]
    return {k: v for k, v in bench.items() if k not in ("strategy", "block_length")}


def test_drafted_preset_is_the_benchmarked_point_and_saves_whole(tmp_path):
    """``FastDLLMConfig.drafted()`` is :data:`DRAFTED` on top of the defaults, equal to the benchmark
    entry it was measured as (``fd_es_b64_sq_r6_la3_m8_ru``, less its block: §13's point with §49's runner-up
    drafts), and saves and loads whole."""
    from hf_blockbatch.generation.configs import DRAFTED

    cfg = hb.FastDLLMConfig.drafted(max_new_tokens=64, block_length=64)
    cfg.validate()
    assert {k: getattr(cfg, k) for k in DRAFTED} == DRAFTED and cfg.block_length == 64
    assert _bench_options("fd_es_b64_sq_r6_la3_m8_ru") == {"cache": "dual", "threshold": 0.9, **DRAFTED}
    assert DRAFTED["lookahead_runner_up"] is True
    cfg.save_pretrained(tmp_path)
    loaded = hb.FastDLLMConfig.from_pretrained(tmp_path)
    loaded.validate()
    assert {k: getattr(loaded, k) for k in DRAFTED} == DRAFTED
    assert hb.FastDLLMConfig.drafted(lookahead=1).lookahead == 1  # overrides win
    for exact in (True, False):  # fewer drafts leave no row spare: the preset then drafts no runner-up
        small = hb.FastDLLMConfig.drafted(exact=exact, lookahead=2)
        small.validate()
        assert small.lookahead_runner_up is False
        with pytest.raises(ValueError, match="set lookahead >= 3"):
            hb.FastDLLMConfig.drafted(exact=exact, lookahead=2, lookahead_runner_up=True).validate()
        with pytest.raises(ValueError, match="lookahead must be an integer from 0 to"):  # the config's own message
            hb.FastDLLMConfig.drafted(exact=exact, lookahead="2").validate()


# ----------------------------------------------------------------------------- contained acceptance
def _one_request_drafted(sparse: bool = False):
    """One request, a window of four masks, three drafts written from a known probability map:
    ranks by confidence are positions 1 (token 21), 3 (23), 2 (22), 0 (20) of the window."""
    from hf_blockbatch.generation.policies.lookahead import Lookahead
    from hf_blockbatch.generation.state import DecodeState

    ids = torch.tensor([[1, 2]])
    features = frozenset(Lookahead().needs) | ({"kv_tokens"} if sparse else frozenset())
    s = DecodeState.start(ids, torch.ones_like(ids), [4] * 4, 8, 9, map_k=1, features=features)
    s.prob_p[:, :, 0] = torch.tensor([0.2, 0.9, 0.5, 0.7, 0.1, 0.1, 0.1, 0.1]).repeat(4, 1)
    s.prob_ids[:, :, 0] = torch.arange(20, 28).repeat(4, 1)
    Lookahead(3).draft(_run(s))
    return s


def _apply(s, accept: str) -> bool:
    """Whether the request adopted a draft in this step (``apply`` itself reports no moved window)."""
    from hf_blockbatch.generation.policies import StepContext
    from hf_blockbatch.generation.policies.lookahead import Lookahead

    ctx = StepContext(s, None, SimpleNamespace(tracing=False), False, True)
    before = int(s.adopted[0])
    assert Lookahead(3, accept=accept).apply(ctx) is False
    return int(s.adopted[0]) > before


@pytest.mark.parametrize("accept", ["exact", "contained"])
def test_a_contained_draft_is_adopted_with_the_main_rows_own_commit(accept):
    """The main row commits draft (0,)'s token and one more (position 0): no draft is exact. With
    ``contained``, (0,) is adopted: the main row keeps its own commit (token 30 at position 0, where the
    draft committed 31) and takes the draft's commit where it made none (position 2); a mask is left."""
    mask = 9
    s = _one_request_drafted()
    s.canvas[0, 2:6] = torch.tensor([30, 21, mask, mask])  # the main row's commit
    s.canvas[1, 2:6] = torch.tensor([31, 21, 22, mask])  # draft (0,) after its own commit
    s.canvas[2, 2:6] = torch.tensor([mask, mask, 22, 23])  # draft (1,): its rank is not committed
    adopted = _apply(s, accept)
    assert adopted == (accept == "contained")
    expected = [30, 21, 22, mask] if accept == "contained" else [30, 21, mask, mask]
    assert s.canvas[0, 2:6].tolist() == expected and int(s.adopted[0]) == int(adopted)
    assert s.pruned[1:].all()  # every draft row parked after the step


@pytest.mark.parametrize("draft_after,adopted", [
    ([30, 21, 22, 23], True),   # the merge is the draft's own result: its window (and EOS check) stand
    ([31, 21, 22, 23], False),  # the merge completes the window with a token the draft did not have
])  # fmt: skip
def test_a_contained_draft_that_would_complete_the_window_needs_the_drafts_own_canvas(draft_after, adopted):
    """A completed window ends or advances the request by the step's own completion and EOS checks, so
    a contained draft whose merge completes the window is adopted only when the merge equals what the
    draft decoded (the checks ran on that canvas)."""
    mask = 9
    s = _one_request_drafted()
    s.canvas[0, 2:6] = torch.tensor([30, 21, mask, mask])
    s.canvas[1, 2:6] = torch.tensor(draft_after)
    assert _apply(s, "contained") == adopted
    assert s.canvas[0, 2:6].tolist() == (draft_after if adopted else [30, 21, mask, mask])


def test_no_draft_is_adopted_when_the_main_rows_step_completed_its_window():
    """A main row that completed its window has no next block step for a draft to stand in for: the
    step's own completion (advance, EOS, refresh) stands, whatever the drafts hold."""
    s = _one_request_drafted()
    s.canvas[0, 2:6] = torch.tensor([30, 21, 22, 23])
    s.canvas[1, 2:6] = torch.tensor([30, 21, 22, 23])
    assert not _apply(s, "contained") and int(s.adopted[0]) == 0


def _main_row_replay(out, enc_width: int, end) -> None:
    """Each position of the main row is committed once (a committed token never changes), the
    committed tokens are the output's, and everything up to the first end token was committed."""
    for i, st in enumerate(out.stats):
        canvas = {}
        for ev in st["trace"]:
            if isinstance(ev, CommitEvent) and ev.branch == 0:
                assert not canvas.keys() & set(ev.committed)
                canvas.update(zip(ev.committed, ev.tokens))
        row = out.sequences[i, enc_width:].tolist()
        assert all(row[p] == t for p, t in canvas.items())
        answer = next((p for p, t in enumerate(row) if t in end), len(row))
        assert set(range(answer + 1 if answer < len(row) else answer)) <= canvas.keys()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_contained_acceptance_keeps_the_decoding_invariants(family, monkeypatch):
    """Seeded random settings on a random peaked model (dense and sparse steps; threshold, factor,
    LocalLeap and entropy rules): the prompt is untouched,
    no mask is left before the first EOS (none at all without early stop), NFE = 1 + block steps +
    refreshes, the main row commits each position once and the output is its commits; a padded batch
    decodes each prompt as alone; and drafts the exact rule would refuse are adopted. The K/V storage
    starts as NaN."""
    spy_caches(monkeypatch, fill=float("nan"))
    assert _check_contained_invariants(peaked(family), seed=11) > 0


def _check_contained_invariants(model, seed: int, settings: int = 16) -> int:
    """``settings`` random settings drawn from ``seed`` (see the test above); returns how many more
    drafts contained acceptance adopted than exact acceptance."""
    import random

    from _generation_helpers import EOS_ID, MASK_ID

    rng, many, spare = random.Random(seed), random.Random(seed + 1), random.Random(seed + 2)
    gained = 0
    for _ in range(settings):
        options = dict(max_new_tokens=rng.choice([5, 13, 24]), block_length=rng.choice([3, 4, 8, 16]),
                       threshold=rng.choice([0.3, 0.6, 0.9]), early_stop=rng.random() < 0.5,
                       lookahead=rng.randint(1, len(DRAFT_SHAPES)), lookahead_max_masks=rng.choice([None, 2, 8]),
                       output_trace=True)  # fmt: skip
        if rng.random() < 0.5:
            options.update(window_queries="sparse", requery_radius=rng.choice([0, 3, 6]))
        rule = rng.choice(["threshold", "threshold", "factor", "localleap", "entropy"])  # every rule a draft accepts
        if rule == "factor":
            options.update(threshold=None, factor=rng.choice([0.5, 1.0, 2.0]))
        elif rule == "localleap":
            options.update(rule="localleap", relaxed_threshold=0.8 * options["threshold"])
        elif rule == "entropy":
            options.update(rule="entropy", entropy_bound=rng.choice([0.0, 0.3, 1.0, 5.0]))
        elif many.random() < 0.5:  # a lower threshold while many masks are left (counted per row; its own draws)
            options.update(many_masks_threshold=many.choice([0.2, 0.5, 0.8]), many_masks=many.choice([None, 0, 2, 5]))
        if rng.random() < 0.5:  # a query budget per request (both rules): padded must still decode as alone
            options["lookahead_query_budget"] = rng.choice([1.0, 1.5, 2.5])
        if options["lookahead"] >= 3 and spare.random() < 0.5:  # runner-up drafts in spare rows (their own draws)
            options["lookahead_runner_up"] = True
        prompts = [[rng.randrange(3, 90) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(1, 3))]
        exact = run_padded(model, prompts, hb.FastDLLMConfig(**options))
        # with sparse steps, half of the time drafts re-query their masks' neighbours closer in (or not at all)
        contained = {"lookahead_accept": "contained"}
        if options.get("window_queries") == "sparse" and rng.random() < 0.5:
            contained["lookahead_draft_radius"] = rng.choice([0, 1, 2])
        out = run_padded(model, prompts, hb.FastDLLMConfig(**options, **contained))
        G, width = options["max_new_tokens"], out.sequences.shape[1] - options["max_new_tokens"]
        for i, p in enumerate(prompts):
            seq = out.sequences[i].tolist()
            assert seq[width - len(p) : width] == p
            gen = seq[width:]
            first = gen.index(EOS_ID) if EOS_ID in gen else G
            assert MASK_ID not in gen[:first] and (options["early_stop"] or MASK_ID not in gen)
            st = out.stats[i]
            assert st["nfe"] == int(out.nfe[i]) == 1 + st["nfe_block"] + st["nfe_refresh"]
            alone = run_padded(model, [p], hb.FastDLLMConfig(**options, **contained))
            assert alone.sequences[0, -G:].tolist() == gen and int(alone.nfe[0]) == int(out.nfe[i])
            for key in ("query_tokens", "lookahead_adopted"):
                assert alone.stats[0][key] == st[key], key
        _main_row_replay(out, width, [EOS_ID])
        gained += int(_adopted(out).sum() - _adopted(exact).sum())
    return gained


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_an_adoption_completes_a_window_only_in_a_step_that_completed_one(family, monkeypatch):
    """``Lookahead.apply`` reports no moved window and leaves advancing, stopping and refreshing to the
    ``Advance`` policy after it, which acts only when the step's ``completed`` is true. That is sound
    only if every adoption that leaves the main row's window complete comes in such a step: a draft row
    of that request completed its own window in it. Checked on every step of the contained-acceptance
    invariant settings (exact and contained, dense and sparse); such adoptions do occur."""
    from hf_blockbatch.generation.policies.lookahead import Lookahead
    from hf_blockbatch.generation.state import canvas_positions, in_window

    original, seen = Lookahead.apply, {"complete": 0}

    def window_left(s) -> torch.Tensor:  # [requests, branches]: a mask left in the row's window
        inside = in_window(canvas_positions(s.length, s.canvas.device), s.win_start, s.win_end)
        return s.per_request(((s.canvas == s.mask_id) & inside).any(-1))

    def checked(self, ctx):
        s = ctx.state
        before = s.per_request(s.adopted)[:, 0].clone()
        # a draft row that rode in this step and has no mask left in its window completed it in this step
        drafts_done = (~window_left(s)[:, 1:] & ~s.per_request(s.pruned)[:, 1:]).any(-1)
        moved = original(self, ctx)
        took = s.per_request(s.adopted)[:, 0] > before
        completes = took & ~window_left(s)[:, 0]
        if bool(completes.any()):
            seen["complete"] += 1
            assert ctx.completed and bool(drafts_done[completes].all()), "an adoption completed a window no row completed"
        assert moved is False
        return moved

    monkeypatch.setattr(Lookahead, "apply", checked)
    _check_contained_invariants(peaked(family), seed=5, settings=16)
    assert seen["complete"] > 0


def test_a_step_whose_only_completed_windows_are_drafts_moves_nothing(trained, monkeypatch):
    """``Lookahead.apply`` narrows the step's ``completed`` to the main rows: a draft row that completed its window
    and was not adopted is parked, and the next draft rewrites it, so advancing, the stop check and the refresh
    check have nothing to do. On lists prompts at batch 1 with the contained preset such steps occur; in each, no
    main row that is not done holds a complete window, and the decode is the one that runs every check (the same
    tokens and forwards) with fewer stop checks."""
    from hf_blockbatch.generation.engine import Run
    from hf_blockbatch.generation.policies.lookahead import Lookahead
    from hf_blockbatch.generation.state import canvas_positions, in_window

    model, tok = trained
    cfg = hb.FastDLLMConfig.drafted(exact=False, block_length=48, max_new_tokens=get_suite("lists").default_gen_length)
    prompts = [tok(t, add_special_tokens=False, return_tensors="pt") for t in
               [get_suite("lists").prompt(item, tok) for item in get_suite("lists").items("train", limit=6)]]  # fmt: skip
    original_apply, original_finish = Lookahead.apply, Run.finish
    seen = Counter()

    def apply(self, ctx):
        before = ctx.completed
        out = original_apply(self, ctx)
        if before and not ctx.completed:
            s = ctx.state
            inside = in_window(canvas_positions(s.length, s.canvas.device), s.win_start, s.win_end)
            held = s.per_request(((s.canvas == s.mask_id) & inside).any(-1))[:, 0]
            assert bool((held | s.per_request(s.done)[:, 0]).all()), "a main row's complete window was not reported"
            seen["narrowed"] += 1
        return out

    def finish(self):
        seen[mode] += 1
        return original_finish(self)

    monkeypatch.setattr(Lookahead, "apply", apply)
    monkeypatch.setattr(Run, "finish", finish)
    outs = {}
    for mode in ("narrowed_run", "every_check"):
        if mode == "every_check":  # every completed step goes on to the checks, as before the narrowing
            monkeypatch.setattr(Lookahead, "_main_completed", staticmethod(lambda s: True))
        outs[mode] = [model.generate(**enc, generation_config=cfg, return_dict_in_generate=True) for enc in prompts]
    for a, b in zip(outs["narrowed_run"], outs["every_check"]):
        assert torch.equal(a.sequences, b.sequences) and torch.equal(a.nfe, b.nfe)
    assert seen["narrowed"] > 0 and seen["narrowed_run"] < seen["every_check"]


def test_contained_acceptance_saves_forwards_on_the_checkpoints(trained):
    """On eight arithmetic prompts with the drafted preset, contained acceptance adopts more drafts and
    needs fewer forwards than exact acceptance, and the main row's commits still replay its answer."""
    model, tok = trained
    enc = _batch(tok, "arith", 8)
    options = {**hb.generation.configs.DRAFTED, "block_length": 64, "output_trace": True}
    options.pop("lookahead_max_masks")
    exact = _decode(model, enc, **options)
    out = _decode(model, enc, **options, lookahead_accept="contained")
    assert int(out.nfe.sum()) < int(exact.nfe.sum())
    assert int(_adopted(out).sum()) > int(_adopted(exact).sum())
    _main_row_replay(out, enc.input_ids.shape[1], hb.end_token_ids(tok, model.config))


@pytest.mark.parametrize("radius", [0, 2])
def test_a_smaller_draft_radius_queries_fewer_positions_on_the_checkpoints(trained, radius):
    """``lookahead_draft_radius``: drafts re-query fewer neighbours than the main row's radius 6, so the
    same preset feeds fewer positions through the model; it still adopts drafts, and the main row's
    commits replay its answer."""
    model, tok = trained
    enc = _batch(tok, "arith", 8)
    options = {**hb.generation.configs.DRAFTED_CONTAINED, "block_length": 64, "output_trace": True}
    full = _decode(model, enc, **{**options, "lookahead_draft_radius": None})  # the re-query radius, 6
    lean = _decode(model, enc, **{**options, "lookahead_draft_radius": radius})
    qt = {name: sum(st["query_tokens"] for st in o.stats) for name, o in (("full", full), ("lean", lean))}
    assert qt["lean"] < qt["full"] and int(_adopted(lean).sum()) > 0
    _main_row_replay(lean, enc.input_ids.shape[1], hb.end_token_ids(tok, model.config))


def test_a_sampled_decode_drafts_at_the_main_radius(trained):
    """When sampling, ``lookahead_draft_radius`` does not apply (RESULTS §40: a forced commit sampled from a draft
    with staler neighbours spliced forms): the sampled preset at radius 2 decodes the samples, forwards and query
    tokens it decodes at the main radius, while greedy it queries fewer positions (the test above)."""
    model, tok = trained
    enc = _batch(tok, "code", 8)
    options = {**hb.generation.configs.DRAFTED_CONTAINED, "block_length": 64, "temperature": 0.5, "seed": 3}
    lean = _decode(model, enc, **options)
    full = _decode(model, enc, **{**options, "lookahead_draft_radius": None})
    assert torch.equal(lean.sequences, full.sequences) and torch.equal(lean.nfe, full.nfe)
    assert [st["query_tokens"] for st in lean.stats] == [st["query_tokens"] for st in full.stats]
    assert int(_adopted(lean).sum()) > 0


@pytest.mark.parametrize("sparse,budget,parked", [
    # dense steps: every row queries its 12-wide window, so budget b admits floor(b) - 1 drafts (the
    # bound itself fits: 2.0 and 4.0 are exact)
    (False, 1.9, [True, True, True]), (False, 2.0, [False, True, True]), (False, 4.0, [False, False, False]),
    # sparse at radius 1 (drafts at 0): the main row 8 positions (masks 1, 6, 11 and their neighbours), a draft 3
    (True, 11.5 / 12, [False, True, True]), (True, 10.5 / 12, [True, True, True]),
    (True, 14.5 / 12, [False, False, True]), (True, 17.5 / 12, [False, False, False]),
])  # fmt: skip
def test_a_query_budget_admits_drafts_in_order_while_they_fit(sparse, budget, parked):
    """``lookahead_query_budget``: drafts are admitted in order while the request's estimated query
    tokens (its main row's, then each draft's, by the sparse step's rule) fit budget x window."""
    from hf_blockbatch.generation.policies.lookahead import Lookahead
    from hf_blockbatch.generation.state import DecodeState

    mask = 9
    ids = torch.tensor([[1, 2]])
    s = DecodeState.start(ids, torch.ones_like(ids), [12] * 4, 12, mask, map_k=1, features=frozenset(Lookahead().needs))
    s.prob_p[:, :, 0] = torch.linspace(0.1, 0.9, 12).repeat(4, 1)
    window = torch.full((12,), 5)
    window[[1, 6, 11]] = mask
    s.canvas[0, 2:] = window
    Lookahead(3, draft_radius=0 if sparse else None, query_budget=budget).draft(_run(s, sparse, radius=1))
    assert s.pruned[1:].tolist() == parked


@pytest.mark.parametrize("value", [0, -1.0, True, "2", float("nan"), float("inf")])
def test_lookahead_query_budget_errors(value):
    with pytest.raises(ValueError, match="lookahead_query_budget must be a positive number"):
        hb.FastDLLMConfig(max_new_tokens=32, lookahead=2, lookahead_query_budget=value).validate()
    with pytest.raises(ValueError, match="it needs lookahead >= 1"):
        hb.FastDLLMConfig(max_new_tokens=32, lookahead_query_budget=2.0).validate()


# ----------------------------------------------------------------------------- runner-up drafts
def _two_masks_left(runner_up: bool = True, known: bool = True, budget: float | None = None):
    """One request, a window of four positions with masks at 1 and 3 left (map: tokens 21 at 0.6 and 23 at 0.5), their
    runner-ups 31 at 0.3 and 33 at 0.4 (or none known); three drafts: ``(0, 1)`` needs three masks, so its row is spare."""
    from hf_blockbatch.generation.policies.lookahead import Lookahead
    from hf_blockbatch.generation.state import DecodeState

    mask, la = 9, Lookahead(3, runner_up=runner_up, query_budget=budget)
    ids = torch.tensor([[1, 2]])
    s = DecodeState.start(ids, torch.ones_like(ids), [4] * 4, 8, mask, map_k=1, features=frozenset(la.needs))
    s.canvas[:, 2:6] = torch.tensor([5, mask, 6, mask])
    s.prob_p[:, :4, 0], s.prob_ids[:, :4, 0] = torch.tensor([0.0, 0.6, 0.0, 0.5]), torch.tensor([0, 21, 0, 23])
    if runner_up and known:
        s.runner_p[:, :4], s.runner_ids[:, :4] = torch.tensor([0.0, 0.3, 0.0, 0.4]), torch.tensor([-1, 31, -1, 33])
    la.draft(_run(s))
    return s


def test_a_spare_draft_row_drafts_the_likeliest_runner_up_token():
    """``lookahead_runner_up``: with two masks left, drafts ``(0,)`` and ``(1,)`` hold the map's tokens at ranks 0 and 1;
    the third row, whose ``(0, 1)`` would fill the window, drafts the runner-up token at the mask where it is likeliest
    (33 at position 3: 0.4 against 0.3), as a draft of the main row's next step (parent 0). Without the option, with
    no runner-up known, or past the request's query budget, that row is parked and mirrors its main row."""
    mask = 9
    s = _two_masks_left()
    assert s.canvas[1, 2:6].tolist() == [5, 21, 6, mask] and s.canvas[2, 2:6].tolist() == [5, mask, 6, 23]
    assert s.canvas[3, 2:6].tolist() == [5, mask, 6, 33] and torch.equal(s.drafted[3], s.canvas[3])
    assert s.pruned[1:].tolist() == [False, False, False] and s.draft_parent[1:].tolist() == [0, 0, 0]
    # (a dense step queries a window per row: a budget of 3 windows admits the main row and two drafts)
    for off in (_two_masks_left(runner_up=False), _two_masks_left(known=False), _two_masks_left(budget=3.0)):
        assert off.pruned[1:].tolist() == [False, False, True] and torch.equal(off.canvas[3], off.canvas[0])
        assert off.draft_parent[3] == 1  # (0, 1) extends (0,)


def test_a_runner_up_is_the_second_most_probable_token_and_noted_only_where_a_row_is_spare():
    """``sampling.runner_up`` is the second entry of a top-2 over the proposals' probabilities (suppressed ids out of the
    softmax, the mask id out after it); ``note_runner_ups`` computes it at the masks of windows left with 2 to ``most`` masks after the step's
    commits (here row 0: 3 masks, one committed), and forgets the step's rows' older ones elsewhere (row 1: 3 left)."""
    from hf_blockbatch.generation.commit import Proposal, note_runner_ups
    from hf_blockbatch.generation.forward import Span
    from hf_blockbatch.generation.policies.lookahead import Lookahead
    from hf_blockbatch.generation.sampling import runner_up
    from hf_blockbatch.generation.state import DecodeState

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 12, generator=g) * 3
    p, ids = runner_up(logits, logits.argmax(-1), torch.tensor([4]), 2)
    # suppressed ids leave the softmax; the mask id is taken out after it (every other id keeps its probability)
    ref = logits.index_fill(-1, torch.tensor([4]), float("-inf")).softmax(-1).index_fill(-1, torch.tensor([2]), 0.0)
    top = ref.topk(3, dim=-1)
    best_kept = top.indices[:, 0] == logits.argmax(-1)  # the argmax may be a suppressed id: then the top-1 is 2nd best
    assert torch.equal(ids[best_kept], top.indices[best_kept, 1])
    assert torch.allclose(p[best_kept], top.values[best_kept, 1])

    mask = 9
    ids2 = torch.tensor([[1, 2], [1, 2]])
    s = DecodeState.start(ids2, torch.ones_like(ids2), [4], 4, mask, map_k=1,
                          features=frozenset(Lookahead(3, runner_up=True).needs))  # fmt: skip
    s.canvas[0, 2:6] = torch.tensor([mask, 5, mask, mask])  # 3 masks; position 0 is committed in the step
    s.runner_ids[1] = 7  # an older runner-up of row 1: forgotten
    positions = torch.arange(2, 6).repeat(2, 1)
    masked = s.canvas[:, 2:6] == mask
    span = Span(torch.arange(2), positions, None, None, s.canvas, s.canvas[:, 2:6].clone(), masked, masked)
    packed = torch.randn(int(masked.sum()), 12, generator=g)
    s.prob_ids[:, :, 0].masked_scatter_(masked, packed.argmax(-1))
    select = torch.zeros_like(masked)
    select[0, 0] = select[1, 1] = True
    proposal = Proposal(torch.zeros(2, 4), s.canvas[:, 2:6].clone(), None, None)
    note_runner_ups(s, span, proposal, select, select.sum(-1), packed, 2, None)
    want, want_ids = runner_up(packed[1:3], packed[1:3].argmax(-1), None, mask)  # row 0's masks at 2 and 3
    assert s.runner_ids[0].tolist() == [-1, -1, *want_ids.tolist()] and torch.allclose(s.runner_p[0, 2:], want)
    assert s.runner_ids[1].tolist() == [-1] * 4


def test_runner_up_drafts_save_forwards_and_keep_the_tokens_on_the_checkpoints(trained):
    """On code prompts (``return x + 3`` or ``return 3 + x``: a window left with two masks whose next single commit is
    often a runner-up), exact drafts with the option decode sparse Fast-dLLM's tokens, NFE + adopted = its NFE, in no
    more forwards per request than without it, and fewer over the batch."""
    model, tok = trained
    enc = _batch(tok, "code", 64)
    options = {**hb.generation.configs.DRAFTED, "max_new_tokens": 96, "block_length": 96}  # code's length, its tuned block

    def decode(**more):
        cfg = hb.FastDLLMConfig(**{**options, **more})
        return model.generate(**enc, generation_config=cfg, return_dict_in_generate=True)

    base = decode(lookahead=0, lookahead_max_masks=None, lookahead_runner_up=False)
    without, out = decode(lookahead_runner_up=False), decode(lookahead_runner_up=True)
    assert torch.equal(out.sequences, base.sequences) and torch.equal(out.nfe + _adopted(out), base.nfe)
    assert bool((out.nfe <= without.nfe).all()) and int(out.nfe.sum()) < int(without.nfe.sum())


@pytest.mark.parametrize("options,message", [
    ({"lookahead": 2, "lookahead_runner_up": True}, "set lookahead >= 3"),
    ({"lookahead_runner_up": True}, "with lookahead=0 every shape"),
    ({"lookahead": 3, "lookahead_runner_up": 1}, "lookahead_runner_up must be"),
])  # fmt: skip
def test_lookahead_runner_up_errors(options, message):
    with pytest.raises(ValueError, match=message):
        hb.FastDLLMConfig(max_new_tokens=32, **options).validate()


@pytest.mark.parametrize("options,message", [
    ({"lookahead": 2, "lookahead_accept": "loose"}, "lookahead_accept must be 'exact' or 'contained'"),
    ({"lookahead_accept": "contained"}, "it needs lookahead >= 1"),
    ({"lookahead": 2, "lookahead_draft_radius": 0, "window_queries": "sparse"}, "lookahead_accept='contained'"),
    ({"lookahead": 2, "lookahead_draft_radius": 0, "lookahead_accept": "contained"}, "window_queries='sparse'"),
    ({"lookahead": 2, "lookahead_draft_radius": -1, "lookahead_accept": "contained", "window_queries": "sparse"},
     "lookahead_draft_radius must be an integer >= 0"),
    ({"lookahead_draft_radius": 2}, "it needs lookahead >= 1"),
])  # fmt: skip
def test_lookahead_accept_errors(options, message):
    with pytest.raises(ValueError, match=message):
        hb.FastDLLMConfig(max_new_tokens=32, **options).validate()


def test_lookahead_accept_saves_and_loads(tmp_path):
    hb.FastDLLMConfig(max_new_tokens=32, lookahead=3, lookahead_accept="contained",
                      lookahead_query_budget=1.5, lookahead_runner_up=True).save_pretrained(tmp_path)  # fmt: skip
    loaded = hb.FastDLLMConfig.from_pretrained(tmp_path)
    loaded.validate()
    assert loaded.lookahead_accept == "contained" and hb.FastDLLMConfig().lookahead_accept == "exact"
    assert loaded.lookahead_query_budget == 1.5 and hb.FastDLLMConfig().lookahead_query_budget is None
    assert loaded.lookahead_runner_up is True and hb.FastDLLMConfig().lookahead_runner_up is False


def test_drafted_not_exact_is_the_benchmarked_contained_point(tmp_path):
    """``FastDLLMConfig.drafted(exact=False)`` is :data:`DRAFTED_CONTAINED`, equal to the benchmark entry
    it was chosen as (``fd_es_b64_sq_r6_la3_m16_ctr2_q2_mm85_ru``, less its block: the contained drafts of §16-17
    with §48's lower threshold above 16 masks and §49's runner-up drafts), and saves and loads whole."""
    from hf_blockbatch.generation.configs import DRAFTED_CONTAINED

    cfg = hb.FastDLLMConfig.drafted(exact=False, max_new_tokens=64, block_length=64)
    cfg.validate()
    assert {k: getattr(cfg, k) for k in DRAFTED_CONTAINED} == DRAFTED_CONTAINED
    assert DRAFTED_CONTAINED["lookahead_accept"] == "contained"
    assert _bench_options("fd_es_b64_sq_r6_la3_m16_ctr2_q2_mm85_ru") == {"cache": "dual", "threshold": 0.9,
                                                                          **DRAFTED_CONTAINED}  # fmt: skip
    assert (DRAFTED_CONTAINED["many_masks_threshold"], DRAFTED_CONTAINED["many_masks"]) == (0.85, 16)
    assert DRAFTED_CONTAINED["lookahead_runner_up"] is True
    cfg.save_pretrained(tmp_path)
    loaded = hb.FastDLLMConfig.from_pretrained(tmp_path)
    assert {k: getattr(loaded, k) for k in DRAFTED_CONTAINED} == DRAFTED_CONTAINED



@pytest.mark.parametrize("rule", [{"rule": "localleap", "relaxed_threshold": 0.8, "leap_radius": 4},
                                  {"rule": "entropy", "entropy_bound": 0.2}, {"factor": 1.0}])  # fmt: skip
def test_drafted_not_exact_with_another_rule_drops_the_threshold_it_lowers(rule):
    """``drafted(exact=False)`` with another transfer rule (the README's LocalLeap drafts, RESULTS §23) is the
    contained drafts under that rule: the many-masks threshold, which lowers the threshold rule's threshold, goes
    with it, as the runner-up drafts go with ``lookahead < 3``. It raised "many_masks_threshold ... needs threshold
    (and no rule)" since §48 put that threshold in the preset. Given explicitly, it is still refused."""
    from hf_blockbatch.generation.configs import DRAFTED_CONTAINED

    cfg = hb.FastDLLMConfig.drafted(exact=False, **rule)
    cfg.validate()
    assert (cfg.many_masks_threshold, cfg.many_masks) == (None, None)
    assert {k: getattr(cfg, k) for k in DRAFTED_CONTAINED if not k.startswith("many_masks")} == {
        k: v for k, v in DRAFTED_CONTAINED.items() if not k.startswith("many_masks")}
    with pytest.raises(ValueError, match="many_masks_threshold lowers the threshold rule's threshold"):
        hb.FastDLLMConfig.drafted(exact=False, many_masks_threshold=0.85, **rule).validate()

# ----------------------------------------------------------------------------- a longer sweep (slow)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_lookahead_invariants_sweep(family, monkeypatch):
    """The random-settings checks above on many more settings (``HB_SWEEP_SEEDS`` seeds of 16 each,
    default 24, from seed ``HB_SWEEP_SEED``, default 1000: a longer hunt can start where an earlier
    one ended; ``pytest -m slow``), on a float64 model whose K/V storage starts as NaN; and the
    sampled invariants (12 settings a seed) on the float32 EOS model, with the same NaN storage.

    Why float64: a padded batch's forward is not bit-identical to a row's forward alone (the matrix
    products block differently for another batch shape), and in float32 a near tie (~1e-7 apart) can
    then commit differently, in the decoder without drafts too: 8 of about 13,000 random settings on
    these peaked models (RESULTS §22). In float64 such ties are gone, so a failure here is the
    decoder's. The NaN storage makes a read of K/V that nothing wrote fail as well."""
    import os

    spy_caches(monkeypatch, fill=float("nan"))
    model = peaked(family).double()
    gained = 0
    first = int(os.environ.get("HB_SWEEP_SEED", "1000"))
    sampled = eos_model(family)  # no comparison with another decode here, so no near ties to fear: float32
    for seed in range(first, first + int(os.environ.get("HB_SWEEP_SEEDS", "24"))):
        _check_exact_on_random_settings(model, seed)
        gained += _check_contained_invariants(model, seed)
        _check_sampled_invariants(sampled, seed)
    assert gained > 0


def test_parked_drafts_do_not_make_every_step_look_for_finished_requests(monkeypatch):
    """A parked draft row is done (pruned-like), but it ends nothing: the stop rule's quick check leaves pruned
    rows out, so a lone request looks for finished requests (``stop.finished_requests``, a handful of
    operations) only in the step that ends it, not after every step. (That it decodes as before is the other
    tests' to say: they compare tokens and NFE with the decoder without drafts.)"""
    from hf_blockbatch.generation import stop

    model, tok = hb.load_model("tiny-llada", device="cpu")
    enc = _batch(tok, "arith", 1)
    calls = []
    real = stop.finished_requests
    monkeypatch.setattr(stop, "finished_requests", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = _decode(model, enc, **{**hb.generation.configs.DRAFTED_CONTAINED, "block_length": 32})
    assert int(out.nfe[0]) > 3 and len(calls) == 1


def test_runner_ups_are_noted_at_windows_left_with_up_to_most_masks():
    """With four drafts ``(0, 1, 2)`` needs four open masks, so its row is spare with 2 or 3 left
    (``Lookahead.spare_masks`` is 3): ``note_runner_ups`` notes the runner-ups of a window left with 2 and with 3
    masks, and none of one left with 4; at ``most`` 2, of the window left with 2 only."""
    from hf_blockbatch.generation.commit import Proposal, note_runner_ups
    from hf_blockbatch.generation.forward import Span
    from hf_blockbatch.generation.policies.lookahead import Lookahead
    from hf_blockbatch.generation.sampling import runner_up
    from hf_blockbatch.generation.state import DecodeState

    mask, la = 9, Lookahead(4, runner_up=True)
    assert la.spare_masks == 3
    prompt = torch.tensor([[1, 2]] * 3)
    for most, noted in ((3, [True, True, False]), (2, [True, False, False])):
        s = DecodeState.start(prompt, torch.ones_like(prompt), [4], 4, mask, map_k=1, features=frozenset(la.needs))
        s.canvas[0, 2:6] = torch.tensor([mask, mask, 5, 5])  # 2 masks left
        s.canvas[1, 2:6] = torch.tensor([mask, mask, mask, 5])  # 3 masks left
        masked = s.canvas[:, 2:6] == mask  # row 2: 4 masks left
        span = Span(torch.arange(3), torch.arange(2, 6).repeat(3, 1), None, None, s.canvas, s.canvas[:, 2:6].clone(),
                    masked, masked)  # fmt: skip
        packed = torch.randn(int(masked.sum()), 12, generator=torch.Generator().manual_seed(0))
        s.prob_ids[:, :, 0].masked_scatter_(masked, packed.argmax(-1))
        select = torch.zeros_like(masked)  # the step committed nothing
        proposal = Proposal(torch.zeros(3, 4), s.canvas[:, 2:6].clone(), None, None)
        note_runner_ups(s, span, proposal, select, select.sum(-1), packed, most, None)
        first = 0
        for row, (n, want) in enumerate(zip((2, 3, 4), noted)):
            _, ids = runner_up(packed[first : first + n], packed[first : first + n].argmax(-1), None, mask)
            first += n
            assert s.runner_ids[row, :n].tolist() == (ids.tolist() if want else [-1] * n), (most, row)


def test_of_several_contained_drafts_the_one_holding_most_drafted_tokens_is_adopted():
    """The main row commits ranks 0 and 1 (positions 1 and 3) and leaves two masks: drafts ``(0,)``, ``(1,)`` and
    ``(0, 1)`` are all contained. ``contained`` adopts ``(0, 1)``, which drafted most (the first of them, ``(0,)``,
    would give another canvas: its commit at position 0 instead of ``(0, 1)``'s at position 2)."""
    mask = 9
    s = _one_request_drafted()
    s.canvas[0, 2:6] = torch.tensor([mask, 21, mask, 23])  # the main row's commit
    s.canvas[1, 2:6] = torch.tensor([40, 21, mask, mask])  # draft (0,) after its own commit
    s.canvas[2, 2:6] = torch.tensor([50, mask, 52, 23])  # draft (1,): no merge with it leaves a mask
    s.canvas[3, 2:6] = torch.tensor([mask, 21, 42, 23])  # draft (0, 1)
    assert _apply(s, "contained")
    assert s.canvas[0, 2:6].tolist() == [mask, 21, 42, 23] and int(s.adopted[0]) == 1


def test_a_synced_draft_rows_kv_differ_from_its_main_rows_only_where_marked_dirty(trained, monkeypatch):
    """After every sparse step with drafts, a draft row whose K/V were copied from its main row since the main row's
    last full forward holds, at every position ``kv_dirty`` leaves clean, exactly its main row's K/V (every layer),
    parked drafts included: the step restores only the dirty positions, so an unmarked difference (a parked draft
    missing what its main row re-queried) would be read as the main row's."""
    model, tok = trained
    enc = _batch(tok, "arith", 4)
    positions = forward.Forwards.positions
    seen = Counter()

    def checked(self, state, span):
        out = positions(self, state, span)
        kv = torch.stack([t for layer in self.cache.layers for t in (layer.keys, layer.values)])
        kv = kv.view(kv.shape[0], -1, state.branches, *kv.shape[2:])  # [layers x 2, B, N, L, H, D]
        same = (kv[:, :, 1:] == kv[:, :, :1]).flatten(4).all(-1).all(0)  # [B, N - 1, L]
        synced = state.per_request(state.kv_from)[:, 1:] == state.per_request(state.refreshes)[:, :1]
        clean = synced[:, :, None] & ~state.per_request(state.kv_dirty)[:, 1:]
        assert not bool((clean & ~same).any()), (clean & ~same).nonzero()[:4].tolist()
        seen["clean"] += int(clean.sum())
        seen["parked"] += int((synced & state.per_request(state.pruned)[:, 1:]).sum())
        return out

    monkeypatch.setattr(forward.Forwards, "positions", checked)
    _decode(model, enc, block_length=32, early_stop=True, window_queries="sparse", requery_radius=6, lookahead=3)
    assert seen["clean"] > 0 and seen["parked"] > 0  # the check saw synced drafts, parked ones among them


@pytest.mark.parametrize("options", [dict(lookahead_accept="contained"), dict(lookahead_accept="contained", window_queries="sparse"),
                                     dict(lookahead_runner_up=True)])  # fmt: skip
def test_draft_rows_ride_only_plans_that_keep_no_commit_probabilities(options, monkeypatch):
    """Why ``Lookahead.apply`` neither copies nor restores ``commit_prob``: only BlockBatch plans keep it (a "commit"
    EOS rank, a merge's source confidence), and a contained merge that restored the main row's own probabilities
    there never ran. Were a Fast-dLLM plan with drafts to keep them, adoption would have to say what they are."""
    from conftest import make_tiny_llada

    from hf_blockbatch.generation.state import DecodeState

    states = []
    start = DecodeState.start.__func__
    monkeypatch.setattr(DecodeState, "start", classmethod(lambda cls, *a, **k: states.append(start(cls, *a, **k)) or states[-1]))
    cfg = hb.FastDLLMConfig(max_new_tokens=8, block_length=8, lookahead=4, early_stop=True, **options)
    out = make_tiny_llada().generate(torch.tensor([[5, 6, 7]]), generation_config=cfg, return_dict_in_generate=True)
    assert len(states) == 1 and states[0].branches == 5 and states[0].commit_prob is None
    assert out.stats[0]["lookahead_adopted"] > 0  # the drafts rode and were adopted


@pytest.mark.parametrize("exact", [True, False])
def test_a_preset_narrowed_by_generate_or_update_is_the_preset_built_so(trained, exact):
    """``generate(..., generation_config=FastDLLMConfig.drafted(), lookahead=2)`` was refused ("lookahead_runner_up
    ... set lookahead >= 3, or leave lookahead_runner_up False", a value the caller never set), as were ``factor=``
    or ``rule=`` on ``drafted(exact=False)`` (its ``many_masks_threshold``), where ``drafted(lookahead=2)`` and
    ``drafted(exact=False, factor=1.0)`` take them: keywords now narrow a config as they narrow the preset."""
    model, tok = trained
    enc = _batch(tok, "lists", 4)
    preset = hb.FastDLLMConfig.drafted(exact=exact, max_new_tokens=32, block_length=32)
    for narrowing in ({"lookahead": 2}, {"lookahead": 1}, {"factor": 1.0}, {"rule": "entropy", "entropy_bound": 0.3}):
        want = hb.FastDLLMConfig.drafted(exact=exact, max_new_tokens=32, block_length=32, **narrowing)
        updated = hb.FastDLLMConfig.drafted(exact=exact, max_new_tokens=32, block_length=32)
        updated.update(**narrowing)
        assert updated == want
        if "lookahead" in narrowing:
            got = model.generate(**enc, generation_config=preset, return_dict_in_generate=True, **narrowing)
            built = model.generate(**enc, generation_config=want, return_dict_in_generate=True)
            assert torch.equal(got.sequences, built.sequences) and torch.equal(got.nfe, built.nfe)
            assert _adopted(got).tolist() == _adopted(built).tolist()


def test_no_drafts_on_a_drafted_preset_names_every_draft_option_to_set():
    """``lookahead=0`` on ``drafted(exact=False)`` was refused one option at a time, each "(or leave it None)" of a
    value the preset had set: now one message names all four with the value each needs."""
    with pytest.raises(ValueError) as err:
        hb.FastDLLMConfig.drafted(exact=False).update(lookahead=0)
    assert str(err.value) == (
        "lookahead_max_masks, lookahead_accept, lookahead_draft_radius, lookahead_query_budget say how to draft: they "
        "need lookahead >= 1 (or set lookahead_max_masks=None, lookahead_accept='exact', lookahead_draft_radius=None, "
        "lookahead_query_budget=None)."
    )
    cfg = hb.FastDLLMConfig.drafted(exact=False)
    cfg.update(lookahead=0, lookahead_max_masks=None, lookahead_accept="exact", lookahead_draft_radius=None,
               lookahead_query_budget=None)  # fmt: skip
    assert cfg.lookahead == 0 and cfg.window_queries == "sparse"
