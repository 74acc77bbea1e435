"""Fast checks of the SFT training code (tiny configs, a few steps, CPU)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from hf_blockbatch.training import sft
from hf_blockbatch.training.eval_quick import (
    aligned_logits,
    completion_text,
    greedy_decode,
    masked_token_accuracy,
)
from hf_blockbatch.training.objective import apply_noise, sft_loss
from hf_blockbatch.training.sft import Example, TrainConfig, build_model, encode_items, make_batch, train
from hf_blockbatch.training.tokenizer import asset_dir, special_token_ids

FAMILIES = ("llada", "dream")


def _tiny(family: str, **kw) -> TrainConfig:
    base = dict(family=family, d_model=32, n_layers=2, n_heads=4, mlp_hidden=64, num_threads=1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module", params=FAMILIES)
def family_tok(request):
    return request.param, AutoTokenizer.from_pretrained(str(asset_dir(request.param)))


def _examples() -> list[Example]:
    return [
        Example([1, 10, 11, 12], [20, 21, 3]),
        Example([1, 13], [22, 3]),
        Example([1, 14, 15], [23, 24, 25, 3]),
    ]


def test_make_batch_right_pads_with_eos():
    ids, is_prompt = make_batch(_examples(), gen_length=6, eos_id=0)
    assert ids.shape == (3, 4 + 6)
    assert ids[1].tolist() == [1, 13, 22, 3] + [0] * 6
    assert is_prompt.sum(1).tolist() == [4, 2, 3]
    with pytest.raises(ValueError):
        make_batch(_examples(), gen_length=3, eos_id=0)
    # a response exactly as long as the canvas fits (the row's padding is then only the longer prompt's)
    ids, _ = make_batch(_examples(), gen_length=4, eos_id=0)
    assert ids[2].tolist() == [1, 14, 15, 23, 24, 25, 3, 0]


def test_masking_never_touches_prompt():
    ids, is_prompt = make_batch(_examples() * 20, gen_length=8, eos_id=0)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        noisy, masked = apply_noise(ids, is_prompt, mask_id=2, generator=g, t_min=0.1)
        assert not bool((masked & is_prompt).any())
        assert torch.equal(noisy[is_prompt], ids[is_prompt])
        assert bool((noisy[masked] == 2).all()) and torch.equal(noisy[~masked], ids[~masked])
        assert bool(masked.any(1).all())  # every row contributes
    # t = 1 masks the whole response, t ~ 0 still masks one token per row
    _, all_masked = apply_noise(ids, is_prompt, 2, g, t=torch.ones(ids.shape[0]))
    assert torch.equal(all_masked, ~is_prompt)
    _, one = apply_noise(ids, is_prompt, 2, g, t=torch.zeros(ids.shape[0]))
    assert one.sum(1).tolist() == [1] * ids.shape[0]


def test_noise_level_is_drawn_between_t_min_and_one():
    """t ~ U(t_min, 1) per row: the masked share of a long response averages (1 + t_min) / 2 and no row is masked
    much below t_min; a draw past 1 would mask whole responses."""
    ids = torch.zeros((400, 2 + 400), dtype=torch.long)
    is_prompt = torch.zeros_like(ids, dtype=torch.bool)
    is_prompt[:, :2] = True
    _, masked = apply_noise(ids, is_prompt, 2, torch.Generator().manual_seed(0), t_min=0.5)
    share = masked[:, 2:].float().mean(1)
    assert abs(float(share.mean()) - 0.75) < 0.02 and float(share.min()) > 0.4
    assert int((share == 1).sum()) <= 4  # t close to 1 only


def test_loss_is_the_mean_over_masked_positions():
    """Mean (not summed) cross-entropy over the masked positions; a batch with none masked costs 0, not NaN."""
    V = 8
    targets = torch.tensor([[1, 2, 3, 4]])
    logits = torch.zeros((1, 4, V))  # uniform: log(V) per position
    for masked in ([False, True, False, False], [False, True, True, True]):
        assert float(sft_loss(logits, targets, torch.tensor([masked]), 0)) == pytest.approx(math.log(V))
    confident = torch.zeros((1, 4, V))
    confident[0, 2, 3] = 50.0  # position 2 right (loss ~0), position 1 uniform
    loss = sft_loss(confident, targets, torch.tensor([[False, True, True, False]]), 0)
    assert float(loss) == pytest.approx(math.log(V) / 2)
    leaf = logits.clone().requires_grad_()
    none = sft_loss(leaf, targets, torch.zeros((1, 4), dtype=torch.bool), 0)
    none.backward()
    assert float(none.detach()) == 0.0 and bool((leaf.grad == 0).all())


def test_held_out_metrics_weight_each_masked_position_once():
    """Loss and accuracy over the masked positions of all batches together: a batch's mean counts as many times as
    it has masked positions, and unmasked positions (here predicted right) count in neither."""
    V, big = 4, 50.0
    clean = torch.tensor([[0, 1, 2, 3]])

    class Stub:
        device = torch.device("cpu")
        logit_shift = 0

        def __call__(self, noisy):
            logits = torch.full((1, 4, V), -big)
            logits[0, torch.arange(4), clean[0]] = big  # every position right ...
            logits[0, 2] = 0.0  # ... but position 2: uniform, and its argmax (token 0) is wrong
            return type("Out", (), {"logits": logits})()

    batches = [
        (clean, clean, torch.tensor([[False, True, True, False]])),  # one right, one uniform
        (clean, clean, torch.tensor([[False, False, True, False]])),  # one uniform
    ]
    got = masked_token_accuracy(Stub(), batches)
    assert got["heldout_acc"] == pytest.approx(1 / 3)
    assert got["heldout_loss"] == pytest.approx(2 * math.log(V) / 3)


def test_completion_stops_at_the_first_end_token(family_tok):
    _, tok = family_tok
    ids = special_token_ids(tok)
    first, second = (tok(text, add_special_tokens=False)["input_ids"] for text in ("#### 12", " and 34"))
    assert completion_text(tok, first + [ids["eot"]] + second, (ids["eot"], ids["eos"])) == "#### 12"
    assert completion_text(tok, first + [ids["eos"]] + second + [ids["eot"]], (ids["eot"], ids["eos"])) == "#### 12"


def test_loss_shift_on_hand_made_tensors():
    V = 5
    targets = torch.tensor([[1, 2, 3, 4]])
    masked = torch.tensor([[False, False, True, True]])
    big = 20.0
    # unshifted (LLaDA): logits at i are confident in token i
    llada = torch.full((1, 4, V), -big)
    llada[0, torch.arange(4), targets[0]] = big
    assert float(sft_loss(llada, targets, masked, 0)) < 1e-4
    # shifted (Dream): logits at i - 1 predict token i
    dream = torch.full((1, 4, V), -big)
    dream[0, torch.arange(3), targets[0, 1:]] = big
    assert float(sft_loss(dream, targets, masked, 1)) < 1e-4
    assert float(sft_loss(dream, targets, masked, 0)) > 10  # reading it unshifted is wrong
    assert float(sft_loss(llada, targets, masked, 1)) > 10
    # only masked positions count: a wrong prediction at an unmasked position costs nothing
    llada[0, 0] = 0.0
    assert float(sft_loss(llada, targets, masked, 0)) < 1e-4
    # aligned logits put Dream's predictions where LLaDA's are
    assert torch.equal(aligned_logits(dream, 1)[:, 1:], llada[:, 1:])


def test_loss_decreases_on_repeated_batch(family_tok):
    family, tok = family_tok
    torch.manual_seed(0)
    model = build_model(_tiny(family), tok)
    assert model.logit_shift == (1 if family == "dream" else 0)
    ids, is_prompt = make_batch(_examples(), gen_length=8, eos_id=0)
    noisy, masked = apply_noise(ids, is_prompt, 2, torch.Generator().manual_seed(0), t=torch.full((3,), 0.6))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = sft_loss(model(noisy).logits, ids, masked, model.logit_shift)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]


def test_model_config_uses_tokenizer_ids(family_tok):
    family, tok = family_tok
    model = build_model(_tiny(family), tok)
    ids = special_token_ids(tok)
    cfg = model.config
    assert (
        cfg.mask_token_id == ids["mask"] and cfg.eos_token_id == ids["eos"] and cfg.pad_token_id == ids["pad"]
    )
    assert cfg.vocab_size >= len(tok) and cfg.vocab_size % 8 == 0
    assert cfg.context_length == 512 and cfg.rope_theta == 10000.0
    if family == "dream":
        assert cfg.num_key_value_heads == 2
    grown = AutoTokenizer.from_pretrained(str(asset_dir(family)))
    grown.add_tokens(["<x1>", "<x2>"])  # 1026 tokens: the embedding rounds up to a multiple of 8
    assert build_model(_tiny(family), grown).config.vocab_size == 1032


def test_encode_items_appends_the_end_of_turn_and_keeps_what_fits(family_tok):
    """The response is the target and the end of turn; an item whose response is exactly ``max_response`` long is
    kept, one token longer is dropped."""
    from hf_blockbatch.tasks import get_suite

    family, tok = family_tok
    task, eot = get_suite("lists"), special_token_ids(tok)["eot"]
    item = task.items("test", 1)[0]
    target = tok(item.target, add_special_tokens=False)["input_ids"]
    (ex,) = encode_items([item], task, tok, eot, len(target) + 1)
    assert ex.response == target + [eot] and ex.suite == "lists"
    assert ex.prompt == tok(task.prompt(item, tok), add_special_tokens=False)["input_ids"]
    assert encode_items([item], task, tok, eot, len(target)) == []


def test_greedy_decode_fills_every_position(family_tok):
    family, tok = family_tok
    model = build_model(_tiny(family), tok).eval()
    out = greedy_decode(model, [[1, 10, 11], [1, 12]], gen_length=10, mask_id=2, pad_id=0, tokens_per_step=3)
    assert out.shape == (2, 10) and not bool((out == 2).any())


@pytest.mark.skipif(not (Path(asset_dir("llada")) / "model.safetensors").exists(), reason="embedded weights absent")
def test_quick_decode_of_the_embedded_checkpoint_answers_right():
    """The decode that picks the best checkpoint, on ``lists`` test items the embedded tiny-llada answers right with
    it: each block's committed tokens are read by the next steps (a canvas left out of attention decoded noise)."""
    import hf_blockbatch as hb
    from hf_blockbatch.tasks import get_suite
    from hf_blockbatch.training.eval_quick import decode_accuracy

    model, tok = hb.load_model("tiny-llada", device="cpu")
    task = get_suite("lists")
    items = [task.items("test", 8)[i] for i in (0, 3, 5, 6, 7)]
    acc, texts = decode_accuracy(model, tok, task, items, 64, special_token_ids(tok))
    assert acc == 1.0, texts


def test_lr_schedule_warms_up_then_decays_to_its_floor():
    lr = sft._lr_factor
    assert [lr(0.0, s, 4, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # linear warmup, full LR at its end
    assert lr(0.0, 4, 4, 0.1) == 1.0 and lr(0.5, 9, 4, 0.1) == pytest.approx(0.55)
    assert lr(1.0, 9, 4, 0.1) == pytest.approx(0.1) and lr(1.5, 9, 4, 0.1) == pytest.approx(0.1)  # the floor


def test_train_follows_its_schedule_mix_and_keeps_the_best(tmp_path, monkeypatch):
    """The LR of each step follows the schedule over ``steps``; batches draw suites by weight (a weight of 1e-6 is
    never drawn in 20 rows); the held-out batches hold ``eval_items_per_suite`` items per suite; an evaluation runs
    every ``eval_every`` steps and after the last step; the checkpoint kept is the evaluation of lowest held-out loss
    (no decode: accuracy 0 throughout); a fixed canvas (gen_min = gen_max) trains at that length."""
    drawn, heldout_rows = [], []
    monkeypatch.setattr(sft, "make_batch", lambda ex, *a: drawn.append({e.suite for e in ex}) or make_batch(ex, *a))
    real_accuracy = sft.masked_token_accuracy

    def accuracy(model, batches):
        heldout_rows.append(sum(b[0].shape[0] for b in batches))
        return real_accuracy(model, batches)

    monkeypatch.setattr(sft, "masked_token_accuracy", accuracy)
    cfg = _tiny(
        "llada", steps=5, batch_size=4, warmup_steps=2, eval_every=2, log_every=1, suites={"lists": 1.0, "code": 1e-6},
        train_items_per_suite=64, eval_items_per_suite=3, decode_items_per_suite=0, gen_min=48, gen_max=48,
        max_positions=384, lr=1e-2,
    )  # fmt: skip
    best = train(cfg, tmp_path, show_progress=False)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if r["event"] == "train"]
    assert [r["lr"] for r in steps] == pytest.approx([1e-2 * sft._lr_factor(i / 5, i, 2, 0.1) for i in range(5)])
    assert {r["gen_length"] for r in steps} == {48}
    assert drawn[-5:] == [{"lists"}] * 5
    evals = [r for r in log if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 5] and heldout_rows == [6, 6, 6]
    lowest = min(evals, key=lambda r: r["heldout_loss"])
    assert len({r["heldout_loss"] for r in evals}) == 3 and best["step"] == lowest["step"]
    assert json.loads((tmp_path / "best_metrics.json").read_text())["step"] == lowest["step"]


def test_train_saves_reloadable_checkpoint(family_tok, tmp_path):
    family, _ = family_tok
    cfg = _tiny(
        family, steps=3, batch_size=4, warmup_steps=1, eval_every=3, log_every=1, suites={"lists": 1.0},
        train_items_per_suite=64, eval_items_per_suite=4, decode_items_per_suite=0, gen_min=40, gen_max=48,
        max_positions=384,
    )  # fmt: skip
    best = train(cfg, tmp_path, show_progress=False)
    assert best["step"] == 3 and best["heldout_loss"] == best["heldout_loss"]  # finite, not NaN
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["event"] == "train"] == [1, 2, 3]
    model = AutoModel.from_pretrained(tmp_path)
    assert type(model).__name__ == ("DreamModel" if family == "dream" else "LLaDAModelLM")
    assert (tmp_path / "model.safetensors").exists()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert special_token_ids(tok)["mask"] == model.config.mask_token_id
    assert tok.model_max_length == model.config.context_length == 384  # truncation=True stops at the context
    with torch.no_grad():
        logits = model(torch.tensor([[1, 10, 11, 2]])).logits
    assert logits.shape[-1] == model.config.vocab_size and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        ({"steps": 0}, "steps must be an integer >= 1"),
        ({"eval_every": 0}, "eval_every must be an integer >= 1"),
        ({"lr": float("nan")}, "lr must be a finite number > 0"),
        ({"t_min": 1.5}, "t_min must be below 1"),
        ({"t_min": 1.0}, "t_min must be below 1"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio must be at most 1"),
        ({"gen_min": 100, "gen_max": 90}, r"gen_max \(90\) must be >= gen_min \(100\)"),
        ({"n_heads": 3}, r"d_model \(32\) must divide by n_heads \(3\) into an even head dim"),
        ({"n_heads": 32}, r"d_model \(32\) must divide by n_heads \(32\) into an even head dim"),
        ({"n_kv_heads": 3}, "n_kv_heads must divide n_heads"),
        ({"suites": {}}, "suites is empty"),
        ({"suites": {"nosuch": 1.0}}, "suite 'nosuch' is unknown"),
        ({"suites": {"lists": 0.0}}, "suite 'lists' needs a weight > 0"),
        ({"init_from": "/nonexistent"}, "init_from '/nonexistent' is not a checkpoint folder"),
        ({"family": "gpt"}, "family must be 'llada' or 'dream'"),
        ({"attention_dropout": 1.0}, r"attention_dropout must be a dropout probability in \[0, 1\), got 1.0\.$"),
        ({"residual_dropout": float("nan")}, "residual_dropout must be a finite number, got nan\\.$"),
        ({"embedding_dropout": "0.1"}, "embedding_dropout must be a number, got '0.1' \\(str\\)"),
        ({"family": "dream", "residual_dropout": 0.1},
         r"residual_dropout is no dropout of dream models \(theirs: attention_dropout\)\.$"),
    ],
)
def test_bad_settings_are_refused_before_training(tmp_path, options, message):
    """Each used to fail inside torch, divide by zero, or (steps=0, t_min=1.5) train nothing or
    something else than asked; the run now stops before writing anything, naming the option."""
    # a one-step run on a few items, so that a setting the checks let through fails fast instead of training 5000 steps
    quick = _tiny("llada", steps=1, suites={"lists": 1.0}, train_items_per_suite=16, eval_items_per_suite=2,
                  decode_items_per_suite=0)  # fmt: skip
    with pytest.raises(ValueError, match="Bad training settings: .*" + message):
        train(dataclasses.replace(quick, **options), tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


def test_an_output_path_that_is_a_file_is_refused_before_training(tmp_path):
    out = tmp_path / "out"
    out.write_text("not a folder")
    quick = _tiny("llada", steps=1, suites={"lists": 1.0}, train_items_per_suite=16, eval_items_per_suite=2,
                  decode_items_per_suite=0)  # fmt: skip
    with pytest.raises(ValueError) as err:
        train(quick, out, show_progress=False)
    assert str(err.value) == f"out {str(out)!r} is a file: name a folder for the checkpoints."
    assert out.read_text() == "not a folder"


def test_a_file_where_the_final_weights_go_is_refused_before_training(tmp_path, monkeypatch):
    """The final weights are saved to ``out/last``: a file there failed that save once every step had run."""
    (tmp_path / "last").write_text("not a folder")
    quick = _tiny("llada", steps=1, suites={"lists": 1.0}, train_items_per_suite=16, eval_items_per_suite=2,
                  decode_items_per_suite=0)  # fmt: skip

    def no_data(*_a, **_k):
        raise AssertionError("the run started before its output folder was checked")

    monkeypatch.setattr(sft, "_load_data", no_data)
    with pytest.raises(ValueError) as err:
        train(quick, tmp_path, show_progress=False)
    assert str(err.value) == (f"{tmp_path / 'last'} is a file, not a folder: name a folder for {tmp_path / 'last'} "
                              "(the final weights go there).")  # fmt: skip


def test_settings_that_fit_no_data_are_refused(tmp_path):
    small = dict(suites={"lists": 1.0}, train_items_per_suite=16, num_threads=1)
    with pytest.raises(ValueError, match="No training item of lists fits gen_min=8 tokens"):
        train(_tiny("llada", gen_min=8, gen_max=16, **small), tmp_path, show_progress=False)
    with pytest.raises(ValueError, match="beyond the model's 16 positions: raise max_positions"):
        train(_tiny("llada", max_positions=16, **small), tmp_path, show_progress=False)
    assert not (tmp_path / "train_config.json").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # arith's longest test prompt (56 tokens, item 3) is longer than its first 16 training prompts' (51)
        ({"eval_items_per_suite": 8, "decode_items_per_suite": 0, "gen_max": 72, "max_positions": 123},
         "The longest held-out test prompt plus gen_max is 128 tokens, beyond the model's 123 positions"),
        ({"eval_items_per_suite": 3, "decode_items_per_suite": 4, "gen_max": 48, "max_positions": 99},
         "The longest decoded arith test prompt plus its 48 tokens is 104 tokens, beyond the model's 99 positions"),
    ],
)
def test_test_prompts_beyond_the_context_are_refused_before_training(tmp_path, monkeypatch, options, message):
    """The check covered the training prompts only: a longer test prompt failed in the forward of the first
    evaluation, ``eval_every`` steps into the run, with a traceback instead of the command line's one line."""
    monkeypatch.setattr(sft, "make_batch", lambda *_a: pytest.fail("a training step ran"))
    cfg = _tiny("llada", steps=1, eval_every=1, suites={"arith": 1.0}, train_items_per_suite=16, gen_min=48, **options)
    with pytest.raises(sft.TrainingSettingsError) as err:
        train(cfg, tmp_path, show_progress=False)
    assert str(err.value) == message + ": raise max_positions or lower gen_max."
    assert not (tmp_path / "train_config.json").exists()


def test_init_from_a_checkpoint_of_the_other_family_is_refused(tmp_path):
    """A Dream checkpoint continued as LLaDA trained the Dream weights with LLaDA's tokenizer and prompts."""
    import hf_blockbatch as hb

    with pytest.raises(ValueError, match="holds a DreamModel, not a llada model"):
        train(_tiny("llada", init_from=str(hb.TINY_DREAM)), tmp_path, show_progress=False)


def test_the_command_line_says_what_to_change(capsys):
    from hf_blockbatch.training.sft import main

    for argv, message in (
        (["--batch-size", "0"], "batch_size must be an integer >= 1"),
        (["--suites", "lists:x"], "--suites takes name:weight pairs"),
        (["--embedding-dropout", "1.5"], "embedding_dropout must be a dropout probability in [0, 1), got 1.5"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["--family", "llada", "--out", "/nonexistent/out", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_continuing_a_checkpoint_keeps_its_context_in_the_saved_tokenizer(tmp_path, caplog):
    """``init_from`` continues the checkpoint (its architecture and context, whatever ``max_positions`` says); the
    tokenizer saved beside the result claimed ``max_positions`` (256 here) as its ``model_max_length`` while the model
    has 512 positions, so truncation stopped at the wrong length. The evaluation decodes ``decode_items_per_suite``
    items of each suite and records their accuracy and a sample."""
    import hf_blockbatch as hb

    caplog.set_level("INFO", logger=sft.__name__)
    cfg = TrainConfig(family="dream", init_from=str(hb.TINY_DREAM), max_positions=256, steps=1, batch_size=2,
                      warmup_steps=0, eval_every=1, log_every=1, suites={"lists": 1.0}, train_items_per_suite=16,
                      eval_items_per_suite=2, decode_items_per_suite=1, gen_min=40, gen_max=48, num_threads=1,
                      decode_tokens_per_step=8)  # fmt: skip
    best = train(cfg, tmp_path, show_progress=False)
    assert f"continuing from {hb.TINY_DREAM}" in caplog.text
    model = AutoModel.from_pretrained(tmp_path)
    assert model.config.context_length == AutoModel.from_pretrained(hb.TINY_DREAM).config.context_length == 512
    assert AutoTokenizer.from_pretrained(tmp_path).model_max_length == 512
    assert best["decode_acc"] == best["decode_acc/lists"] in (0.0, 1.0) and isinstance(best["sample/lists"], str)


def test_a_continued_checkpoint_too_short_for_gen_max_says_to_lower_gen_max(tmp_path):
    """The refusal said "raise max_positions or lower gen_max", but a checkpoint continued with ``init_from`` keeps its
    own context: raising max_positions (2048 here) changed nothing, and the same refusal came back."""
    import hf_blockbatch as hb

    cfg = TrainConfig(family="dream", init_from=str(hb.TINY_DREAM), max_positions=2048, suites={"lists": 1.0},
                      train_items_per_suite=16, eval_items_per_suite=2, decode_items_per_suite=0, gen_min=40,
                      gen_max=600, num_threads=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"^The longest [a-z -]+ plus gen_max is \d+ tokens, beyond the model's 512 "
                                         r"positions \(the init_from checkpoint's\): lower gen_max\.$"):  # fmt: skip
        train(cfg, tmp_path, show_progress=False)
    assert not (tmp_path / "train_config.json").exists()


_SMALL_RUN = dict(steps=6, batch_size=2, warmup_steps=0, eval_every=4, log_every=1, suites={"lists": 1.0},
                  train_items_per_suite=16, eval_items_per_suite=2, decode_items_per_suite=0, gen_min=40, gen_max=48,
                  max_positions=384)  # fmt: skip


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_an_interrupted_run_evaluates_and_saves_where_it_stopped(tmp_path, monkeypatch, caplog):
    """Ctrl-C during the third step: the two finished steps are evaluated, kept as the best, and saved as ``last``."""
    real_factor = sft._lr_factor

    def factor(progress, step, *a):
        if step == 2:
            raise KeyboardInterrupt
        return real_factor(progress, step, *a)

    monkeypatch.setattr(sft, "_lr_factor", factor)
    best = train(_tiny("llada", **_SMALL_RUN), tmp_path, show_progress=False)
    assert "interrupted at step 2: evaluating and saving" in caplog.text
    events = _events(tmp_path)
    assert [r["step"] for r in events if r["event"] == "eval"] == [2] and best["step"] == 2
    assert events[-1]["event"] == "done" and events[-1]["step"] == 2
    assert json.loads((tmp_path / "last" / "best_metrics.json").read_text())["step"] == 2


def test_each_run_into_a_folder_starts_its_log_lines_with_its_settings(tmp_path):
    """A second run into the same ``out`` (a run continued in stages) added its lines to ``train_log.jsonl`` right
    after the first run's ``done``, with nothing to tell them apart, while ``train_config.json`` holds the second
    run's settings only. Each run's lines now begin with a ``start`` line holding its date and settings."""
    import datetime

    first = _tiny("llada", **{**_SMALL_RUN, "steps": 2, "eval_every": 2})
    train(first, tmp_path, show_progress=False)
    second = _tiny("llada", **{**_SMALL_RUN, "steps": 1, "eval_every": 1, "seed": 1, "init_from": str(tmp_path)})
    train(second, tmp_path, show_progress=False)
    events = _events(tmp_path)
    starts = [i for i, r in enumerate(events) if r["event"] == "start"]
    assert starts[0] == 0 and len(starts) == 2 and events[starts[1] - 1]["event"] == "done"
    runs = events[: starts[1]], events[starts[1]:]
    assert [[r["event"] for r in run] for run in runs] == [["start", "train", "train", "eval", "done"],
                                                           ["start", "train", "eval", "done"]]  # fmt: skip
    assert [run[0]["config"] for run in runs] == [dataclasses.asdict(first), dataclasses.asdict(second)]
    assert runs[1][0]["config"] == json.loads((tmp_path / "train_config.json").read_text())
    for run in runs:
        assert datetime.datetime.fromisoformat(run[0]["date"]).utcoffset() == datetime.timedelta(0)


def test_the_wall_clock_budget_ends_the_run_and_the_last_step_is_evaluated(tmp_path, monkeypatch, caplog):
    """``minutes``: the run stops at the first step that starts past the budget (a fake clock: 25 s per reading, a
    one-minute budget), then evaluates the step it reached."""
    clock = iter(range(0, 10**6, 25))
    monkeypatch.setattr(sft, "time", types.SimpleNamespace(time=lambda: float(next(clock))))  # sft's clock only
    caplog.set_level("INFO", logger=sft.__name__)
    best = train(_tiny("llada", minutes=1.0, **_SMALL_RUN), tmp_path, show_progress=False)
    reached = int(re.search(r"wall-clock budget of 1\.0 min reached at step (\d+)", caplog.text).group(1))
    assert 1 <= reached < _SMALL_RUN["steps"]
    events = _events(tmp_path)
    assert max(r["step"] for r in events if r["event"] == "train") == reached == events[-1]["step"]
    assert [r["step"] for r in events if r["event"] == "eval"][-1] == reached and best["step"] <= reached


@pytest.mark.parametrize("stop", ["budget", "interrupt"])
def test_a_run_stopped_before_its_first_step_evaluates_and_saves_the_starting_model(tmp_path, monkeypatch, caplog, stop):
    """A ``minutes`` budget that ends before the first step (or a Ctrl-C during it) returned ``{}``, saved no
    best checkpoint in ``out`` (only ``last``) and the command line printed ``{}``: now, as a Ctrl-C later on,
    the starting model is evaluated and saved, with a warning that no step ran."""
    if stop == "budget":
        clock = iter(range(0, 10**6, 25))  # 25 s per reading: past a 6 s budget at the first check
        monkeypatch.setattr(sft, "time", types.SimpleNamespace(time=lambda: float(next(clock))))
    else:
        monkeypatch.setattr(sft, "_lr_factor", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    caplog.set_level("INFO", logger=sft.__name__)
    best = train(_tiny("llada", minutes=0.1, **_SMALL_RUN), tmp_path, show_progress=False)
    assert "no training step ran" in caplog.text
    events = _events(tmp_path)
    assert not [r for r in events if r["event"] == "train"]
    assert [r["step"] for r in events if r["event"] == "eval"] == [0] and best["step"] == 0
    assert json.loads((tmp_path / "best_metrics.json").read_text())["step"] == 0
    assert AutoModel.from_pretrained(tmp_path).config.model_type == "llada"


def test_the_command_line_trains_and_prints_the_best_evaluation(tmp_path, capsys):
    sft.main(["--family", "dream", "--out", str(tmp_path), "--d-model", "32", "--n-layers", "2", "--n-heads", "4",
              "--mlp-hidden", "64", "--num-threads", "1", "--steps", "1", "--batch-size", "2", "--warmup-steps", "0",
              "--eval-every", "1", "--suites", "lists", "--train-items-per-suite", "16", "--eval-items-per-suite", "2",
              "--decode-items-per-suite", "0", "--gen-min", "40", "--gen-max", "48", "--max-positions", "384",
              "--no-progress"])  # fmt: skip
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "best_metrics.json").read_text())
    assert printed["event"] == "eval" and printed["step"] == saved["step"] == 1
    assert printed["heldout_loss"] == saved["heldout_loss"] and not any(k.startswith("sample") for k in printed)


# ------------------------------------------------------------------------------ dropout
_DROPOUT_RUN = dict(steps=3, batch_size=2, warmup_steps=0, eval_every=3, log_every=1, suites={"lists": 1.0},
                    train_items_per_suite=16, eval_items_per_suite=2, decode_items_per_suite=0, gen_min=40, gen_max=48,
                    max_positions=384)  # fmt: skip


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def test_every_dropout_of_the_models_is_a_training_setting_unset_by_default():
    """The settings are the model configs' own fields (one source: their ``dropout_fields``), None unless set."""
    from hf_blockbatch import DreamConfig, LLaDAConfig

    for name in LLaDAConfig.dropout_fields + DreamConfig.dropout_fields:
        assert getattr(TrainConfig(), name) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_dropout_changes_the_training_and_is_saved_with_the_run(family, tmp_path):
    """``sft`` had no dropout option: the models' dropouts, which act in training mode, could not be used from it.
    A run with dropout (same seed) now follows another loss trajectory, and the checkpoints (best and last) and
    ``train_config.json`` carry the values; a run without keeps the configs' 0.0."""
    on = {"llada": dict(attention_dropout=0.2, residual_dropout=0.1, embedding_dropout=0.1),
          "dream": dict(attention_dropout=0.2)}[family]  # fmt: skip
    train(_tiny(family, **_DROPOUT_RUN), tmp_path / "off", show_progress=False)
    train(_tiny(family, **on, **_DROPOUT_RUN), tmp_path / "on", show_progress=False)
    off_losses, on_losses = ([r["loss"] for r in _events(tmp_path / d) if r["event"] == "train"] for d in ("off", "on"))
    assert len(off_losses) == len(on_losses) == 3
    assert all(a != b for a, b in zip(off_losses, on_losses))
    fields = AutoModel.from_pretrained(tmp_path / "off").config.dropout_fields
    for folder in ("on", "on/last"):
        saved = json.loads((tmp_path / folder / "config.json").read_text())
        assert {name: saved[name] for name in fields} == on
    assert {name: json.loads((tmp_path / "on" / "train_config.json").read_text())[name] for name in on} == on
    saved = json.loads((tmp_path / "off" / "last" / "config.json").read_text())
    assert {name: saved[name] for name in fields} == dict.fromkeys(fields, 0.0)


def test_a_run_without_dropout_trains_as_one_with_every_dropout_at_zero(tmp_path):
    """Unset (the default) and 0.0 give the same weights, bit for bit: no dropout op runs, no random draw is taken."""
    train(_tiny("llada", **_DROPOUT_RUN), tmp_path / "unset", show_progress=False)
    zero = dict(attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0)
    train(_tiny("llada", **zero, **_DROPOUT_RUN), tmp_path / "zero", show_progress=False)
    unset, zeros = _weights(tmp_path / "unset" / "last"), _weights(tmp_path / "zero" / "last")
    assert unset.keys() == zeros.keys() and all(torch.equal(unset[k], zeros[k]) for k in unset)


def test_a_continued_run_takes_the_dropouts_set_and_keeps_the_checkpoints_for_the_others(tmp_path):
    """With ``init_from``, as with transformers' ``from_pretrained(path, attention_dropout=...)``: a dropout set
    overrides the checkpoint's (0.0 too, which turns it off), one left unset keeps the checkpoint's."""
    first = dict(attention_dropout=0.2, residual_dropout=0.1)
    train(_tiny("llada", **first, **_DROPOUT_RUN), tmp_path / "first", show_progress=False)
    more = dict(_DROPOUT_RUN, steps=1, eval_every=1, init_from=str(tmp_path / "first"))
    train(_tiny("llada", residual_dropout=0.0, embedding_dropout=0.05, **more), tmp_path / "more", show_progress=False)
    saved = json.loads((tmp_path / "more" / "last" / "config.json").read_text())
    assert (saved["attention_dropout"], saved["residual_dropout"], saved["embedding_dropout"]) == (0.2, 0.0, 0.05)


def test_the_command_line_sets_the_dropouts(tmp_path, monkeypatch):
    """``--attention-dropout`` and the others reach the run's settings as floats; those not given stay unset."""
    seen = []
    monkeypatch.setattr(sft, "train", lambda config, *_a, **_k: seen.append(config) or {})
    sft.main(["--family", "llada", "--out", str(tmp_path), "--residual-dropout", "0.1", "--attention-dropout", "0"])
    assert (seen[0].residual_dropout, seen[0].attention_dropout, seen[0].embedding_dropout) == (0.1, 0.0, None)


def test_a_checkpoint_save_cut_short_by_an_earlier_run_is_removed(tmp_path, caplog):
    """A SIGTERM during ``_save_atomic`` (its ``finally`` does not run) left a hidden ``.ckpt-*`` folder holding a
    part of a checkpoint (here an empty ``config.json``, as one run left it; an 8B model's is GBs), which no run
    read or removed. The next run into the folder removes those of ``out`` and ``out/last``, saying so."""
    for left in (tmp_path / ".ckpt-k1ll3d", tmp_path / "last" / ".ckpt-t3rm"):
        left.mkdir(parents=True)
        (left / "config.json").write_text("")
    train(_tiny("llada", **{**_SMALL_RUN, "steps": 1, "eval_every": 1}), tmp_path, show_progress=False)
    assert not list(tmp_path.glob(".ckpt-*")) and not list((tmp_path / "last").glob(".ckpt-*"))
    assert caplog.text.count("an unfinished checkpoint save of an earlier run") == 2
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "last" / "model.safetensors").is_file()


def test_the_command_line_says_a_ctrl_c_outside_the_steps_in_one_line(tmp_path, monkeypatch, capsys):
    """A Ctrl-C while the model or the data loads (or during the last save, after a first Ctrl-C ended the steps)
    was a traceback of wherever it landed: now ``interrupted`` and status 130, as ``hf-blockbatch`` says it."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sft, "train", interrupted)
    with pytest.raises(SystemExit) as stop:
        sft.main(["--family", "llada", "--out", str(tmp_path / "out")])
    assert stop.value.code == 130 and capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize("refusal", ["full disk", "sandbox"])
def test_the_command_line_says_what_the_machine_refused_in_one_line(tmp_path, monkeypatch, capsys, refusal):
    """A full disk saving a checkpoint, or a code sandbox that stopped starting during an evaluation, ended ``sft`` in
    a traceback where ``hf-blockbatch`` says one ``error:`` line with status 1: now the same line and status."""
    import errno

    from hf_blockbatch.tasks.execution import SandboxStartError

    err = (OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "model.safetensors"))
           if refusal == "full disk" else SandboxStartError("could not start the sandbox: [Errno 11] no processes", 6))

    def refused(*args, **kwargs):
        raise err

    monkeypatch.setattr(sft, "train", refused)
    with pytest.raises(SystemExit) as stop:
        sft.main(["--family", "llada", "--out", str(tmp_path / "out")])
    assert stop.value.code == 1 and capsys.readouterr().err == f"error: {err}\n"


def test_a_sandbox_that_cannot_start_is_said_before_training_on_code(tmp_path, monkeypatch):
    """Under ``ulimit -n 10`` the held-out decodes of the code suite scored 0.0 where they score 0.5 (every program's
    child failed to start), and the best checkpoint was chosen on that. ``train`` now checks the sandbox first when
    it decodes a code suite, and says why in one line, before it writes anything."""
    import errno

    from hf_blockbatch.tasks import execution

    def no_child(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(execution.subprocess, "Popen", no_child)
    monkeypatch.setattr(execution, "_START_RETRY_DELAYS", ())  # a shortage that lasts: no waits for it to pass
    cfg = _tiny("llada", **{**_SMALL_RUN, "suites": {"code": 1.0}, "decode_items_per_suite": 2})
    with pytest.raises(sft.TrainingSettingsError, match=r"^the code sandbox cannot run a program here \(error: could "
                                                        r"not start the sandbox: \[Errno 24\] Too many open files\)"):  # fmt: skip
        train(cfg, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


def test_a_sigterm_during_the_steps_evaluates_and_saves_as_a_ctrl_c_does(tmp_path, monkeypatch, caplog):
    """A SIGTERM (``timeout``, a scheduler's stop) ended a run where it was: the steps since the last evaluation
    neither evaluated nor kept, no ``last`` weights, no ``done`` event. During the steps it now stops them as a
    Ctrl-C does; the process's own SIGTERM handler is back once they end."""
    import os
    import signal

    real_factor = sft._lr_factor

    def factor(progress, step, *a):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_factor(progress, step, *a)

    def unhandled(signum, frame):  # stands for the process's own handler (by default: the end of the process)
        raise RuntimeError("the SIGTERM reached the process's own handler")

    monkeypatch.setattr(sft, "_lr_factor", factor)
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        best = train(_tiny("llada", **_SMALL_RUN), tmp_path, show_progress=False)
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, before)
    assert "interrupted at step 3: evaluating and saving" in caplog.text
    assert best["step"] == 3 and _events(tmp_path)[-1] == {**_events(tmp_path)[-1], "event": "done", "step": 3}
    assert json.loads((tmp_path / "last" / "best_metrics.json").read_text())["step"] == 3
