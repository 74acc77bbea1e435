"""The embedded tiny checkpoints load offline and answer fixed test items (greedy, deterministic).

The items are ones the shipped weights answer correctly with both Fast-dLLM (dual cache, block 32,
τ 0.9) and BlockBatch (defaults), read from the full-split benchmark in
``benchmarks/results/tiny/``; retraining a checkpoint means re-picking them from its new run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hf_blockbatch as hb
from hf_blockbatch.tasks import get_suite

CASES = {
    "tiny-llada": [("arith", 1), ("arith", 4), ("code", 0), ("code", 3), ("lists", 0), ("lists", 3)],
    "tiny-dream": [("arith", 1), ("arith", 4), ("code", 0), ("code", 3), ("lists", 3), ("lists", 7)],
}


def _weights(name: str) -> bool:
    path = hb.TINY_LLADA if name == "tiny-llada" else hb.TINY_DREAM
    return (Path(path) / "model.safetensors").exists()


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request):
    if not _weights(request.param):
        pytest.skip(f"{request.param} has no shipped weights in this checkout")
    model, tok = hb.load_model(request.param, device="cpu")
    return request.param, model, tok


def test_loads_offline_in_the_official_format(loaded):
    name, model, tok = loaded
    expected = hb.LLaDAModelLM if name == "tiny-llada" else hb.DreamModel
    assert isinstance(model, expected)
    assert model.config.mask_token_id == tok.convert_tokens_to_ids(tok.mask_token or "<|mdm_mask|>")
    assert sum(p.numel() for p in model.parameters()) < 5_000_000  # ≤ 20 MB in float32


@pytest.mark.parametrize("method", ["fast_dllm", "blockbatch"])
def test_fixed_items_decode_to_the_right_answers(loaded, method):
    name, model, tok = loaded
    if not CASES[name]:
        pytest.skip(f"no fixed items recorded for {name}")
    for suite_name, index in CASES[name]:
        suite = get_suite(suite_name)
        item = suite.items("test")[index]
        ids = tok(suite.prompt(item, tok), add_special_tokens=False, return_tensors="pt").input_ids
        gen = suite.default_gen_length
        cfg = hb.FastDLLMConfig(max_new_tokens=gen) if method == "fast_dllm" else hb.BlockBatchConfig(max_new_tokens=gen)
        first = model.generate(ids, generation_config=cfg)
        again = model.generate(ids, generation_config=cfg)
        assert torch.equal(first, again), "greedy decoding must be deterministic"
        text = tok.decode(first[0, ids.shape[1] :], skip_special_tokens=True)
        assert suite.score(item, text).correct, f"{name} {method} {item.id}: {text!r}"


def test_load_model_reads_torch_dtype_and_refuses_what_cannot_load() -> None:
    """transformers' older ``torch_dtype`` was passed on beside the default ``dtype``, which won: float16 asked, float32
    loaded. Float8 (floating point to torch, no dtype to compute in), no name and both names are refused."""
    model, _ = hb.load_model("tiny-llada", torch_dtype=torch.float16)
    assert model.dtype == torch.float16
    for kwargs, message in ((dict(dtype="float8_e4m3fn"), "is not a dtype a model loads in"),
                            (dict(dtype="float16", torch_dtype=torch.float16), "Pass dtype= only"),
                            (dict(name_or_path=None), "name_or_path must name a checkpoint"),
                            (dict(name_or_path=""), "name_or_path must name a checkpoint")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            hb.load_model(**{"name_or_path": "tiny-llada", **kwargs})


def test_a_refused_attention_backend_leaves_the_model_as_it_was() -> None:
    """The refused name stayed in the config: every later forward failed on it, and a save would have kept it."""
    from hf_blockbatch.attention.backends import BACKENDS, available_backends, get_backend

    model, _ = hb.load_model("tiny-llada")
    here = available_backends(model.device, model.dtype)
    for name in ("nosuch", *(n for n in BACKENDS if n not in here)):  # flash_varlen without flash-attn, ...
        with pytest.raises(ValueError):
            model.set_attention_backend(name)
    assert model.config.window_attention == "auto" and model(torch.tensor([[5, 6, 7]])).logits.shape[1] == 3

    with pytest.raises(ValueError, match="device='tpu' is not a device PyTorch knows"):
        get_backend("sdpa", "tpu", torch.float32)


def test_an_embedded_name_without_weights_says_so(monkeypatch, tmp_path) -> None:
    """An installation built without the tiny weights: the name resolves to an empty folder, which transformers
    would report as a missing config.json of a path the user never typed."""
    from hf_blockbatch import hub

    monkeypatch.setattr(hub, "_ALIASES", {"tiny-llada": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match="'tiny-llada' has no weights in .*Train it with `python -m hf_blockbatch.training.sft`"):
        hub.resolve_model_path("tiny-llada")


def test_load_model_refuses_a_device_this_torch_does_not_see(monkeypatch) -> None:
    """device='cuda' on a machine without one failed inside ``model.to`` ("Torch not compiled with CUDA enabled")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda' but this PyTorch sees no CUDA device: use device='cpu'"):
        hb.load_model("tiny-llada", device="cuda")


def test_load_model_refuses_a_device_kind_this_torch_has_no_backend_for() -> None:
    """A device torch names but this build has no backend for (``xpu``, ``hpu``): refused before loading."""
    for kind in ("xpu", "hpu"):
        with pytest.raises(ValueError) as err:
            hb.load_model("tiny-llada", device=kind)
        assert str(err.value) == f"device='{kind}' is not available in this PyTorch: use cpu, or cuda (cuda:0, ...)."


def test_load_model_takes_a_dtype_by_name() -> None:
    from hf_blockbatch.hub import checked_dtype

    assert checked_dtype("bfloat16") is checked_dtype("torch.bfloat16") is torch.bfloat16
    assert hb.load_model("tiny-llada", dtype="float64")[0].dtype == torch.float64


def test_a_hub_id_offline_loads_model_and_tokenizer_from_the_cache(monkeypatch) -> None:
    """A Hub id (one slash) with the Hub unreachable but cached: the model and the tokenizer are both loaded with
    ``local_files_only`` (else each retries the Hub for 23-28 s), and the tokenizer at the model's revision."""
    from hf_blockbatch import hub

    calls = {}
    monkeypatch.setattr(hub, "hub_unreachable", lambda: "offline (test)")
    monkeypatch.setattr(hub, "_cached_on_this_machine", lambda repo_id: repo_id == "some-org/some-model")

    def model_from_pretrained(path, dtype, kwargs):
        calls["model"] = kwargs
        return _TinyStub()

    class _Tokenizers:
        @staticmethod
        def from_pretrained(path, **kwargs):
            calls["tokenizer"] = (path, kwargs)
            return _TinyStub()

    monkeypatch.setattr(hub, "_from_pretrained_whole", model_from_pretrained)

    monkeypatch.setattr(hub, "AutoTokenizer", _Tokenizers)
    _, tok = hb.load_model("some-org/some-model", device="cpu", revision="v2")
    assert calls["model"] == {"local_files_only": True, "revision": "v2"}
    assert calls["tokenizer"] == ("some-org/some-model", {"local_files_only": True, "revision": "v2"})
    assert tok.padding_side == "left"
    with pytest.raises(FileNotFoundError, match="the Hub cannot be reached to look for it"):
        hb.load_model("other-org/other-model", device="cpu")


class _TinyStub:
    """Stands for a model and a tokenizer where only the calls are checked."""

    padding_side = "right"

    def to(self, device):
        return self

    def eval(self):
        return self


def test_load_model_pads_left_and_picks_the_dtype_of_the_device(tmp_path) -> None:
    """A checkpoint whose tokenizer pads right (as the official LLaDA and Dream ones save it) comes back padding left,
    where the decoders put the prompts' padding; ``device_map`` loads in float32 where no GPU is (bfloat16 on one)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "right-padded"
    shutil.copytree(hb.TINY_LLADA, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "right"}))
    assert AutoTokenizer.from_pretrained(folder).padding_side == "right"
    model, tok = hb.load_model(str(folder), device="cpu")
    assert tok.padding_side == "left" and model.dtype == torch.float32
    model, _ = hb.load_model(str(folder), device_map="cpu")
    assert model.dtype == (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
