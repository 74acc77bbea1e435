"""What a new user hit (issue 17): the streamer and the pipeline past the answer's end, a single
block size, Hub retries without a network, custom_generate on our classes, the README's example
prompt, ``--help``, and lm-eval as researchers call it (the bad inputs' messages are in
tests/test_bad_inputs.py, which checks docs/bad_inputs.md)."""

from __future__ import annotations

import functools
import json
import queue
import re
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import TextIteratorStreamer, TextStreamer

import hf_blockbatch as hb
from hf_blockbatch.generation.outputs import answer_lengths
from hf_blockbatch.generation.trace import Recorder
from hf_blockbatch.tasks import get_suite
from hf_blockbatch.tasks.contract import apply_chat

ROOT = Path(__file__).resolve().parents[1]
HAVE_WEIGHTS = (Path(hb.TINY_DREAM) / "model.safetensors").exists() and (Path(hb.TINY_LLADA) / "model.safetensors").exists()
needs_weights = pytest.mark.skipif(not HAVE_WEIGHTS, reason="the embedded checkpoints' weights are absent")


class _Collect(TextStreamer):
    """A TextStreamer that keeps the streamed answer instead of printing it."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text


@functools.lru_cache(maxsize=2)
def _load(name: str):
    return hb.load_model(name, device="cpu")


def _ids(tok, question: str) -> torch.Tensor:
    return tok(apply_chat(question, tok, True), add_special_tokens=False, return_tensors="pt").input_ids


# Fast-dLLM without early stop decodes the canvas past the end token: on this tiny-llada item (the
# CLI's default prompt) it writes ", so 2 * 2 = 12.\n#### 12" right after the end of turn (found by
# decoding the suites' first 20 items; most put EOS, where the stream stopped before, right after it).
PAST_THE_END = ("tiny-llada", "arith", 16)
# items decoded by the streamer test: that one, vanilla's on tiny-dream (arith 15), and plain ones
STREAM_ITEMS = (("arith", 16), ("arith", 15), ("arith", 1), ("lists", 0))


@needs_weights
def test_the_case_decodes_text_after_the_end_token():
    """The premise of the two tests below: text follows the end token in the canvas."""
    name, suite, index = PAST_THE_END
    model, tok = _load(name)
    ids = _ids(tok, get_suite(suite).items("test", index + 1)[index].question)
    new = model.generate(ids, generation_config=hb.FastDLLMConfig(max_new_tokens=64, block_length=32))[:, ids.shape[1] :]
    n = int(answer_lengths(new, hb.end_token_ids(tok, model.config))[0])
    assert n < 60 and tok.decode(new[0, n:], skip_special_tokens=True).strip()


@needs_weights
@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("cfg", [hb.FastDLLMConfig(max_new_tokens=64, block_length=32),
                                 hb.VanillaDiffusionConfig(max_new_tokens=64, steps=64, block_length=32),
                                 hb.BlockBatchConfig(max_new_tokens=64, block_sizes=[4, 8, 16, 32, 64])],
                         ids=lambda c: c.strategy)  # fmt: skip
def test_streamed_text_is_the_answer(name, cfg):
    """The streamer stops where answer_texts does (EOS or end of turn), on every strategy."""
    model, tok = _load(name)
    for suite, index in STREAM_ITEMS:
        for item in get_suite(suite).items("test", index + 1)[index:]:
            ids = _ids(tok, item.question)
            streamer = _Collect(tok)
            out = model.generate(ids, generation_config=cfg, streamer=streamer)
            answer = hb.answer_texts(tok, out[:, ids.shape[1] :], hb.end_token_ids(tok, model.config))[0]
            assert streamer.text == answer, (suite, item.id)


@needs_weights
def test_pipeline_returns_the_answer():
    """transformers' text-generation pipeline returns answer_texts' text, not the canvas past the end."""
    from transformers import pipeline

    name, suite, index = PAST_THE_END
    model, tok = _load(name)
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    cfg = hb.FastDLLMConfig(max_new_tokens=64, block_length=32)
    for item in get_suite(suite).items("test", index + 2)[index - 1 :]:
        chat = apply_chat(item.question, tok, True)
        ids = tok(chat, add_special_tokens=False, return_tensors="pt").input_ids
        answer = hb.answer_texts(tok, model.generate(ids, generation_config=cfg)[:, ids.shape[1] :],
                                 hb.end_token_ids(tok, model.config))[0]  # fmt: skip
        got = pipe(chat, generation_config=cfg, return_full_text=False, add_special_tokens=False)[0]["generated_text"]
        assert got == answer, item.id


@needs_weights
def test_pad_after_end_pads_like_transformers():
    """pad_after_end=True: every token after a row's first end token is the pad id (the end token
    and what precedes it unchanged), so batch_decode(..., skip_special_tokens=True) is the answer;
    off by default (the canvas as the official codes return it)."""
    name, suite, index = PAST_THE_END
    model, tok = _load(name)
    ids = _ids(tok, get_suite(suite).items("test", index + 1)[index].question)
    cfg = hb.FastDLLMConfig(max_new_tokens=64, block_length=32)
    raw = model.generate(ids, generation_config=cfg)[0, ids.shape[1] :]
    padded = model.generate(ids, generation_config=cfg, pad_after_end=True)[0, ids.shape[1] :]
    end_ids = hb.end_token_ids(tok, model.config)
    n = int(answer_lengths(raw[None], end_ids)[0])
    assert n < 63 and torch.equal(padded[: n + 1], raw[: n + 1])
    assert bool((padded[n + 1 :] == model.config.pad_token_id).all()) and not bool((raw[n + 1 :] == model.config.pad_token_id).all())
    assert tok.decode(padded, skip_special_tokens=True) == hb.answer_texts(tok, raw[None], end_ids)[0]


def _counting_forwards(model, monkeypatch) -> dict[str, int]:
    """Count the model's forwards (full and windowed) while the test runs."""
    calls = {"n": 0}

    def counting(forward):
        def counted(*a, **k):
            calls["n"] += 1
            return forward(*a, **k)

        return counted

    for name in ("forward", "forward_windows"):
        monkeypatch.setattr(model, name, counting(getattr(model, name)))
    return calls


@needs_weights
@pytest.mark.parametrize("order,first", [((2, 3, 0), True), ((0, 3, 1), False)], ids=["first", "last"])
def test_a_batch_streams_request_0_s_whole_answer_when_it_finishes(order, first, monkeypatch):
    """With batch > 1 the streamer gets request 0's answer, and all of it as soon as request 0 finishes: its last
    tokens waited for the whole batch to end once its rows had retired. end() still comes once, at the end of the call.
    Arith test items 0, 1, 2 and 3 end after 26, 13, 18 and 21 forwards (item 2's last tokens come in the step that
    ends it); item 3's prompt is the longest, so request 0 is left-padded."""
    model, tok = _load("tiny-llada")
    monkeypatch.setattr(tok, "padding_side", "left")
    items = get_suite("arith").items("test", 4)
    enc = tok([apply_chat(items[i].question, tok, True) for i in order], add_special_tokens=False, padding=True,
              return_tensors="pt")  # fmt: skip
    calls = _counting_forwards(model, monkeypatch)
    finished_at = []
    record = Recorder.finished

    def spy(self, state, ending):
        if 0 in ending.requests.tolist():
            finished_at.append(calls["n"])
        record(self, state, ending)

    monkeypatch.setattr(Recorder, "finished", spy)
    puts, ended = [], []

    class Streamer:
        def put(self, value: torch.Tensor) -> None:
            assert not ended, "put() after end()"
            puts.append((calls["n"], value.tolist()))

        def end(self) -> None:
            ended.append(calls["n"])

    cfg = hb.FastDLLMConfig(max_new_tokens=64, block_length=8, early_stop=True)
    out = model.generate(**enc, generation_config=cfg, streamer=Streamer(), return_dict_in_generate=True)
    nfe = out.nfe.tolist()
    assert (nfe[0] == min(nfe)) is first and (nfe[0] == max(nfe)) is not first  # the premise
    gs = enc.input_ids.shape[1]
    assert int(enc.attention_mask[0].sum()) < gs  # request 0 is padded
    assert puts[0][1] == enc.input_ids[0][enc.attention_mask[0].bool()].tolist()  # the prompt first
    n = int(answer_lengths(out.sequences[:1, gs:], hb.end_token_ids(tok, model.config))[0])
    assert [t for _, chunk in puts[1:] for t in chunk] == out.sequences[0, gs : gs + n].tolist()
    assert len(finished_at) == 1 and puts[-1][0] <= finished_at[0]  # no forward between request 0's end and its text
    assert (finished_at[0] < calls["n"]) is first
    assert ended == [calls["n"]]


@needs_weights
@pytest.mark.parametrize("fault", ["forward", "option"])
def test_a_generate_that_raises_ends_the_streamer(fault, monkeypatch):
    """generate() raising (a forward failing mid-run, an option refused before any forward) never called
    streamer.end(): a TextIteratorStreamer consumed in another thread, transformers' documented pattern, waited
    forever. Now end() comes once and the caller gets the decode's own error, unchanged (the streamer's timeout makes a
    regression fail here instead of hanging)."""
    model, tok = _load("tiny-llada")
    ids = _ids(tok, "What is 2 + 3?")
    failure = RuntimeError("the forward failed")
    options = {}
    if fault == "forward":
        real, calls = model.forward_windows, []

        def failing(*a, **k):  # after the prompt and some text were streamed
            calls.append(1)
            if len(calls) == 3:
                raise failure
            return real(*a, **k)

        monkeypatch.setattr(model, "forward_windows", failing)
    else:
        options["threshold"] = 2.0
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=10)
    ends = []
    end = streamer.end
    monkeypatch.setattr(streamer, "end", lambda: (ends.append(1), end())[1])
    raised = []

    def run() -> None:
        try:
            model.generate(ids, generation_config=hb.FastDLLMConfig(max_new_tokens=16, block_length=8), streamer=streamer,
                           **options)  # fmt: skip
        except Exception as err:  # noqa: BLE001 - the test reads it
            raised.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        text = "".join(streamer)
    except queue.Empty:
        pytest.fail("the consumer got no end() from a generate that raised")
    finally:
        thread.join()
    assert ends == [1] and len(raised) == 1
    if fault == "forward":
        assert raised[0] is failure
    else:
        assert isinstance(raised[0], ValueError) and "threshold" in str(raised[0]) and text == ""


def test_an_end_that_raises_does_not_hide_the_decode_s_error(tiny_llada, caplog):
    """When generate() fails and the streamer's own end() fails too, the caller gets generate()'s error; end()'s is
    logged."""

    class Broken:
        def put(self, value) -> None:
            pass

        def end(self) -> None:
            raise OSError("the pipe is closed")

    with pytest.raises(ValueError, match="threshold"):
        tiny_llada.generate(torch.tensor([[1, 2, 3]]), streamer=Broken(), threshold=2.0)
    assert "streamer.end() raised after generate() failed" in caplog.text


def test_a_single_block_size_is_one_branch(tmp_path):
    from hf_blockbatch.eval.runner import build_method_configs, parse_overrides

    for overrides in (parse_overrides(["blockbatch.block_sizes=8"]),
                      parse_overrides([], _json(tmp_path, {"blockbatch": {"block_sizes": 8}}))):  # fmt: skip
        cfg = build_method_configs(["blockbatch"], 32, overrides)["blockbatch"]
        assert cfg.block_sizes == [8]
    with pytest.raises(ValueError, match=r"^blockbatch: block_sizes must be a block size or a list"):
        build_method_configs(["blockbatch"], 32, parse_overrides([], _json(tmp_path, {"blockbatch": {"block_sizes": "x"}})))


def _json(tmp_path: Path, data) -> str:
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(data))
    return str(path)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_hub_fails_at_once(monkeypatch):
    """A name that is neither embedded nor a folder, with the Hub unreachable (a closed port here),
    fails in well under a second with the clear message, before any Hub request; so does a
    benchmark with no local data."""
    from huggingface_hub import constants

    from hf_blockbatch.eval.benchmarks import DataNotFoundError, get_benchmark
    from hf_blockbatch.hub import hub_unreachable

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    assert "cannot be reached" in hub_unreachable()
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=r"the Hub cannot be reached to look for it .* Did you mean 'tiny-dream'\?"):
        hb.load_model("tiny-drem")
    monkeypatch.setattr("hf_blockbatch.eval.benchmarks.find_data_file", lambda name: None)
    with pytest.raises(DataNotFoundError, match="the Hub cannot be reached"):
        get_benchmark("gsm8k").items("test", 1)
    assert time.perf_counter() - start < 2.0


def test_the_hub_probe_knocks_on_the_endpoint_s_port_unless_a_proxy_stands_between(monkeypatch):
    """An endpoint without a port is tried on its scheme's (a mirror over http: 80, not 443, which would call a
    reachable mirror unreachable); behind a proxy the direct connection says nothing, so the Hub may be reached."""
    from huggingface_hub import constants

    from hf_blockbatch import hub

    tried = []

    def connect(address, timeout):
        tried.append(address)
        raise OSError("refused (test)")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub.socket, "create_connection", connect)
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    for endpoint, address in (("http://mirror.example", ("mirror.example", 80)),
                              ("https://mirror.example", ("mirror.example", 443)),
                              ("http://mirror.example:8080", ("mirror.example", 8080))):  # fmt: skip
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        assert "cannot be reached" in hub.hub_unreachable() and tried[-1] == address
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert hub.hub_unreachable() is None and len(tried) == 3


def test_help_is_plain_text():
    from hf_blockbatch.cli import build_parser

    parser = build_parser()
    texts = [parser.format_help()] + [p.format_help() for p in parser._subparsers._group_actions[0].choices.values()]
    assert not any("``" in t for t in texts)


def test_the_help_s_install_hints_work_outside_a_clone():
    """`hf-blockbatch --help` told an installed package's user to run `pip install -e '.[lmeval]'`, which only
    works in a clone: the lm-eval hint names the package's extra, as the command's own error does."""
    from hf_blockbatch.cli import build_parser

    helps = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0]._choices_actions}
    assert not [name for name, text in helps.items() if "pip install -e" in text]
    assert "pip install 'hf-blockbatch[lmeval]'" in helps["lm-eval"]


def test_an_option_whose_help_offers_0_takes_it():
    """``demo --threads`` said "(0, the default: torch's choice)" while refusing 0 (must be >= 1)."""
    from hf_blockbatch.cli import build_parser

    for name, sub in build_parser()._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            if action.option_strings and "(0, " in (action.help or ""):
                assert action.type("0") == 0, (name, action.option_strings)


@needs_weights
def test_the_readme_example_runs_as_printed_and_every_decode_in_it_answers_right(monkeypatch):
    """The README's "Use" example runs as printed, its prompt is a test question of a suite, and every
    ``model.generate`` call in it (BlockBatch, the baselines, ``lean()``, the drafts) answers it right on the
    embedded tiny-llada by the suite's own scorer. The example itself is executed, so that a decoder added to it,
    or a config spelt differently there, is what gets checked (the test used to decode its own copy of five of
    the example's seven configs)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    code = re.search(r"^## Use\n\n```python\n(.*?)^```", readme, re.M | re.S).group(1)
    prompt = re.search(r'^prompt = "([^"]+)"', code, re.M).group(1)
    found = [(get_suite(s), it) for s in ("arith", "code", "lists") for it in get_suite(s).items("test") if it.question == prompt]
    assert found, "the README's prompt is not a suite question"
    task, item = found[0]
    calls = []
    generate = hb.LLaDAModelLM.generate

    def recording(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        calls.append((kwargs, out))
        return out

    monkeypatch.setattr(hb.LLaDAModelLM, "generate", recording)
    printed = []
    exec(compile(code, "README.md", "exec"), {"print": lambda *a: printed.append(a)})  # noqa: S102
    assert len(calls) == code.count("model.generate(") > 0
    (answers, nfe), = printed
    assert task.score(item, answers[0]).correct and int(nfe[0]) > 0, printed
    tok, config = _load("tiny-llada")[1], _load("tiny-llada")[0].config
    for kwargs, out in calls:
        sequences = out.sequences if hasattr(out, "sequences") else out
        text = hb.answer_texts(tok, sequences[:, kwargs["input_ids"].shape[1] :], hb.end_token_ids(tok, config))[0]
        assert task.score(item, text).correct, (kwargs["generation_config"], text)


@needs_weights
@pytest.mark.parametrize("card", ["tiny-llada", "tiny-dream"])
def test_a_tiny_model_card_s_example_is_a_suite_question_it_answers(card, monkeypatch):
    """Each tiny checkpoint's model card shows a Python example: it runs as printed, and its prompt is a suite's
    test question that the checkpoint answers right by the suite's scorer (tiny-dream's card asked a lists question
    its checkpoint got wrong)."""
    import ast

    text = (ROOT / "model_cards" / f"{card}.md").read_text(encoding="utf-8")
    code = re.search(r"^```python\n(.*?)^```", text, re.M | re.S).group(1)
    prompt = next(ast.literal_eval(node.values[node.keys.index(key)]) for node in ast.walk(ast.parse(code))
                  if isinstance(node, ast.Dict) for key in node.keys if isinstance(key, ast.Constant) and key.value == "content")  # fmt: skip
    found = [(get_suite(s), it) for s in ("arith", "code", "lists") for it in get_suite(s).items("test") if it.question == prompt]
    assert found, f"{card}'s example prompt is not a suite question"
    printed = []
    exec(compile(code, f"model_cards/{card}.md", "exec"), {"print": lambda *a: printed.append(a)})  # noqa: S102
    (answers, nfe), = printed
    task, item = found[0]
    assert task.score(item, answers[0]).correct, answers[0]
    assert int(nfe[0]) > 0


@needs_weights
def test_the_cli_default_prompt_is_answered_right_by_every_decoder(capsys):
    """``hf-blockbatch generate`` with no options (the README's first command) shows five right answers:
    the paper's baseline, BlockBatch, the early-stop baseline and its drafts (exact, and contained),
    with the ratios to both baselines."""
    from hf_blockbatch.cli import DEFAULT_PROMPT, main

    item = next(it for it in get_suite("arith").items("test") if it.question == DEFAULT_PROMPT)
    assert main(["generate", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    answers = re.findall(r"^── [^\n]*\n(.*?)\n   NFE", out, re.M | re.S)
    assert len(answers) == 5 and all(get_suite("arith").score(item, a).correct for a in answers), answers
    assert "drafts adopted" in out and "against Fast-dLLM + early stop" in out and "drafted(exact=False)" in out
    # the K/V rows each decoder keeps per request: one, one per branch, one per draft row and the main row
    assert [int(n) for n in re.findall(r"K/V rows (\d+)", out)] == [1, 6, 1, 4, 4]


# --------------------------------------------------------------------------------- custom_generate


def test_custom_generate_on_our_class(tiny_llada):
    """model.generate(ids, custom_generate=<repo>, trust_remote_code=True, generation_config=...) on
    our own class: transformers' meaning (the repo's custom_generate/generate.py runs, here this
    checkout's, which runs the same strategies); without trust_remote_code, transformers refuses."""
    ids = torch.tensor([[5, 6, 7, 8]])
    cfg = hb.BlockBatchConfig(max_new_tokens=16, block_sizes=[4, 8])
    ours = tiny_llada.generate(ids, generation_config=cfg, return_dict_in_generate=True)
    hub = tiny_llada.generate(ids, custom_generate=str(ROOT), trust_remote_code=True, generation_config=cfg,
                              return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(ours.sequences, hub.sequences) and torch.equal(ours.nfe, hub.nfe)
    plain = tiny_llada.generate(ids, trust_remote_code=True, generation_config=cfg)  # allows nothing more: dropped
    assert torch.equal(plain, ours.sequences)
    with pytest.raises(ValueError, match="trust_remote_code"):
        tiny_llada.generate(ids, custom_generate=str(ROOT), generation_config=cfg)


def test_a_checkpoint_custom_generate_folder_is_used_or_said_unused(tiny_llada, tmp_path, caplog):
    folder = tmp_path / "ckpt"
    tiny_llada.save_pretrained(folder)
    shutil.copytree(ROOT / "custom_generate", folder / "custom_generate")
    bound = hb.LLaDAModelLM.from_pretrained(folder, trust_remote_code=True)
    assert isinstance(bound.generate, functools.partial)  # the folder's generate, as transformers binds it
    ids = torch.tensor([[5, 6, 7, 8]])
    cfg = hb.FastDLLMConfig(max_new_tokens=8, block_length=4)
    assert torch.equal(bound.generate(ids, generation_config=cfg), tiny_llada.generate(ids, generation_config=cfg))
    with caplog.at_level("WARNING"):
        unbound = hb.LLaDAModelLM.from_pretrained(folder)
    assert not isinstance(unbound.generate, functools.partial)
    assert "custom_generate/generate.py, which is not used: pass trust_remote_code=True" in caplog.text


# --------------------------------------------------------------------------------------- lm-eval


class _Request:
    """What the harness hands generate_until: ``.args``, and the task and document it came from."""

    def __init__(self, context: str, gen_kwargs: dict, task: str, doc_id: int) -> None:
        self.args, self.task_name, self.doc_id = (context, gen_kwargs), task, doc_id


def _adapter(**kwargs):
    from conftest import make_tiny_llada
    from transformers import AutoTokenizer

    from hf_blockbatch.eval.lm_eval_model import HFBlockBatchLM

    tok = AutoTokenizer.from_pretrained(hb.TINY_LLADA)
    model = make_tiny_llada(vocab_size=len(tok), embedding_size=len(tok), max_sequence_length=128,
                            mask_token_id=tok.convert_tokens_to_ids("<|mdm_mask|>") if "<|mdm_mask|>" in tok.get_vocab()
                            else 2, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)  # fmt: skip
    return HFBlockBatchLM(pretrained=model, tokenizer=tok, **kwargs)


def test_lm_eval_long_prompt_is_cut_from_the_left_with_a_warning(caplog):
    """As lm-eval's hf model: a prompt longer than the context minus the generation length keeps
    its last tokens (the question), with a warning; a generation length alone over the context fails."""
    lm = _adapter(method="fast_dllm", block_length=8)
    kwargs = {"until": ["\n"], "max_gen_toks": 16, "do_sample": False}
    long = "word " * 300 + "Question: 1 + 2\nAnswer:"
    with caplog.at_level("WARNING"):
        out = lm.generate_until([_Request(long, kwargs, "t", 0), _Request("Question: 1 + 2\nAnswer:", kwargs, "t", 1)])
    assert len(out) == 2 and lm.truncated == 1 and "Left truncation applied: 1 prompt(s)" in caplog.text
    assert lm.get_model_info()["hf_blockbatch_truncated_prompts"] == 1  # what the harness writes beside the scores
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        lm.generate_until([_Request("hi", {**kwargs, "max_gen_toks": 200}, "t", 0)])


def test_lm_eval_reports_nfe_per_task_and_per_sample():
    from hf_blockbatch.eval.lm_eval_model import annotate_results

    lm = _adapter(method="blockbatch", block_sizes="4|8")
    kwargs = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    lm.generate_until([_Request("1 + 2 =", kwargs, "a", 0), _Request("3 + 4 =", kwargs, "a", 1),
                       _Request("5 + 6 =", {**kwargs, "max_gen_toks": 16}, "b", 0)])  # fmt: skip
    results = {"results": {"a": {"exact_match,none": 0.0}, "b": {"exact_match,none": 1.0}},
               "config": {"device": "cuda:0"},
               "samples": {"a": [{"doc_id": 0}, {"doc_id": 1}], "b": [{"doc_id": 0}]}}  # fmt: skip
    annotate_results(results, lm)
    nfe = {(r["task"], r["doc_id"]): r["nfe"] for r in lm.records}
    assert results["results"]["a"]["mean_nfe,none"] == (nfe[("a", 0)] + nfe[("a", 1)]) / 2
    assert results["results"]["b"]["mean_nfe,none"] == nfe[("b", 0)]
    assert results["samples"]["a"][1]["hf_blockbatch"][0]["nfe"] == nfe[("a", 1)]
    assert "winner_block_size" in results["samples"]["b"][0]["hf_blockbatch"][0]["stats"]
    assert results["config"]["device"] == "cpu" and results["config"]["hf_blockbatch_tasks"]["a"]["requests"] == 2


def test_lm_eval_data_parallel_results_count_every_process_s_requests(monkeypatch):
    """Under data parallelism each process decodes its share; process 0's results carry every process's NFE (its
    own share alone was 3 of 6 requests), and every process joins the gather, process 0 or not."""
    import accelerate.utils

    from hf_blockbatch.eval.lm_eval_model import annotate_results

    lm = _adapter(method="fast_dllm", block_length=8)
    kwargs = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    lm.generate_until([_Request("1 + 2 =", kwargs, "a", 0)])
    other = [{**r, "doc_id": 1, "nfe": r["nfe"] + 10} for r in lm.records]  # what the other process decoded
    calls = []

    def gather_object(objects):  # accelerate's: every process's list, concatenated in rank order
        calls.append(objects)
        return [*objects, (other, objects[0][1])]

    monkeypatch.setattr(accelerate.utils, "gather_object", gather_object)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert annotate_results(None, lm) is None and len(calls) == 1  # not process 0: joins, returns nothing
    monkeypatch.setenv("RANK", "0")
    results = {"results": {"a": {}}, "samples": {"a": [{"doc_id": 0}, {"doc_id": 1}]}}
    annotate_results(results, lm)
    own = lm.records[0]["nfe"]
    assert results["config"]["hf_blockbatch_tasks"]["a"]["requests"] == 2
    assert results["results"]["a"]["mean_nfe,none"] == own + 5
    assert [s["hf_blockbatch"][0]["nfe"] for s in results["samples"]["a"]] == [own, own + 10]



def test_lm_eval_data_parallel_hooks_gather_through_accelerate(monkeypatch):
    """The harness's hooks under several processes: ``all_gather`` hands accelerate a 1-element tensor for a scalar
    (its gather refuses 0-d tensors), ``gather_object`` a one-element list, ``barrier`` waits on accelerate's state;
    the adapter joins the process group when it is made, and a model named by string goes to the process's device."""
    import accelerate.utils

    from hf_blockbatch.eval import lm_eval_model

    seen: list = []
    monkeypatch.setattr(accelerate.utils, "gather", lambda t: seen.append(("gather", t.shape)) or t.repeat(2))
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda objs: seen.append(("objects", objs)) or objs * 2)

    class State:
        def wait_for_everyone(self) -> None:
            seen.append(("wait",))

    monkeypatch.setattr(lm_eval_model, "partial_state", lambda shard: seen.append(("join", shard.world_size)) or State())
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    lm = lm_eval_model.HFBlockBatchLM(pretrained="tiny-llada", method="fast_dllm", device=None)
    assert (lm.rank, lm.world_size) == (1, 2) and seen == [("join", 2)]
    assert str(lm._device) == ("cuda:1" if torch.cuda.is_available() else "cpu")
    assert lm.all_gather(torch.tensor(3.0)).tolist() == [3.0, 3.0] and seen[-1] == ("gather", torch.Size([1]))
    assert lm.gather_object({"a": 1}) == [{"a": 1}, {"a": 1}] and seen[-1] == ("objects", [{"a": 1}])
    lm.barrier()
    assert seen[-2:] == [("join", 2), ("wait",)]


def test_lm_eval_loads_a_named_model_with_a_device_map():
    from hf_blockbatch.eval.lm_eval_model import HFBlockBatchLM

    lm = HFBlockBatchLM(pretrained="tiny-llada", method="vanilla", device_map="cpu", dtype="float32")
    assert lm._name == "tiny-llada" and lm._device.type == "cpu" and lm.model.dtype == torch.float32
    t = torch.tensor(3.0)  # one process: the hooks hand back its own
    assert lm.all_gather(t) is t and lm.gather_object({"a": 1}) == [{"a": 1}] and lm.barrier() is None


def test_lm_eval_command_line_needs_the_harness_and_leaves_it_as_it_found_it(monkeypatch):
    """Without lm-evaluation-harness the command says what to install; with it, the results are annotated during the
    call and the package's ``simple_evaluate`` is what it was before (here: bound before the call)."""
    from hf_blockbatch.eval import lm_eval_model

    monkeypatch.setattr(lm_eval_model, "HAVE_LM_EVAL", False)
    with pytest.raises(SystemExit) as exit_:
        lm_eval_model.main([])
    assert str(exit_.value) == "lm-evaluation-harness is not installed: pip install 'hf-blockbatch[lmeval]'"
    monkeypatch.setattr(lm_eval_model, "HAVE_LM_EVAL", True)
    pytest.importorskip("lm_eval")
    import lm_eval
    import lm_eval.__main__
    import lm_eval.evaluator

    original = lm_eval.evaluator.simple_evaluate
    monkeypatch.setattr(lm_eval, "simple_evaluate", original, raising=False)
    monkeypatch.setattr(lm_eval.evaluator, "simple_evaluate", lambda *a, **k: {"results": {}})
    during = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: during.append(lm_eval.simple_evaluate()))
    monkeypatch.setattr("sys.argv", ["hf-blockbatch"])
    lm_eval_model.main(["--tasks", "x"])
    assert during == [{"results": {}}] and lm_eval.simple_evaluate is original
    assert sys.argv == ["hf-blockbatch", "--tasks", "x"]

def test_lm_eval_batches_only_requests_of_one_setting_up_to_the_batch_size():
    """Requests decode together only when they share the generation length and temperature, at most ``batch_size``
    at a time: each record says how many requests its batch held."""
    lm = _adapter(method="fast_dllm", block_length=8, batch_size=2)
    kwargs = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    lm.generate_until([_Request(f"{a} + {a} =", kwargs, "a", a) for a in range(3)]
                      + [_Request("9 + 9 =", {**kwargs, "max_gen_toks": 16}, "b", 0)])  # fmt: skip
    assert sorted((r["task"], r["stats"]["batch"]) for r in lm.records) == [("a", 1), ("a", 2), ("a", 2), ("b", 1)]


def test_lm_eval_generation_settings_come_from_model_args_then_the_task():
    """The canvas: ``gen_length`` of model_args, else the task's ``max_gen_toks``, else ``max_new_tokens``, else 256;
    the temperature is the task's unless it says ``do_sample: false`` (unset samples, as the harness's hf model)."""
    from hf_blockbatch.eval.lm_eval_model import DEFAULT_GEN_LENGTH

    lm = _adapter(method="fast_dllm", block_length=8)
    assert lm._settings_key({"max_gen_toks": 8, "max_new_tokens": 16}) == (8, 0.0)
    assert lm._settings_key({"max_new_tokens": 16}) == (16, 0.0)
    assert lm._settings_key({}) == (DEFAULT_GEN_LENGTH, 0.0)
    assert lm._settings_key({"max_gen_toks": 8, "temperature": 0.8}) == (8, 0.8)
    assert lm._settings_key({"max_gen_toks": 8, "temperature": 0.8, "do_sample": False}) == (8, 0.0)
    assert _adapter(method="fast_dllm", block_length=8, gen_length=24)._settings_key({"max_gen_toks": 8}) == (24, 0.0)


def test_lm_eval_counts_only_the_prompts_it_cut():
    """A batch with a prompt too long for the context cuts every row to the same width; a prompt that fitted
    exactly lost nothing and is not counted as truncated."""
    lm = _adapter(method="fast_dllm", block_length=8, batch_size=2)
    tok, kwargs = lm.tokenizer, {"until": ["\n"], "max_gen_toks": 16, "do_sample": False}
    keep = lm.model.config.context_length - 16
    fits = "a" * (keep - len(tok("").input_ids))
    long = "a" * (keep + 20)
    assert len(tok(fits).input_ids) == keep and len(tok(long).input_ids) > keep
    lm.generate_until([_Request(long, kwargs, "t", 0), _Request(fits, kwargs, "t", 1)])
    assert lm.truncated == 1


def test_lm_eval_a_stop_string_given_alone_is_one_stop():
    """The harness may give ``until`` as one string: it is one stop string, not a list of its characters."""
    lm = _adapter(method="fast_dllm", block_length=8)
    kwargs = {"max_gen_toks": 16, "do_sample": False}
    free = lm.generate_until([_Request("Question: 1 + 2\nAnswer:", {**kwargs, "until": []}, "t", 0)])[0]
    stop = free[len(free) // 2] + "\x00"  # its first character occurs in the answer, the whole never
    assert free and stop not in free
    assert lm.generate_until([_Request("Question: 1 + 2\nAnswer:", {**kwargs, "until": stop}, "t", 0)]) == [free]


def test_lm_eval_cuts_at_the_earliest_stop_string():
    from hf_blockbatch.eval.lm_eval_model import _cut

    assert _cut("a\nb Question: c", ["Question:", "\n"]) == "a"
    assert _cut("a Question: b\nc", ["\n", "Question:"]) == "a "
    assert _cut("abc", ["", "c"]) == "ab" and _cut("abc", ["x"]) == _cut("abc", []) == "abc"


def test_lm_eval_task_summaries():
    """Per task: requests, NFE mean / median / min / max, decoding seconds (a batch's seconds shared by its requests,
    which each report the whole batch's) and BlockBatch's winning block sizes."""
    from hf_blockbatch.eval.lm_eval_model import task_summaries

    records = [{"task": "a", "nfe": n, "stats": {"seconds": 2.0, "batch": 2, "winner_block_size": w}}
               for n, w in ((4, 8), (10, 8))] + [  # fmt: skip
        {"task": "a", "nfe": 7, "stats": {"seconds": 1.5, "batch": 1, "winner_block_size": 16}},
        {"task": "b", "nfe": 3, "stats": {"seconds": 0.5, "batch": 1}},
    ]
    s = task_summaries(records)
    assert s["a"] == {"requests": 3, "mean_nfe": 7.0, "median_nfe": 7, "min_nfe": 4, "max_nfe": 10, "seconds": 3.5,
                      "winner_block_sizes": {"8": 2, "16": 1}}  # fmt: skip
    assert s["b"]["seconds"] == 0.5 and s["b"]["winner_block_sizes"] == {}


def test_lm_eval_annotates_a_run_with_the_adapters_made_since_the_last():
    """Without ``lm``, annotate_results reads the adapters made since its last call, then forgets them: a second
    run's results do not count the first run's requests."""
    from hf_blockbatch.eval.lm_eval_model import annotate_results

    annotate_results(None)  # forget the adapters of earlier tests
    lm = _adapter(method="fast_dllm", block_length=8)
    lm.generate_until([_Request("1 + 2 =", {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}, "a", 0)])
    first = annotate_results({"results": {"a": {}}})
    assert first["config"]["hf_blockbatch_tasks"]["a"]["requests"] == 1 and first["results"]["a"]["mean_nfe,none"] > 0
    assert annotate_results({"results": {"a": {}}}) == {"results": {"a": {}}}


def test_lm_eval_an_adapter_annotated_by_name_is_not_read_again():
    """An adapter passed as ``lm`` stayed among the adapters "made since the last call": a notebook that annotated
    each of its runs with ``lm=`` kept every run's records for the process's life, and a later harness run annotated
    without ``lm`` counted them all as its own (4 requests, having decoded 1)."""
    from hf_blockbatch.eval import lm_eval_model

    kwargs = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    lm_eval_model.annotate_results(None)  # forget the adapters of earlier tests
    for _ in range(2):
        lm = _adapter(method="fast_dllm", block_length=8)
        lm.generate_until([_Request("1 + 2 =", kwargs, "a", 0)])
        own = lm_eval_model.annotate_results({"results": {"a": {}}}, lm)
        assert own["config"]["hf_blockbatch_tasks"]["a"]["requests"] == 1 and not lm_eval_model._RUNS
    harness = _adapter(method="fast_dllm", block_length=8)
    harness.generate_until([_Request("1 + 2 =", kwargs, "a", 0)])
    del harness  # the harness drops its adapter before returning the results
    assert lm_eval_model.annotate_results({"results": {"a": {}}})["config"]["hf_blockbatch_tasks"]["a"]["requests"] == 1


def test_hf_blockbatch_lm_eval_is_the_harness_cli(tmp_path, capsys, monkeypatch):
    """``hf-blockbatch lm-eval`` takes the harness's own arguments, ``--model hf_blockbatch`` works,
    and the printed table, the results JSON and every logged sample carry NFE; the device recorded
    is the one the model ran on (no cuda:0 on a CPU)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("datasets")
    from hf_blockbatch.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"q": f"{a} + {b}", "a": str(a + b)}) + "\n" for a, b in ((1, 2), (3, 4))))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "bb_cli_sum.yaml").write_text(
        "task: bb_cli_sum\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: generate_until\n"
        'doc_to_text: "Question: {{q}}\\nAnswer:"\ndoc_to_target: "{{a}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr("sys.argv", ["hf-blockbatch"])
    assert main(["lm-eval", "--model", "hf_blockbatch", "--model_args", "pretrained=tiny-llada,method=fast_dllm,block_length=8",
                 "--tasks", "bb_cli_sum", "--include_path", str(tmp_path / "tasks"), "--log_samples",
                 "--output_path", str(tmp_path / "out")]) == 0  # fmt: skip
    assert re.search(r"\|\s*mean_nfe\s*\|", capsys.readouterr().out)
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert results["results"]["bb_cli_sum"]["mean_nfe,none"] > 0 and results["config"]["device"] == "cpu"
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_*.jsonl")).read_text().splitlines()]
    assert len(samples) == 2 and all(s["hf_blockbatch"][0]["nfe"] > 0 for s in samples)
