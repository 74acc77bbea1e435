"""``benchmarks/commit_rules_probe.py``: the uncached loop that RESULTS §31's commit rules run in.

Its baseline must be the library's Fast-dLLM without a cache, token for token and forward for forward, or
the rules' ratios would measure the loop instead of the rule; the leave-one-out shadows must leave the
canvas's own queries untouched; and every rule must end with an answer that holds no mask.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_benchmark

import hf_blockbatch as hb
from hf_blockbatch.eval.runner import _encode, load_task
from hf_blockbatch.generation.outputs import answer_lengths, end_token_ids

probe = load_benchmark("commit_rules_probe")


@pytest.fixture(scope="module", params=["tiny-llada", "tiny-dream"])
def loaded(request):
    model, tokenizer = hb.load_model(request.param, device="cpu")
    return model, tokenizer, torch.tensor(end_token_ids(tokenizer, model.config))


def items(tokenizer, suite: str, n: int):
    task = load_task(suite)
    for item in task.items("train", limit=n):
        ids, mask = _encode(tokenizer, [task.prompt(item, tokenizer, chat=True)], torch.device("cpu"))
        yield ids, mask, int(task.default_gen_length)


def before_end(tokens: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """The answer and its first end token (what a decoder's stop rule reads)."""
    return tokens[: int(answer_lengths(tokens[None], end.tolist())[0]) + 1]


@torch.inference_mode()
def test_threshold_baseline_is_fast_dllm_without_a_cache(loaded) -> None:
    model, tokenizer, end = loaded
    base = probe.Rule.parse(probe.BASELINE)
    checked = 0
    for suite in ("arith", "code"):
        for ids, mask, gen in items(tokenizer, suite, 4):
            x, nfe, queries = probe.decode(model, ids, gen, 64, base, model.config.mask_token_id, end)
            cfg = hb.FastDLLMConfig(cache="none", block_length=64, threshold=0.9, early_stop=True, max_new_tokens=gen)
            out = model.generate(ids, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)
            P = ids.shape[1]
            ours = before_end(x[0, P:], end)
            assert torch.equal(ours, out.sequences[0, P : P + ours.numel()])
            assert nfe == int(out.nfe[0]) and queries == nfe * (P + gen)
            checked += 1
    assert checked == 8


@torch.inference_mode()
def test_entropy_rule_is_the_librarys_uncached_decoder(loaded) -> None:
    """The probe's ``entropy:γ`` is ``FastDLLMConfig(cache="none", rule="entropy")``, token for token and
    forward for forward: the rule the probe measured is the one the decoders run."""
    model, tokenizer, end = loaded
    for ids, mask, gen in items(tokenizer, "lists", 4):
        x, nfe, _ = probe.decode(model, ids, gen, 64, probe.Rule.parse("entropy:0.3"), model.config.mask_token_id, end)
        cfg = hb.FastDLLMConfig(cache="none", block_length=64, rule="entropy", entropy_bound=0.3, early_stop=True,
                                max_new_tokens=gen)  # fmt: skip
        out = model.generate(ids, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)
        ours = before_end(x[0, ids.shape[1] :], end)
        assert torch.equal(ours, out.sequences[0, ids.shape[1] : ids.shape[1] + ours.numel()]) and nfe == int(out.nfe[0])


@torch.inference_mode()
def test_shadows_do_not_change_the_canvas_queries(loaded) -> None:
    """A check that never masks again (τ_back 0) and no cap decode exactly the baseline: the canvas's
    queries never see a shadow, and each forward carries one more block of queries."""
    model, tokenizer, end = loaded
    base = probe.Rule.parse(probe.BASELINE)
    blind = probe.Rule.parse("wino-loo-nocap:0.9", tau_back=0.0)
    for ids, _, gen in items(tokenizer, "arith", 3):
        x0, nfe0, _ = probe.decode(model, ids, gen, 32, base, model.config.mask_token_id, end)
        x1, nfe1, q1 = probe.decode(model, ids, gen, 32, blind, model.config.mask_token_id, end)
        assert torch.equal(x0, x1) and nfe0 == nfe1 and q1 == nfe1 * (ids.shape[1] + gen + 32)


@pytest.mark.parametrize("spec", ["wino-loo:0.6", "wino-loo-extras:0.6", "allin-min:0.0", "allin-mean:0.5", "threshold:0.6",
                                  "isolated1:0.0"])
@torch.inference_mode()
def test_every_rule_ends_with_no_mask_before_its_end(loaded, spec: str) -> None:
    """A low τ_in commits much and a strict check (τ_back 0.99) masks much of it again, so that the check
    takes more forwards than the same threshold without it; the loop still moves forward (a step masks
    again fewer tokens than the step before committed) and ends with an answer."""
    model, tokenizer, end = loaded
    rule = probe.Rule.parse(spec, tau_back=0.99)
    plain = probe.Rule.parse("threshold:0.6")
    mask_id = model.config.mask_token_id
    nfe = nfe_plain = 0
    for ids, _, gen in items(tokenizer, "arith", 2):
        x, n, _ = probe.decode(model, ids, gen, 32, rule, mask_id, end)
        answer = before_end(x[0, ids.shape[1] :], end)
        assert not bool((answer == mask_id).any()) and 1 <= n <= 4 * gen
        if spec == "allin-min:0.0":  # every gap is >= 0: each block is committed by its first forward
            assert n <= -(-gen // 32)
        nfe += n
        nfe_plain += probe.decode(model, ids, gen, 32, plain, mask_id, end)[1]
    if rule.tau_back is not None:
        assert nfe > nfe_plain


def test_shadow_layout_hides_what_each_shadow_checks() -> None:
    """Canvas of 5, block [2, 4): rows are queries, columns keys; shadows are positions 5 and 6."""
    pos, mask = probe.shadow_layout(5, 2, 4, shift=0, shadows_see_shadows=True)
    assert pos.tolist() == [[0, 1, 2, 3, 4, 2, 3]]
    canvas = [1, 1, 1, 1, 1, 0, 0]
    assert mask[0].int().tolist() == [canvas] * 5 + [[1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1, 1]]
    # shifted (Dream): the shadow checking p sits at p - 1, holds that token, and sees no shadow, itself included
    pos, mask = probe.shadow_layout(5, 2, 4, shift=1, shadows_see_shadows=False)
    assert pos.tolist() == [[0, 1, 2, 3, 4, 1, 2]]
    assert mask[0].int().tolist() == [canvas] * 5 + [[1, 1, 0, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0, 0]]


@torch.inference_mode()
def test_wino_caps_a_step_at_its_release_limit() -> None:
    """τ_in 0 offers every mask and τ_back 0 never masks one again: without the cap one forward fills the
    64-position block; WINO's clamp(0.7 × masks, 5, 20) takes 20, 20, 16, 5 and the last 3."""
    model, tokenizer = hb.load_model("tiny-llada", device="cpu")
    ids = torch.tensor([[5, 6, 7, 8]])
    end = torch.tensor(end_token_ids(tokenizer, model.config))
    assert [probe.accept_cap(m) for m in (64, 44, 24, 8, 3)] == [20, 20, 16, 5, 5]
    nfe = {spec: probe.decode(model, ids, 64, 64, probe.Rule.parse(spec, tau_back=0.0), model.config.mask_token_id,
                              end)[1] for spec in ("wino:0.0", "wino-nocap:0.0")}  # fmt: skip
    assert nfe == {"wino:0.0": 5, "wino-nocap:0.0": 1}


def test_isolated_masks_have_no_other_mask_within_the_radius() -> None:
    """The lone masks of a block, by a plain loop: positions before the block are decoded, those after it
    masked only when more blocks follow."""
    masked = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 0, 1], dtype=torch.bool)
    for radius in (1, 2, 3):
        for after in (False, True):
            ext = masked.tolist() + [after] * radius
            want = [bool(m) and not any(ext[j] for j in range(max(i - radius, 0), i + radius + 1) if j != i)
                    for i, m in enumerate(masked.tolist())]  # fmt: skip
            assert probe.isolated(masked, radius, after).tolist() == want, (radius, after)
    assert probe.isolated(masked, 1, False).tolist() == [1, 0, 0, 0, 0, 0, 1, 0, 0, 1]
    assert probe.isolated(masked, 1, True).tolist()[-1] is False


def test_rule_specs_and_refusals() -> None:
    assert probe.Rule.parse("wino:0.7") == probe.Rule("wino:0.7", 0.7, 0.9, cap=True)
    assert not probe.Rule.parse("wino-extras-nocap:0.7").cap
    assert probe.Rule.parse("entropy:0.3").entropy_bound == 0.3
    lone = probe.Rule.parse("isolated2:0.6")
    assert (lone.tau_in, lone.isolation, lone.tau_lone) == (0.9, 2, 0.6)
    for bad in ("winofoo:0.8", "wino-loo-loo:0.8", "wino-cap:0.8", "isolated:0.5", "isolated0:0.5"):
        with pytest.raises(ValueError, match=f"Unknown rule '{bad}'"):
            probe.Rule.parse(bad)
    extras = probe.Rule.parse("wino-loo-extras:0.6", tau_back=0.8)
    assert (extras.tau_back, extras.shadows_see_shadows, extras.extras_only) == (0.8, False, True)
    assert probe.Rule.parse("allin-mean:0.9").allin == "mean"
    with pytest.raises(ValueError, match="write name:number"):
        probe.Rule.parse("wino")
    with pytest.raises(ValueError, match="Unknown rule 'prophet:0.5'"):
        probe.Rule.parse("prophet:0.5")
    model, _ = hb.load_model("tiny-dream", device="cpu")
    with pytest.raises(ValueError, match="shifted model.*wino-loo"):
        probe.decode(model, torch.tensor([[5, 6, 7]]), 8, 8, probe.Rule.parse("wino:0.8"), model.config.mask_token_id,
                     torch.tensor([model.config.eos_token_id]))  # fmt: skip


def test_main_writes_the_table_against_the_baseline(tmp_path) -> None:
    probe.main(["--model", "tiny-llada", "--suites", "code", "--limit", "3", "--rules", "threshold:0.7", "wino:0.8",
                "--out", str(tmp_path)])  # fmt: skip
    result = json.loads((tmp_path / "tiny-llada_3.json").read_text())
    rows = result["suites"]["code"]
    assert list(rows) == [probe.BASELINE, "threshold:0.7", "wino:0.8"]
    assert rows[probe.BASELINE]["nfe_ratio"] == 1.0 and rows[probe.BASELINE]["delta_points"] == 0.0
    assert rows["wino:0.8"]["query_ratio"] > 1.0  # the shadows are queries too
    table = (tmp_path / "tiny-llada_3.md").read_text()
    w = rows["wino:0.8"]
    assert f"| `wino:0.8` | {w['delta_points']:+.1f} · {w['nfe_ratio']:.3f} · {w['query_ratio']:.2f} |" in table


@pytest.mark.parametrize(("args", "says"), [
    (["--suites", "arith", "gsm8k"], "error: gsm8k: only the 'test' split is provided (the shots are built in)"),
    (["--model", "tiny-dream", "--rules", "wino:0.8"], "error: wino:0.8: tiny-dream is a shifted model; use wino-loo / "
                                                       "wino-loo-extras."),
])  # fmt: skip
def test_main_refuses_what_a_suite_or_the_model_cannot_run_before_any_decode(tmp_path, monkeypatch, capsys, args,
                                                                             says) -> None:  # fmt: skip
    """``--suites arith gsm8k`` (gsm8k holds its test split only) was refused when gsm8k's turn came, after arith's
    items had decoded (200 of them by default); it and a rule the model cannot run exited with status 1, where
    ``run_main`` says bad input with status 2. Both now stop before the first decode, with status 2."""
    from hf_blockbatch.eval.script_args import run_main

    monkeypatch.setattr(probe, "decode", lambda *a, **k: pytest.fail("a decode ran before the refusal"))
    status = run_main(lambda: probe.main(["--model", "tiny-llada", "--limit", "2", "--out", str(tmp_path), *args]))
    assert status == 2 and capsys.readouterr().err.strip().splitlines()[-1] == says
    assert not list(tmp_path.iterdir())


@torch.inference_mode()
def test_a_learned_filter_that_never_commits_is_the_threshold_decode(loaded) -> None:
    """``learned:p`` adds the filter's commits to the threshold's: with a filter that rates every proposal 0 it
    decodes as ``threshold:0.9``, token for token and forward for forward, and collecting the fitting data does
    not change a decode. The labels say whether a step's proposal is the token the decode ended with: every
    mask's proposal in the step that commits it is, so at least one label per step is 1."""
    model, tokenizer, end = loaded
    base = probe.Rule.parse(probe.BASELINE)
    never = probe.replace(probe.Rule.parse("learned:0.5"), filter=lambda f: torch.zeros(f.shape[0], dtype=torch.float64))
    mask_id = model.config.mask_token_id
    for ids, _, gen in items(tokenizer, "lists", 2):
        data: list = []
        x, nfe, q = probe.decode(model, ids, gen, 32, base, mask_id, end)
        for rule, collect in ((never, None), (base, data)):
            y, n, r = probe.decode(model, ids, gen, 32, rule, mask_id, end, collect)
            assert torch.equal(x, y) and (n, r) == (nfe, q)
        assert len(data) == nfe  # one entry per forward (every block's steps)
        for f, label in data:
            assert f.shape == (label.shape[0], len(probe.FEATURES)) and set(label.tolist()) <= {0.0, 1.0}
            assert label.max() == 1.0


def test_the_filter_learns_a_separable_rule_and_the_spec_parses() -> None:
    torch.manual_seed(0)
    f = torch.rand(400, len(probe.FEATURES), dtype=torch.float64)
    y = (f[:, 2] + f[:, 5] > 1.0).double()  # the gap and the agreement with the previous forward
    filt = probe.Filter.fit(f, y)
    with torch.no_grad():
        assert ((filt(f) >= 0.5).double() == y).double().mean() > 0.95
    rule = probe.Rule.parse("learned:0.85")
    assert (rule.learned, rule.tau_in, rule.filter) == (0.85, 0.9, None)


def test_a_learned_rule_without_items_to_fit_on_says_so(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        probe.main(["--model", "tiny-llada", "--suites", "code", "--limit", "2", "--fit-limit", "0", "--rules", "learned:0.9",
                    "--out", str(tmp_path)])  # fmt: skip
    assert "--fit-limit must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no train items after the first 2 of code"):
        probe.fit_filter(*hb.load_model("tiny-llada", device="cpu"), ["code"], 2, 0, 64)
