"""Fast checks of the SFT training code (tiny configs, a few steps, CPU)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from hf_blockbatch.training.eval_quick import aligned_logits, greedy_decode
from hf_blockbatch.training.objective import apply_noise, sft_loss
from hf_blockbatch.training.sft import Example, TrainConfig, build_model, make_batch, train
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


def test_greedy_decode_fills_every_position(family_tok):
    family, tok = family_tok
    model = build_model(_tiny(family), tok).eval()
    out = greedy_decode(model, [[1, 10, 11], [1, 12]], gen_length=10, mask_id=2, pad_id=0, tokens_per_step=3)
    assert out.shape == (2, 10) and not bool((out == 2).any())


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
        ({"min_lr_ratio": 2.0}, "min_lr_ratio must be at most 1"),
        ({"gen_min": 100, "gen_max": 90}, r"gen_max \(90\) must be >= gen_min \(100\)"),
        ({"n_heads": 3}, r"d_model \(32\) must divide by n_heads \(3\) into an even head dim"),
        ({"n_kv_heads": 3}, "n_kv_heads must divide n_heads"),
        ({"suites": {}}, "suites is empty"),
        ({"suites": {"nosuch": 1.0}}, "suite 'nosuch' is unknown"),
        ({"suites": {"lists": 0.0}}, "suite 'lists' needs a weight > 0"),
        ({"init_from": "/nonexistent"}, "init_from '/nonexistent' is not a checkpoint folder"),
        ({"family": "gpt"}, "family must be 'llada' or 'dream'"),
    ],
)
def test_bad_settings_are_refused_before_training(tmp_path, options, message):
    """Each used to fail inside torch, divide by zero, or (steps=0, t_min=1.5) train nothing or
    something else than asked; the run now stops before writing anything, naming the option."""
    with pytest.raises(ValueError, match="Bad training settings: .*" + message):
        train(dataclasses.replace(_tiny("llada"), **options), tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


def test_settings_that_fit_no_data_are_refused(tmp_path):
    small = dict(suites={"lists": 1.0}, train_items_per_suite=16, num_threads=1)
    with pytest.raises(ValueError, match="No training item of lists fits gen_min=8 tokens"):
        train(_tiny("llada", gen_min=8, gen_max=16, **small), tmp_path, show_progress=False)
    with pytest.raises(ValueError, match="beyond the model's 16 positions: raise max_positions"):
        train(_tiny("llada", max_positions=16, **small), tmp_path, show_progress=False)
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
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["--family", "llada", "--out", "/nonexistent/out", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
