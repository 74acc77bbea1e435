"""The Gradio demo (demo/app.py): its replay logic, its input checks, the running app through
``gradio_client``, ``hf-blockbatch demo``, and one comparison in a real headless browser.

The app runs on a random tiny LLaDA with the embedded tokenizer (what the Space falls back to
when the embedded weights are absent), so these tests need no trained checkpoint. The browser
test needs Debian's ``chromium`` and Playwright; it skips, saying so, where either is missing, and
Playwright is never allowed to download a browser of its own.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import sys
from pathlib import Path

import pytest
import torch

gr = pytest.importorskip("gradio", reason="gradio is not installed (pip install -e '.[test]')")

import hf_blockbatch as hb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from demo import app  # noqa: E402

PROMPT = "Mia has 3 apples. She buys 4 more apples. How many apples does she have now?"
# max_new_tokens, fast_block, block_sizes, threshold, merge_threshold, temperature, seed, sync, refresh, chat, speed
SETTINGS = (32, "16", ["4", "8", "16", "32"], 0.9, 0.5, 0.0, 0, 8, 32, True, "instant")


# ------------------------------------------------------------------------------ replay and checks


def test_build_frames_replays_commits_merges_and_syncs() -> None:
    """A hand-written trace: frame k holds what step k changed, a sync copies the leader's set."""
    from hf_blockbatch.generation.trace import event_from_dict

    trace = [event_from_dict(e) for e in (
        {"step": 1, "phase": "init", "branch": 0, "window": [0, 4], "committed": [0], "tokens": [7]},
        {"step": 1, "phase": "init", "branch": 1, "window": [0, 8], "committed": [0, 5, 6], "tokens": [7, 8, 9]},
        {"step": 2, "phase": "block", "branch": 0, "window": [0, 4], "committed": [1], "tokens": [7]},
        {"step": 2, "phase": "block", "branch": 1, "window": [0, 8], "committed": [1, 2], "tokens": [7, 7]},
        {"step": 2, "phase": "merge", "branch": 0, "positions": [2], "tokens": [7]},
        {"step": 3, "phase": "sync", "branch": 0, "leader": 1},
        {"step": 4, "phase": "refresh", "branch": 0, "window": [4, 8], "committed": [3], "tokens": [7]},
    )]  # fmt: skip
    assert [event_from_dict(e.to_dict()) for e in trace] == trace
    frames, log = app.build_frames(trace, [4, 8], 8)
    assert [f.step for f in frames] == [0, 1, 2, 3, 4]
    assert frames[0].branches[0].decoded == frozenset() and frames[0].branches[0].window == (0, 4)
    b0 = frames[2].branches[0]
    assert b0.new == {1} and b0.merged_now == {2} and b0.decoded == {0, 1, 2} and "merge +1" in b0.badges
    synced = frames[3].branches[0]
    assert synced.decoded == {0, 1, 2, 5, 6} and synced.copied_now == {5, 6}
    assert synced.window == (0, 4)  # its own block holding its first mask (position 3)
    assert frames[4].branches[0].new == {3} and "refresh" in frames[4].branches[0].badges
    assert [line.kind for line in log] == ["init", "merge", "sync", "refresh"]


def _synced_frames() -> list:
    """A hand-written trace of 12 positions: b=4 finishes its first block, b=8 its first and one more; b=4 syncs."""
    from hf_blockbatch.generation.trace import event_from_dict

    trace = [event_from_dict(e) for e in (
        {"step": 1, "phase": "init", "branch": 0, "window": [0, 4], "committed": [0, 1, 2, 3], "tokens": [7] * 4},
        {"step": 1, "phase": "init", "branch": 1, "window": [0, 8], "committed": list(range(8)), "tokens": [7] * 8},
        {"step": 2, "phase": "block", "branch": 1, "window": [8, 12], "committed": [8], "tokens": [7]},
        {"step": 2, "phase": "sync", "branch": 0, "leader": 1},
    )]  # fmt: skip
    return app.build_frames(trace, [4, 8], 12)[0]


def test_a_synced_branch_takes_the_window_of_its_first_mask() -> None:
    """After a sync a branch re-derives its window from the copied canvas: b=4 copies b=8's nine tokens, so its
    window moves from (0, 4) to the block of its first mask (position 9), (8, 12)."""
    frames = _synced_frames()
    assert frames[1].branches[0].window == (0, 4) and frames[2].branches[0].window == (8, 12)
    assert frames[2].branches[0].copied_now == {4, 5, 6, 7, 8}


def _hand_side(frames, winner: int = 1, nfe: int = 2, seconds: float = 1.0) -> app.SideResult:
    return app.SideResult(key="blockbatch", title="BlockBatch", subtitle="", nfe=nfe, seconds=seconds, text="",
                          tokens=[(f"t{p}", "tok") for p in range(12)], answer_tokens=12, stats={}, block_sizes=[4, 8],
                          winner=winner, frames=frames, log=[])  # fmt: skip


def test_canvas_shows_the_winner_and_counters_stop_at_the_sides_own_nfe() -> None:
    """The canvas is the winning branch's (b=8 here: nine tokens after step 2, not b=4's four); a side that finished
    before the other keeps its own NFE and a full bar while the other still replays."""
    frames = _synced_frames()
    side = _hand_side(frames)
    canvas = app.render_canvas(side, frames[1], final=False)
    assert canvas.count('class="bb-chip new"') == 8  # b=8's initial eight, not b=4's four
    later = app.render_side(side, 5)  # the other side is at forward 5: this one stopped at 2
    assert '<span class="v">2</span><span class="l">NFE</span>' in later and 'style="width:100.0%"' in later


def test_banner_reports_the_saving_and_speedup_of_blockbatch_over_fast_dllm() -> None:
    frames = _synced_frames()
    fast = dataclasses.replace(_hand_side(frames), key="fast_dllm", nfe=40, seconds=2.0)
    block = _hand_side(frames, nfe=30, seconds=0.5)
    banner = app.render_banner(fast, block, None)
    assert "25.0% fewer forward passes" in banner and "<b>30</b> NFE vs Fast-dLLM <b>40</b>" in banner
    assert "wall-clock <b>4.00×</b> (0.50s vs 2.00s)" in banner
    assert "20.0% more forward passes" in app.render_banner(block, dataclasses.replace(block, nfe=36), None)


def test_frame_steps_end_on_the_last_forward() -> None:
    """A long run replays several forwards per frame, and its last frame is still the last forward (the one that
    shows the answers and the numbers)."""
    assert app._frame_steps(5) == [0, 1, 2, 3, 4, 5]
    steps = app._frame_steps(250)
    assert steps[0] == 0 and steps[-1] == 250 and len(steps) <= app.MAX_FRAMES + 2
    assert steps == sorted(set(steps))


def test_every_setting_reaches_the_config_it_names() -> None:
    """Each slider of the page reaches the decoder it is labelled for (both where it says "both")."""
    s = app.check_settings("hi", max_new_tokens=40, fast_block="8", block_sizes=["16", "4"], threshold=0.7,
                           merge_threshold=0.6, temperature=0.3, seed=7, sync_threshold=5, refresh_interval=12)  # fmt: skip
    f, b = s.fast_config(), s.blockbatch_config()
    assert (f.max_new_tokens, f.block_length, f.threshold, f.temperature, f.seed, f.cache) == (40, 8, 0.7, 0.3, 7, "dual")
    assert (b.max_new_tokens, b.block_sizes, b.threshold, b.merge_threshold, b.temperature, b.seed, b.sync_threshold,
            b.refresh_interval) == (40, [4, 16], 0.7, 0.6, 0.3, 7, 5, 12)  # fmt: skip
    assert app.check_settings("hi", block_sizes=["4", "16"], guarded=True).blockbatch_config().prune_after_syncs == 1
    with pytest.raises(app.InputError, match=f"Max new tokens must be between {app.MIN_NEW_TOKENS} and 256"):
        app.check_settings("hi", max_new_tokens=app.MIN_NEW_TOKENS - 4)


def test_a_request_that_just_fits_the_context_decodes(loaded, monkeypatch) -> None:
    """Prompt + max new tokens equal to the model's context fits; one token more is refused with the message."""
    ids = app.encode_prompt(loaded.tokenizer, "Hi")
    monkeypatch.setattr(loaded.model.config, "max_sequence_length", ids.shape[1] + 8)
    fast, block = app.compare_once(loaded, app.check_settings("Hi", max_new_tokens=8, fast_block="8", block_sizes=["8"]))
    assert len(fast.tokens) == len(block.tokens) == 8
    with pytest.raises(app.InputError, match="exceeds this model's context"):
        app.compare_once(loaded, app.check_settings("Hi", max_new_tokens=16, fast_block="8", block_sizes=["8"]))


@pytest.mark.skipif(not (Path(hb.TINY_LLADA) / "model.safetensors").exists(), reason="embedded weights absent")
def test_the_last_frame_shows_both_answers_and_the_saving() -> None:
    """The replay's last frame holds both answers and the raw numbers, whose saving is BlockBatch's over Fast-dLLM's
    (the embedded tiny-llada, where the two NFEs differ: the random model commits one token a forward on both)."""
    loaded = app.load_for_demo("tiny-llada", device="cpu", warmup=False)
    prompt = app.example_prompts()[0]
    compare = _compare_fn(app.build_demo(loaded, examples=[prompt]))
    *_, last = compare(prompt, *SETTINGS)
    stats = last[5]
    assert last[3] == stats["fast_dllm"]["text"] and last[4] == stats["blockbatch"]["text"]
    f, b = stats["fast_dllm"]["nfe"], stats["blockbatch"]["nfe"]
    assert f != b and stats["nfe_saving_percent"] == round(100.0 * (1 - b / f), 2)


def test_a_code_answer_is_judged_by_its_tests() -> None:
    from hf_blockbatch.tasks import get_suite

    item = get_suite("code").items("test", 1)[0]
    verdict = app.suite_verdict(item.question, item.target)
    assert verdict == {"suite": "code", "correct": True, "reference": "its tests", "extracted": verdict["extracted"]}


def test_eos_stop_line_explains_which_hitter_won() -> None:
    one = {"winner_block_size": 16, "branches": [{"block_size": 4, "eos_hit": False, "eos_probability": None},
                                                 {"block_size": 16, "eos_hit": True, "eos_probability": 0.93}]}  # fmt: skip
    assert app._eos_stop_line(one) == "b=16 finished a block holding EOS: the request stops, that branch wins"
    two = {**one, "branches": [*one["branches"], {"block_size": 8, "eos_hit": True, "eos_probability": 0.71}]}
    assert app._eos_stop_line(two) == (
        "2 branches finished a block holding EOS (p(EOS): b=16 0.93, b=8 0.71): the request stops, b=16 wins"
    )
    # the guards' widest-wins rule ranks by block size and reads no probability (the line raised a TypeError)
    widest = {**one, "branches": [{"block_size": 4, "eos_hit": True, "eos_probability": None},
                                  {"block_size": 16, "eos_hit": True, "eos_probability": None}]}  # fmt: skip
    assert app._eos_stop_line(widest) == (
        "2 branches finished a block holding EOS (b=4, b=16): the request stops, the widest, b=16, wins"
    )


def test_check_settings_accepts_the_defaults_and_refuses_absurd_input() -> None:
    s = app.check_settings("hi", *SETTINGS[:-1], "fast")
    assert s.block_sizes == [4, 8, 16, 32] and s.fast_block == 16 and s.max_new_tokens == 32
    bad = {
        "Type a prompt": dict(prompt="   "),
        "characters": dict(prompt="x" * 5000),
        "Max new tokens": dict(max_new_tokens=10**9),
        "whole number": dict(max_new_tokens=12.5),
        "at least one": dict(block_sizes=[]),
        "must be among": dict(block_sizes=["3"]),
        "Fast-dLLM block length": dict(fast_block="7"),
        "Confidence threshold": dict(threshold=float("nan")),
        "Temperature": dict(temperature=-1),
        "must be a number": dict(seed="abc"),
        "Replay speed": dict(speed="warp"),
    }
    for message, override in bad.items():
        kwargs = dict(prompt="hi") | override
        with pytest.raises(app.InputError, match=message):
            app.check_settings(**kwargs)


def test_no_generated_text_is_executed() -> None:
    """The Space shows model output; it must never run it (the code suite asks for functions)."""
    source = (ROOT / "demo" / "app.py").read_text(encoding="utf-8")
    for pattern in (
        r"(?<![\w.])exec\(",
        r"(?<![\w.])eval\(",
        r"\bsubprocess\b",
        r"hf_blockbatch\.tasks\.execution",  # the sandboxed executor: the demo never runs code
        r"\b(check|run)_programs?\b",
        r"os\.system",
    ):
        assert not re.search(pattern, source), pattern


def test_compare_once_samples_and_replays_every_forward(loaded) -> None:
    """Temperature > 0 (seeded Gumbel noise) runs; the replay has one frame per forward."""
    settings = app.check_settings(PROMPT, max_new_tokens=24, fast_block="8", block_sizes=["4", "8", "16"],
                                  temperature=0.7, seed=3)  # fmt: skip
    fast, block = app.compare_once(loaded, settings)
    for side in (fast, block):
        assert len(side.frames) == side.nfe + 1 and len(side.tokens) == 24
        assert side.frames[-1].branches[side.winner].decoded  # the winner decoded something
    assert fast.block_sizes == [8] and block.block_sizes == [4, 8, 16]
    again = app.compare_once(loaded, settings)
    assert again[1].text == block.text and again[1].nfe == block.nfe  # the seed makes it reproducible


def test_embedded_checkpoint_fallback_says_so() -> None:
    loaded = app.load_for_demo("tiny-llada", warmup=False)
    if (Path(hb.TINY_LLADA) / "config.json").exists():
        assert loaded.label == "tiny-llada" and not loaded.notice
    else:
        assert "no weights" in loaded.notice and loaded.label != "tiny-llada"


@pytest.mark.skipif(not (Path(hb.TINY_LLADA) / "model.safetensors").exists(), reason="embedded weights absent")
def test_examples_are_answered_right_by_both_and_marked() -> None:
    """The page's examples are suite questions the embedded tiny-llada answers right with both
    strategies at the default settings, and each answer is marked by the suite's own scorer."""
    loaded = app.load_for_demo("tiny-llada", device="cpu", warmup=False)
    for prompt in app.example_prompts():
        fast, block = app.compare_once(loaded, app.check_settings(prompt))
        assert fast.verdict["correct"] and block.verdict["correct"], (prompt, fast.text, block.text)
        assert '<span class="bb-verdict right">✓ right' in app.render_side(block, block.nfe)
        assert fast.summary()["correct"] is True
    wrong = app.suite_verdict(app.example_prompts()[0], "#### 12345")
    assert wrong["correct"] is False and wrong["suite"] == "arith"
    assert app.suite_verdict("What is 7 * 8?", "56") is None  # not a suite question: no mark


@pytest.mark.skipif(not (Path(hb.TINY_LLADA) / "model.safetensors").exists(), reason="embedded weights absent")
def test_drafts_switch_leaves_blockbatch_syncs_as_syncs() -> None:
    """With Fast-dLLM's drafts on, BlockBatch's syncs (the embedded tiny-llada syncs on the first example) are still
    logged as syncs: only the Fast-dLLM side reads a sync event as an adopted draft."""
    loaded = app.load_for_demo("tiny-llada", device="cpu", warmup=False)
    settings = app.check_settings(app.example_prompts()[0], fast_drafts=True)
    fast, block = app.compare_once(loaded, settings)
    kinds = [line.kind for line in block.log]
    assert block.stats["syncs"] > 0 and "sync" in kinds and "draft" not in kinds
    assert sum(line.kind == "draft" for line in fast.log) == fast.stats["lookahead_adopted"] > 0


def test_fast_dllm_baseline_is_chosen_by_the_visitor() -> None:
    assert app.check_settings("hi").fast_config().early_stop is False
    chosen = app.check_settings("hi", fast_block="8", fast_early_stop=True).fast_config()
    assert chosen.early_stop is True and chosen.block_length == 8


def test_sparse_queries_are_a_visitor_switch_for_both(loaded) -> None:
    """The switch reaches both configs, and the banner reports query tokens and K/V rows beside the NFE."""
    plain = app.check_settings("hi")
    assert plain.fast_config().window_queries == plain.blockbatch_config().window_queries == "all"
    sparse = app.check_settings(PROMPT, max_new_tokens=32, block_sizes=["4", "16"], sparse=True)
    assert sparse.fast_config().window_queries == sparse.blockbatch_config().window_queries == "sparse"
    fast, block = app.compare_once(loaded, sparse)
    ids = app.encode_prompt(loaded.tokenizer, PROMPT)
    out = loaded.model.generate(ids, generation_config=sparse.blockbatch_config(), return_dict_in_generate=True)
    assert block.stats["query_tokens"] == out.stats[0]["query_tokens"] and "sparse queries" in block.subtitle
    banner = app.render_banner(fast, block, None)
    assert f"query tokens <b>{block.stats['query_tokens']}</b> vs <b>{fast.stats['query_tokens']}</b>" in banner
    assert "K/V rows per request <b>2</b> vs <b>1</b>" in banner  # blocks 4 and 16: a cache row each


def test_guarded_merges_are_a_visitor_switch_for_blockbatch(loaded) -> None:
    """The switch gives BlockBatch the §11 guards (and radius 6 when sparse); Fast-dLLM is untouched,
    and the replay of a decode whose branches retire still matches generate."""
    plain = app.check_settings("hi").blockbatch_config()
    assert (plain.merge_agreement, plain.merge_source_confidence, plain.prune_after_syncs) == (0, None, None)
    guarded = app.check_settings(PROMPT, max_new_tokens=32, block_sizes=["4", "16", "64"], guarded=True, sparse=True)
    cfg = guarded.blockbatch_config()
    assert (cfg.merge_agreement, cfg.merge_source_confidence, cfg.eos_prefer_widest, cfg.prune_after_syncs,
            cfg.requery_radius) == (2, 0.7, True, 1, 6)  # fmt: skip
    assert guarded.fast_config().requery_radius == app.check_settings("hi", sparse=True).fast_config().requery_radius
    assert app.check_settings("hi", guarded=True).blockbatch_config().window_queries == "all"
    fast, block = app.compare_once(loaded, guarded)
    ids = app.encode_prompt(loaded.tokenizer, PROMPT)
    out = loaded.model.generate(ids, generation_config=cfg, return_dict_in_generate=True)
    assert block.nfe == int(out.nfe[0]) and block.stats["query_tokens"] == out.stats[0]["query_tokens"]
    assert "guarded merges" in block.subtitle and "guarded merges" not in fast.subtitle
    assert len(block.frames) == block.nfe + 1


def test_fast_dllm_drafts_are_a_visitor_switch(loaded) -> None:
    """The switch gives Fast-dLLM the drafted() lookahead rows; its greedy answer is the one without drafts, in as
    many fewer forwards as drafts it adopted (sampled with sparse queries too: the seed keys the noise), and the
    replay of its main row ends on the answer's tokens."""
    assert app.check_settings("hi").fast_config().lookahead == 0
    sampled = app.check_settings("hi", temperature=0.5, fast_drafts=True, seed=4).fast_config()
    assert (sampled.lookahead, sampled.temperature, sampled.seed) == (hb.FastDLLMConfig.drafted().lookahead, 0.5, 4)
    hot = dict(max_new_tokens=32, fast_block="16", fast_early_stop=True, sparse=True, temperature=0.5, seed=3)
    hot_plain, _ = app.compare_once(loaded, app.check_settings(PROMPT, **hot))
    hot_drafted, _ = app.compare_once(loaded, app.check_settings(PROMPT, **hot, fast_drafts=True))
    assert hot_drafted.text == hot_plain.text and hot_drafted.stats["lookahead_adopted"] > 0
    assert hot_drafted.nfe + hot_drafted.stats["lookahead_adopted"] == hot_plain.nfe
    plain = app.check_settings(PROMPT, max_new_tokens=32, fast_block="16", fast_early_stop=True)
    drafted = app.check_settings(PROMPT, max_new_tokens=32, fast_block="16", fast_early_stop=True, fast_drafts=True)
    cfg = drafted.fast_config()
    assert (cfg.lookahead, cfg.lookahead_max_masks) == (hb.FastDLLMConfig.drafted().lookahead, 8)
    fast, _ = app.compare_once(loaded, drafted)
    base, _ = app.compare_once(loaded, plain)
    adopted = fast.stats["lookahead_adopted"]
    assert adopted > 0 and fast.nfe + adopted == base.nfe and fast.text == base.text
    assert len(fast.frames) == fast.nfe + 1 and len(fast.frames[-1].branches) == 1  # the main row alone
    # one log line ("one forward saved") per adoption, a chain's in turn
    assert sum(line.kind == "draft" for line in fast.log) == adopted and "3 drafts" in fast.subtitle
    kinds = [kind for _, kind in fast.tokens]
    answer = kinds.index("eos") + 1 if "eos" in kinds else len(kinds)  # the answer and its end token
    assert set(range(answer)) <= fast.frames[-1].branches[0].decoded <= {p for p, k in enumerate(kinds) if k != "mask"}
    assert fast.summary()["drafts_adopted"] == adopted
    assert 'class="bb-log"' in app.render_side(fast, fast.nfe) and "saved" in app.render_side(fast, fast.nfe)


def test_contained_drafts_are_a_second_switch(loaded) -> None:
    """The contained switch gives Fast-dLLM ``drafted(exact=False)``'s acceptance (a clear refusal
    without the drafts switch); the run is the preset's own decode, its log says what a contained
    adoption keeps, and the replay of its main row ends on the answer's tokens."""
    with pytest.raises(app.InputError, match="tick the drafts too"):
        app.check_settings("hi", fast_contained=True)
    settings = app.check_settings(PROMPT, max_new_tokens=64, fast_block="64", fast_early_stop=True, sparse=True,
                                  fast_drafts=True, fast_contained=True)  # fmt: skip
    cfg = settings.fast_config()
    from hf_blockbatch.generation.configs import DRAFTED_CONTAINED

    drafts = {k: v for k, v in DRAFTED_CONTAINED.items() if k.startswith("lookahead")}
    assert {k: getattr(cfg, k) for k in drafts} == drafts and cfg.lookahead_accept == "contained"
    fast, _ = app.compare_once(loaded, settings)
    ids = app.encode_prompt(loaded.tokenizer, PROMPT)
    out = loaded.model.generate(ids, generation_config=cfg, return_dict_in_generate=True)
    assert fast.nfe == int(out.nfe[0]) and fast.stats["lookahead_adopted"] == out.stats[0]["lookahead_adopted"] > 0
    assert "(contained)" in fast.subtitle
    assert all("own commits kept" in line.text for line in fast.log if line.kind == "draft")
    assert sum(line.kind == "draft" for line in fast.log) == fast.stats["lookahead_adopted"]
    kinds = [kind for _, kind in fast.tokens]
    answer = kinds.index("eos") + 1 if "eos" in kinds else len(kinds)
    assert set(range(answer)) <= fast.frames[-1].branches[0].decoded <= {p for p, k in enumerate(kinds) if k != "mask"}


@pytest.mark.parametrize("sizes", [["16"], ["4", "16", "64"]], ids=["one-size", "three-sizes"])
def test_every_switch_combination_decodes(loaded, sizes) -> None:
    """Every combination of the visitor's switches gives configs that validate and decode. The guards with one
    block size keep what applies (one branch: nothing to retire); contained drafts without sparse queries keep the
    preset's drafts but not its sparse re-query radius. Both failed before, with the library's message about
    options the visitor cannot set."""
    import itertools

    for sparse, guarded, drafts, contained, early in itertools.product([False, True], repeat=5):
        if contained and not drafts:
            continue
        settings = app.check_settings(PROMPT, max_new_tokens=16, fast_block="16", block_sizes=sizes, sparse=sparse,
                                      guarded=guarded, fast_drafts=drafts, fast_contained=contained,
                                      fast_early_stop=early)  # fmt: skip
        fast, block = app.compare_once(loaded, settings)
        assert len(fast.frames) == fast.nfe + 1 and len(block.frames) == block.nfe + 1
        assert block.block_sizes == [int(b) for b in sizes]
    one_guarded = app.check_settings("hi", block_sizes=sizes, guarded=True).blockbatch_config()
    assert one_guarded.prune_after_syncs == (None if len(sizes) == 1 else 1) and one_guarded.merge_agreement == 2
    dense_contained = app.check_settings("hi", fast_drafts=True, fast_contained=True).fast_config()
    assert dense_contained.lookahead_draft_radius is None and dense_contained.lookahead_accept == "contained"


def _compare_fn(demo):
    return next(f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "compare")


def test_refused_input_shows_in_the_banner_and_logs_one_line(loaded, caplog) -> None:
    """After a refused request the banner shows the error (not the previous run's numbers), the
    log gets one line, and an API client gets a gr.Error that prints no traceback."""
    demo = app.build_demo(loaded, examples=[PROMPT])
    compare = _compare_fn(demo)
    run = compare(PROMPT, 10**9, *SETTINGS[1:])
    with caplog.at_level("INFO", logger="hf_blockbatch.demo"):
        banner = next(run)[0]
        with pytest.raises(gr.Error) as err:
            next(run)
    assert 'class="bb-banner error"' in banner and "Max new tokens" in banner
    assert err.value.print_exception is False
    lines = [r for r in caplog.records if r.name == "hf_blockbatch.demo"]
    assert len(lines) == 1 and lines[0].getMessage().startswith("input refused: Max new tokens") and not lines[0].exc_info


def test_a_decode_that_fails_says_so_in_the_banner_and_the_panes(loaded, caplog, monkeypatch) -> None:
    """A decode that raised something other than a refusal (a forward failing: out of memory, a bug) left the banner at
    "decoding on cpu…" and the panes at "decoding…" / "waiting…", with Gradio's bare "Error" toast: a frozen page. Now
    the banner and both panes say the decode failed and why, the log gets the traceback, an API client a gr.Error."""

    def failing(*args, **kwargs):
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(loaded.model, "forward_windows", failing)
    run = _compare_fn(app.build_demo(loaded, examples=[PROMPT]))(PROMPT, *SETTINGS)
    assert "decoding…" in next(run)[1]
    with caplog.at_level("INFO", logger="hf_blockbatch.demo"):
        banner, fast, block, *_ = next(run)
        with pytest.raises(gr.Error, match="the forward failed") as err:
            next(run)
    assert 'class="bb-banner error"' in banner and "RuntimeError: the forward failed" in banner
    assert all("failed" in pane and "decoding…" not in pane and "waiting…" not in pane for pane in (fast, block))
    assert err.value.print_exception is False
    lines = [r for r in caplog.records if r.name == "hf_blockbatch.demo"]
    assert len(lines) == 1 and lines[0].levelname == "ERROR" and lines[0].exc_info


def test_a_refused_run_left_unread_does_not_hold_the_next_decode(loaded) -> None:
    """The refusal's banner is a yield: a visitor who stops reading there (a closed tab, an API client that
    stops iterating) used to leave the generator suspended inside the decode gate, so every later visitor's
    decode waited on it forever (with one decode at a time, the default)."""
    import threading

    short = app.encode_prompt(loaded.tokenizer, "Hi").shape[1]
    demo = app.build_demo(loaded, limits=app.Limits(max_prompt_tokens=short), concurrency=1, examples=[PROMPT])
    compare = _compare_fn(demo)
    refused = compare(PROMPT, *SETTINGS)  # too many tokens: refused once encoded, inside the decode gate
    next(refused)
    assert 'class="bb-banner error"' in next(refused)[0]  # ... and nobody asks for more
    done: list[tuple] = []
    other = threading.Thread(target=lambda: done.extend(compare("Hi", *SETTINGS)), daemon=True)
    try:
        other.start()
        other.join(timeout=30)
        assert not other.is_alive(), "the next visitor's decode waited on the unread refusal"
    finally:
        refused.close()  # lets a blocked decode go on, so a failure leaves no thread behind
        other.join(timeout=30)
    assert done and done[-1][5]["blockbatch"]["nfe"] > 0


@pytest.mark.parametrize("flag", ["--concurrency", "--threads", "--max-new-tokens"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_app_counts_below_one_are_refused_by_its_parser(flag, value, capsys, monkeypatch) -> None:
    """``python demo/app.py`` (a Space's entry) read --concurrency 0 as 1 decode at a time and --max-new-tokens 0 as
    the default, in silence, and --threads -1 failed inside torch with a traceback; as ``hf-blockbatch demo``
    (positive_int), each is now refused by the parser, before any model loads."""
    monkeypatch.setattr(app, "load_for_demo", lambda *a, **k: pytest.fail(f"{flag} {value} was accepted"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: pytest.fail(f"{flag} {value} reached torch"))
    with pytest.raises(SystemExit) as stop:
        app.main([flag, value])
    assert stop.value.code == 2 and f"argument {flag}: must be >= 1, got {value}" in capsys.readouterr().err


def test_app_max_new_tokens_below_the_slider_start_is_refused(capsys, monkeypatch) -> None:
    """``--max-new-tokens 5`` built a page whose slider ran from 8 to 5: every request was refused."""
    monkeypatch.setattr(app, "load_for_demo", lambda *a, **k: pytest.fail("--max-new-tokens 5 was accepted"))
    with pytest.raises(SystemExit) as stop:
        app.main(["--max-new-tokens", str(app.MIN_NEW_TOKENS - 3)])
    assert stop.value.code == 2
    assert f"argument --max-new-tokens: the slider starts at {app.MIN_NEW_TOKENS} new tokens, got 5" in capsys.readouterr().err
    assert app.build_parser().parse_args(["--max-new-tokens", str(app.MIN_NEW_TOKENS)]).max_new_tokens == app.MIN_NEW_TOKENS


def test_cli_demo_max_new_tokens_below_the_slider_start_is_refused_by_its_own_parser(capsys, tmp_path) -> None:
    """``hf-blockbatch demo --max-new-tokens 5`` passed its parser (any count >= 1) and was refused only by the app's,
    after Gradio and the app had been imported; its help did not say the least value. Both parsers read the one
    constant the slider starts at (app.MIN_NEW_TOKENS is cli.DEMO_MIN_NEW_TOKENS)."""
    from hf_blockbatch import cli

    stub = tmp_path / "app.py"
    stub.write_text("raise AssertionError('the app was imported')\n", encoding="utf-8")
    with pytest.raises(SystemExit) as stop:
        cli.main(["demo", "--app", str(stub), "--max-new-tokens", str(app.MIN_NEW_TOKENS - 3)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"hf-blockbatch demo: error: argument --max-new-tokens: the slider starts at {app.MIN_NEW_TOKENS} new tokens, got 5"
    assert app.MIN_NEW_TOKENS is cli.DEMO_MIN_NEW_TOKENS
    demo = cli.build_parser().parse_args(["demo", "--max-new-tokens", str(app.MIN_NEW_TOKENS)])
    assert demo.max_new_tokens == app.MIN_NEW_TOKENS


def test_build_demo_refuses_a_concurrency_below_one(loaded) -> None:
    with pytest.raises(ValueError, match="concurrency must be a positive integer, got 0"):
        app.build_demo(loaded, concurrency=0, examples=[PROMPT])


def test_answer_boxes_share_a_row() -> None:
    """The two answers sit in one row of their own, so they line up whatever each replay's height."""
    demo = app.build_demo(app.random_tiny_llada(hb.TINY_LLADA), examples=[PROMPT])
    def labels(block) -> list[str]:  # the row's own fields (Gradio wraps them in a Form), not its columns'
        return [label for c in getattr(block, "children", []) if not isinstance(c, gr.Column)
                for label in ([c.label] if getattr(c, "label", None) else labels(c))]  # fmt: skip

    rows = [sorted(labels(b)) for b in demo.blocks.values() if isinstance(b, gr.Row)]
    assert ["BlockBatch answer", "Fast-dLLM answer"] in rows


# ------------------------------------------------------------------------------- the running app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def loaded() -> app.LoadedModel:
    torch.set_num_threads(1)
    return app.random_tiny_llada(hb.TINY_LLADA)


@pytest.fixture(scope="module")
def server(loaded):
    """The app served on 127.0.0.1 in Gradio's background thread, closed after the module."""
    demo = app.build_demo(loaded, examples=[PROMPT])
    _, url, _ = app.launch_demo(demo, server_name="127.0.0.1", server_port=_free_port(), prevent_thread_lock=True,
                                quiet=True)  # fmt: skip
    yield url
    demo.close()


def test_client_comparison_matches_model_generate(server, loaded) -> None:
    from gradio_client import Client

    client = Client(server, verbose=False)
    banner, fast_html, block_html, fast_text, block_text, stats = client.predict(
        PROMPT, *SETTINGS, api_name="/compare"
    )
    assert fast_text.strip() and block_text.strip(), "both sides must produce text"
    # the same request straight through the library
    ids = app.encode_prompt(loaded.tokenizer, PROMPT)
    ref = {}
    for key, cfg in {
        "fast_dllm": hb.FastDLLMConfig(max_new_tokens=32, block_length=16, threshold=0.9),
        "blockbatch": hb.BlockBatchConfig(max_new_tokens=32, block_sizes=[4, 8, 16, 32], threshold=0.9),
    }.items():
        out = loaded.model.generate(ids, generation_config=cfg, return_dict_in_generate=True)
        ref[key] = int(out.nfe[0])
    assert stats["fast_dllm"]["nfe"] == ref["fast_dllm"] and stats["blockbatch"]["nfe"] == ref["blockbatch"]
    # ... and the page shows those numbers
    assert f'<span class="v">{ref["fast_dllm"]}</span><span class="l">NFE</span>' in fast_html
    assert f'<span class="v">{ref["blockbatch"]}</span><span class="l">NFE</span>' in block_html
    assert f"<b>{ref['blockbatch']}</b> NFE vs Fast-dLLM <b>{ref['fast_dllm']}</b>" in banner
    assert "bb-lane" in block_html and "bb-chip" in fast_html


def test_client_empty_prompt_warns_and_absurd_settings_fail_cleanly(server) -> None:
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    client = Client(server, verbose=False)
    banner, *_ = client.predict("", *SETTINGS, api_name="/compare")
    assert "Type a prompt" in banner
    with pytest.raises(AppError):
        client.predict(PROMPT, 10**9, *SETTINGS[1:], api_name="/compare")
    with pytest.raises(AppError, match="characters"):
        client.predict("x" * 5000, *SETTINGS, api_name="/compare")
    # the app still answers afterwards
    assert client.predict(PROMPT, *SETTINGS, api_name="/compare")[5]["blockbatch"]["nfe"] > 0


def test_cli_demo_loads_the_app_by_path(tmp_path, capsys) -> None:
    """``hf-blockbatch demo`` forwards its options to the app's ``main`` (a stub app here)."""
    from hf_blockbatch import cli

    stub = tmp_path / "app.py"
    stub.write_text("def main(argv):\n    print('ARGV', argv)\n    return 0\n", encoding="utf-8")
    assert cli.main(["demo", "--app", str(stub), "--port", "7999", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "'--model', 'tiny-llada'" in out and "'--port', '7999'" in out and "'--threads', '1'" in out
    assert cli.main(["demo", "--app", str(tmp_path / "missing.py")]) == 2
    assert (ROOT / "demo" / "app.py").is_file()  # the default the CLI loads in a checkout


# ----------------------------------------------------------------------------------- the browser


def test_browser_runs_one_comparison_and_screenshots(server, tmp_path) -> None:
    """One comparison in Debian's chromium: a live frame appears, then the final one; screenshot."""
    from demo import screenshot

    if screenshot.find_chromium() is None:
        pytest.skip(
            "no chromium at /usr/bin/chromium (Debian: apt-get install -y chromium); the browser test needs it"
        )
    pytest.importorskip("playwright", reason="playwright is not installed (pip install -e '.[test]')")
    shot = tmp_path / "demo.png"
    shown = screenshot.capture(server, shot, prompt=PROMPT, speed="fast", height=None)
    assert "forward passes" in shown["banner"]
    assert shown["lanes"] == 5  # the default block sizes 4, 8, 16, 32, 64
    assert shown["fast_chips"] > 0
    assert shot.stat().st_size > 10_000


def test_browser_phone_width_shows_the_whole_prompt_and_answers_line_up(server) -> None:
    """At phone width the prompt box shows the whole example prompt (no scrolling inside it); at
    desktop width, after a comparison, the two answer boxes start at the same height."""
    from demo import screenshot

    if screenshot.find_chromium() is None:
        pytest.skip(
            "no chromium at /usr/bin/chromium (Debian: apt-get install -y chromium); the browser test needs it"
        )
    pytest.importorskip("playwright", reason="playwright is not installed (pip install -e '.[test]')")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=screenshot.find_chromium(), args=screenshot.CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 390, "height": 844})
            page.goto(server)
            box = page.get_by_label("Prompt")
            box.wait_for()
            assert box.evaluate("el => el.scrollHeight <= el.clientHeight + 2"), "the prompt is cut at phone width"
            page.set_viewport_size({"width": 1440, "height": 1000})
            page.get_by_text("instant", exact=True).click()
            page.get_by_role("button", name="Decode both ▶").click()
            page.wait_for_selector(".bb-banner .big", timeout=300_000)
            tops = [page.get_by_label(name).bounding_box()["y"] for name in ("Fast-dLLM answer", "BlockBatch answer")]
            assert abs(tops[0] - tops[1]) < 2, tops
        finally:
            browser.close()
