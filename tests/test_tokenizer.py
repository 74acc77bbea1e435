"""The shipped tiny tokenizers: offline loading, fixed special ids, templates, lossless round trips."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoTokenizer

from hf_blockbatch.training.tokenizer import (
    BOS_ID,
    DEFAULT_VOCAB_SIZE,
    EOS_ID,
    EOT_ID,
    FAMILIES,
    MASK_ID,
    NUM_SPECIAL,
    PAD_ID,
    SPECIAL_TOKENS,
    asset_dir,
    special_token_ids,
    train_tokenizer,
    write_assets,
)

# the first GSM8K test question (note the typographic apostrophe)
GSM8K_Q = (
    "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
    "for her friends every day with four. She sells the remainder at the farmers' market daily for $2 per "
    "fresh duck egg. How much in dollars does she make every day at the farmers' market?"
)
TEXTS = [
    GSM8K_Q,
    "Tom has 17 apples.\nHe buys 4 more, so 17 + 4 = 21.\n#### 21",
    "```python\ndef tally_goals(xs):\n    return sum(1 for x in xs if x > 3)\n```",
    "naïve café – 東京 🚀 Ωmega\t tabs  and   spaces\r\n",
    "$\\frac{1}{2} + \\sqrt{3}$ = 1,234.50",
    "",
]


@pytest.fixture(params=FAMILIES, scope="module")
def family_tok(request):
    return request.param, AutoTokenizer.from_pretrained(str(asset_dir(request.param)), local_files_only=True)


def test_loads_offline_with_standard_files(family_tok, monkeypatch):
    family, tok = family_tok
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = AutoTokenizer.from_pretrained(str(asset_dir(family)))
    assert len(again) == len(tok) == DEFAULT_VOCAB_SIZE
    names = {p.name for p in asset_dir(family).iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    cfg = json.loads((asset_dir(family) / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    model_config = AutoConfig.from_pretrained(str(asset_dir(family)))
    assert again.model_max_length == model_config.context_length  # was 4096: truncation=True ran past the context


def test_special_token_ids(family_tok):
    family, tok = family_tok
    for i, name in enumerate(SPECIAL_TOKENS[family]):
        assert tok.convert_tokens_to_ids(name) == i
        assert tok(name, add_special_tokens=False)["input_ids"] == [i]  # never split
    assert special_token_ids(tok) == {
        "mask": MASK_ID,
        "eos": EOS_ID,
        "pad": PAD_ID,
        "bos": BOS_ID,
        "eot": EOT_ID,
    }
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, tok.mask_token_id) == (0, 0, 1, 2)
    mask = {"llada": "<|mdm_mask|>", "dream": "<|mask|>"}[family]
    assert tok.mask_token == mask
    # no token is added implicitly (LLaDA: the template carries the bos; Dream: no bos)
    assert tok("hi there")["input_ids"] == tok("hi there", add_special_tokens=False)["input_ids"]
    assert all(i >= NUM_SPECIAL for i in tok("hi there")["input_ids"])


def test_special_token_ids_read_the_pad_token_and_fall_back_to_eos(family_tok):
    """A tokenizer whose pad token is not its EOS reports its own pad id; one without a pad token pads with EOS."""
    family, _ = family_tok
    tok = AutoTokenizer.from_pretrained(str(asset_dir(family)))
    tok.pad_token = SPECIAL_TOKENS[family][-1]
    assert special_token_ids(tok)["pad"] == NUM_SPECIAL - 1 and special_token_ids(tok)["eos"] == EOS_ID
    tok.pad_token = None
    assert special_token_ids(tok)["pad"] == EOS_ID


def test_families_share_merges_and_ordinary_ids():
    specs = [json.loads((asset_dir(f) / "tokenizer.json").read_text()) for f in FAMILIES]
    assert specs[0]["model"]["merges"] == specs[1]["model"]["merges"]
    vocabs = [{v: k for k, v in s["model"]["vocab"].items()} for s in specs]
    assert all(vocabs[0][i] == vocabs[1][i] for i in range(NUM_SPECIAL, DEFAULT_VOCAB_SIZE))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(family_tok, text):
    _, tok = family_tok
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_digits_are_single_tokens(family_tok):
    _, tok = family_tok
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    digit = {d: enc(d) for d in "0123456789"}
    assert all(len(v) == 1 for v in digit.values())
    assert enc("9071") == [digit[d][0] for d in "9071"]
    # the space before a number belongs to the operator, so digits keep one token each
    ids = enc("3 + 4 = 17")
    assert [tok.decode([i]) for i in ids] == ["3", " + ", "4", " = ", "1", "7"]
    assert ids[4:] == [digit["1"][0], digit["7"][0]]
    assert len(enc(GSM8K_Q)) < 3 * len(GSM8K_Q.split())


def test_chat_templates(family_tok):
    family, tok = family_tok
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    got = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    want = {
        "llada": "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "dream": "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
    }[family]
    assert got == want
    ids = tok(got, add_special_tokens=False)["input_ids"]
    assert ids[0] == (BOS_ID if family == "llada" else 4)
    assert tok.decode(ids) == want
    # a multi-turn conversation ends each turn with the end-of-turn token
    turns = msgs + [{"role": "assistant", "content": "5"}]
    text = tok.apply_chat_template(turns, tokenize=False)
    assert tok(text, add_special_tokens=False)["input_ids"].count(EOT_ID) == 2


def test_training_is_deterministic():
    a = train_tokenizer(None, "dream", vocab_size=400, seed=3, per_suite=150)
    b = train_tokenizer(None, "dream", vocab_size=400, seed=3, per_suite=150)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) == 400


def test_a_trained_tokenizer_reloads_with_its_roles(tmp_path):
    """What ``train_tokenizer`` returns, and what it saves once reloaded (by the portable class name), has each role at
    its fixed id (the slow byte-for-byte test covers the shipped assets only)."""
    trained = train_tokenizer(tmp_path, "llada", vocab_size=400, per_suite=150)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    for tok in (trained, AutoTokenizer.from_pretrained(str(tmp_path))):
        assert tok.mask_token == "<|mdm_mask|>" and tok.eos_token == tok.pad_token == "<|endoftext|>"
        assert (tok.mask_token_id, tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (MASK_ID, EOS_ID, PAD_ID, BOS_ID)
        assert special_token_ids(tok) == {"mask": MASK_ID, "eos": EOS_ID, "pad": PAD_ID, "bos": BOS_ID, "eot": EOT_ID}


@pytest.mark.slow
def test_assets_are_reproducible(tmp_path, monkeypatch):
    """Retraining with the defaults rewrites the shipped tokenizers byte for byte."""
    import hf_blockbatch.training.tokenizer as tk

    shipped = {f: asset_dir(f) for f in FAMILIES}
    monkeypatch.setattr(tk, "ASSETS_DIR", tmp_path)
    write_assets()
    for family in FAMILIES:
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
        ):
            assert (tmp_path / f"tiny-{family}" / name).read_bytes() == (shipped[family] / name).read_bytes()


def test_an_unknown_family_is_refused_before_any_training_or_path():
    from hf_blockbatch.training.tokenizer import train_tokenizer

    for call in (lambda: asset_dir("gpt"), lambda: train_tokenizer(None, "gpt")):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == f"family must be one of {FAMILIES}, got 'gpt'"


@pytest.mark.parametrize("size, message", [
    (100, f"vocab_size must be at least {256 + NUM_SPECIAL} (the 256 byte symbols and the {NUM_SPECIAL} special tokens "
          f"are always in the vocabulary), got 100."),
    (-5, "vocab_size must be a positive integer, got -5."),
    (400.0, "vocab_size must be a positive integer, got 400.0."),
])  # fmt: skip
def test_a_vocabulary_size_the_tokenizer_cannot_have_is_refused(size, message):
    """``vocab_size=100`` gave a tokenizer of 264 tokens (the byte symbols and the specials are always in) without a
    word, and the CLI then printed "wrote llada tokenizer (264 tokens)"; -5 was an OverflowError from the trainer."""
    with pytest.raises(ValueError) as err:
        train_tokenizer(None, "llada", vocab_size=size, per_suite=150)
    assert str(err.value) == message


def test_the_command_line_trains_one_family_or_rewrites_the_assets(tmp_path, monkeypatch, capsys):
    import functools

    import hf_blockbatch.training.tokenizer as tk

    monkeypatch.setattr(tk, "train_tokenizer", functools.partial(train_tokenizer, per_suite=150))
    tk.main(["--out", str(tmp_path / "tok"), "--family", "dream", "--vocab-size", "400", "--seed", "2"])
    assert capsys.readouterr().out == f"wrote dream tokenizer (400 tokens) to {tmp_path / 'tok'}\n"
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert len(tok) == 400 and tok.mask_token == SPECIAL_TOKENS["dream"][MASK_ID]
    with pytest.raises(SystemExit) as exit_:
        tk.main(["--family", "dream"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith("error: --out and --family are required (or use --assets)\n")
    # --assets rewrites both families' folders (here under tmp_path, with a small corpus)
    monkeypatch.setattr(tk, "ASSETS_DIR", tmp_path / "assets")
    monkeypatch.setattr(tk, "DEFAULT_PER_SUITE", 150)
    tk.main(["--assets", "--vocab-size", "400"])
    assert capsys.readouterr().out == "".join(f"wrote {tmp_path / 'assets' / f'tiny-{f}'}\n" for f in FAMILIES)
    for family in FAMILIES:
        assert len(AutoTokenizer.from_pretrained(str(tmp_path / "assets" / f"tiny-{family}"))) == 400


@pytest.mark.filterwarnings("ignore:'hf_blockbatch.training.tokenizer' found in sys.modules:RuntimeWarning")
def test_the_command_line_says_a_bad_vocabulary_size_in_one_line(tmp_path, monkeypatch, capsys):
    """``python -m hf_blockbatch.training.tokenizer`` (run here in-process) says bad input as ``error: ...``, status
    2, instead of a traceback."""
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", ["tokenizer", "--out", str(tmp_path), "--family", "llada", "--vocab-size", "100"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("hf_blockbatch.training.tokenizer", run_name="__main__")
    assert exit_.value.code == 2 and capsys.readouterr().err == (
        f"error: vocab_size must be at least {256 + NUM_SPECIAL} (the 256 byte symbols and the {NUM_SPECIAL} special "
        "tokens are always in the vocabulary), got 100.\n"
    )
    assert not any(tmp_path.iterdir())
