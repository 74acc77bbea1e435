"""The bad inputs of docs/bad_inputs.md, each as a function returning the one-line message it gets.

tests/test_bad_inputs.py checks every row of that table against these, so the table stays true.
Each function raises nothing: it returns the message (an exception's text, or the CLI's last
stderr line), or fails if the input is accepted.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import hf_blockbatch as hb

CASES: dict[str, Callable[..., str]] = {}


def case(name: str):
    def register(fn):
        CASES[name] = fn
        return fn

    return register


def _message(fn: Callable[[], object], *types: type[BaseException]) -> str:
    expected = types or (ValueError, TypeError, FileNotFoundError)
    try:
        fn()
    except expected as err:
        return str(err)
    raise AssertionError("the bad input was accepted")


def _generate(**options) -> str:
    from conftest import make_tiny_llada

    model = make_tiny_llada()
    ids = options.pop("input_ids", torch.tensor([[5, 6, 7]]))
    mask = options.pop("attention_mask", None)
    return _message(lambda: model.generate(ids, mask, **options))


def _cli(argv: list[str], capsys) -> str:
    from hf_blockbatch.cli import main

    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse
        rc = exit_.code
    assert rc == 2, f"exit status {rc}"
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1].split("error: ", 1)[1]


# ------------------------------------------------------------------------ generate() and configs


@case("temperature-nan")
def _(**_):
    return _generate(generation_config=hb.FastDLLMConfig(max_new_tokens=8, block_length=4), temperature=float("nan"))


@case("temperature-inf")
def _(**_):
    return _generate(generation_config=hb.BlockBatchConfig(max_new_tokens=8, block_sizes=[4, 8]), temperature=float("inf"))


@case("temperature-negative")
def _(**_):
    return _generate(temperature=-1.0, max_new_tokens=8)


@case("seed-not-integer")
def _(**_):
    return _message(lambda: hb.FastDLLMConfig(max_new_tokens=8, block_length=4, seed="7"))


@case("seed-and-generator")
def _(**_):
    return _generate(seed=7, temperature=0.7, max_new_tokens=8, generator=torch.Generator())


@case("threshold-string")
def _(**_):
    return _message(lambda: hb.FastDLLMConfig(threshold="high").validate())


@case("threshold-range")
def _(**_):
    return _message(lambda: hb.BlockBatchConfig(threshold=1.5).validate())


@case("factor-inf")
def _(**_):
    return _message(lambda: hb.FastDLLMConfig(factor=float("inf")).validate())


@case("merge-threshold-nan")
def _(**_):
    return _message(lambda: hb.BlockBatchConfig(merge_threshold=float("nan")).validate())


@case("divergence-threshold-inf")
def _(**_):
    return _message(lambda: hb.BlockBatchConfig(refresh="divergence", divergence_threshold=float("inf")).validate())


@case("block-sizes-string")
def _(**_):
    return _message(lambda: hb.BlockBatchConfig(block_sizes="8").validate())


@case("block-sizes-repeat")
def _(**_):
    return _message(lambda: hb.BlockBatchConfig(block_sizes=[4, 4]).validate())


@case("block-size-zero")
def _(**_):
    return _message(lambda: hb.BlockBatchConfig(block_sizes=[4, 0]).validate())


@case("merge-string")
def _(**_):
    return _message(lambda: hb.BlockBatchConfig(merge="false").validate())


@case("vanilla-steps-zero")
def _(**_):
    return _message(lambda: hb.VanillaDiffusionConfig(max_new_tokens=8, steps=0).validate())


@case("numpy-seed")
def _(**_):
    import numpy as np

    return _message(lambda: hb.FastDLLMConfig(max_new_tokens=8, block_length=4, seed=np.int64(3)))


@case("numpy-integer")
def _(**_):
    import numpy as np

    return _message(lambda: hb.FastDLLMConfig(max_new_tokens=np.int64(64), block_length=32))


@case("misspelt-option")
def _(**_):
    return _generate(block_size=32)


@case("top-p")
def _(**_):
    return _generate(top_p=0.9)


@case("token-id-too-large")
def _(**_):
    return _generate(input_ids=torch.tensor([[5, 6, 5000]]), max_new_tokens=8)


@case("mask-id-outside-vocabulary")
def _(**_):
    return _generate(mask_token_id=5000)


@case("mask-id-is-eos-id")
def _(**_):
    return _generate(mask_token_id=94, max_new_tokens=8)  # the tiny model's EOS (and padding) id


@case("pad-id-is-mask-id")
def _(**_):
    return _generate(generation_config=hb.FastDLLMConfig(max_new_tokens=8, block_length=4), pad_token_id=95)


@case("token-id-not-integer")
def _(**_):
    return _generate(mask_token_id=1.5)


@case("strategy-keyword")
def _(**_):
    return _generate(generation_config=hb.FastDLLMConfig(max_new_tokens=8), strategy="blockbatch")


@case("generator-not-a-generator")
def _(**_):
    return _generate(generator=5)


@case("step-inputs-replaced")
def _(**_):
    from conftest import make_tiny_llada

    model = make_tiny_llada()
    model.prepare_inputs_for_generation = lambda *args, **kwargs: {}  # as PEFT's prompt tuning does around generate
    return _message(lambda: model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8), NotImplementedError)


@case("empty-prompt-tensor")
def _(**_):
    return _generate(input_ids=torch.zeros((1, 0), dtype=torch.long), max_new_tokens=8)


@case("right-padding")
def _(**_):
    return _generate(input_ids=torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[1, 1, 0]]), max_new_tokens=8)


@case("attention-mask-not-binary")
def _(**_):
    return _generate(input_ids=torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[0.5, 1.0, 1.0]]), max_new_tokens=8)


@case("return-dict-string")
def _(**_):
    return _generate(return_dict_in_generate="no", max_new_tokens=8)


@case("prompt-longer-than-context")
def _(**_):
    return _generate(input_ids=torch.full((1, 250), 5), max_new_tokens=16)


@case("custom-generate-callable")
def _(**_):
    return _generate(custom_generate=print, max_new_tokens=8)


@case("kv-cache-out-of-memory")
def _(monkeypatch, **_):
    from conftest import make_tiny_llada

    from hf_blockbatch import cache

    def refuse(self, numel, dtype):  # what the allocator says when the batch's K/V do not fit in memory
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes.")

    monkeypatch.setattr(cache._StoragePool, "take", refuse)
    model, cfg = make_tiny_llada(), hb.FastDLLMConfig.drafted(max_new_tokens=16)
    return _message(lambda: model.generate(torch.tensor([[5, 6, 7]] * 3), generation_config=cfg), RuntimeError)


@case("forward-out-of-memory")
def _(monkeypatch, **_):
    from conftest import make_tiny_llada

    model, cfg = make_tiny_llada(), hb.FastDLLMConfig.drafted(max_new_tokens=16)

    def refuse(*args, **kwargs):  # the cache fitted, the first sparse step's forward beside it does not
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes.")

    monkeypatch.setattr(model, "forward_positions", refuse)
    return _message(lambda: model.generate(torch.tensor([[5, 6, 7]] * 3), generation_config=cfg), RuntimeError)


@case("llada-official-options")
def _(**_):
    return _generate(gen_length=32, steps=32, block_length=8)


@case("inputs-embeds")
def _(**_):
    from conftest import make_tiny_llada

    return _message(lambda: make_tiny_llada().generate(inputs_embeds=torch.zeros(1, 3, 64)))


@case("stopping-criteria")
def _(**_):
    return _generate(stopping_criteria=[lambda *a: True])


@case("do-sample-string")
def _(**_):
    return _generate(do_sample="no")


@case("input-ids-not-long")
def _(**_):
    return _generate(input_ids=torch.tensor([[5, 6, 7]], dtype=torch.int32), max_new_tokens=8)


@case("input-ids-missing")
def _(**_):
    return _generate(input_ids=None, max_new_tokens=8)


@case("attention-mask-shape")
def _(**_):
    return _generate(attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=8)


@case("attention-mask-list")
def _(**_):
    return _generate(attention_mask=[[1, 1, 1]], max_new_tokens=8)


@case("mask-id-list")
def _(**_):
    return _generate(mask_token_id=[95, 93], max_new_tokens=8)


@case("no-eos-id")
def _(**_):
    from conftest import make_tiny_llada

    model = make_tiny_llada()
    model.config.eos_token_id = None
    cfg = hb.BlockBatchConfig(max_new_tokens=8)
    return _message(lambda: model.generate(torch.tensor([[5, 6, 7]]), generation_config=cfg))


@case("remasking-unknown")
def _(**_):
    return _message(lambda: hb.VanillaDiffusionConfig(remasking="confidence"))


@case("vanilla-steps-over-block")
def _(**_):
    return _message(lambda: hb.VanillaDiffusionConfig(max_new_tokens=8, steps=16, block_length=4))


@case("fast-dllm-steps-not-multiple")
def _(**_):
    return _message(lambda: hb.FastDLLMConfig(max_new_tokens=8, block_length=4, threshold=None, steps=3))


@case("fast-dllm-steps-over-block")
def _(**_):
    return _message(lambda: hb.FastDLLMConfig(max_new_tokens=32, block_length=8, threshold=None, steps=64))


@case("steps-over-short-answer")
def _(**_):
    return _message(lambda: hb.FastDLLMConfig(max_new_tokens=8, threshold=None, steps=32))


@case("blockbatch-no-rule")
def _(**_):
    return _message(lambda: hb.BlockBatchConfig(threshold=None))


@case("sync-threshold-negative")
def _(**_):
    return _message(lambda: hb.BlockBatchConfig(sync_threshold=-1))


@case("refresh-unknown")
def _(**_):
    return _message(lambda: hb.BlockBatchConfig(refresh="never"))


def _nan_logits_from(k: int) -> str:
    """generate() on a tiny LLaDA whose logits are NaN from its ``k``-th forward on (a float16 overflow, a bad
    checkpoint, a hook)."""
    from conftest import make_tiny_llada

    model, calls = make_tiny_llada(), [0]

    def hook(module, args, out):
        calls[0] += 1
        return out.fill_(float("nan")) if calls[0] >= k else out

    model.model.transformer.ff_out.register_forward_hook(hook)
    config = hb.FastDLLMConfig(max_new_tokens=8, block_length=4)
    return _message(lambda: model.generate(torch.tensor([[5, 6, 7]]), generation_config=config))


@case("logits-nan")
def _(**_):
    return _nan_logits_from(1)


@case("logits-nan-later")
def _(**_):
    return _nan_logits_from(2)


# ---------------------------------------------------------------------------- the model itself


@case("forward-float-ids")
def _(**_):
    from conftest import make_tiny_llada

    return _message(lambda: make_tiny_llada()(torch.tensor([[5.0, 6.0, 7.0]])))


@case("forward-ids-and-embeds")
def _(**_):
    from conftest import make_tiny_llada

    model = make_tiny_llada()
    embeds = model.get_input_embeddings()(torch.tensor([[5, 6, 7]]))
    return _message(lambda: model(input_ids=torch.tensor([[5, 6, 7]]), inputs_embeds=embeds))


@case("forward-logits-mask-integer")
def _(**_):
    from conftest import make_tiny_llada

    return _message(lambda: make_tiny_llada()(torch.tensor([[5, 6, 7]]), logits_mask=torch.tensor([[0, 0, 1]])))


@case("attention-backend-unknown")
def _(**_):
    from conftest import make_tiny_llada

    return _message(lambda: make_tiny_llada().set_attention_backend("flash"))


@case("layers-duplicated-not-renumbered")
def _(**_):
    import copy

    from conftest import make_tiny_llada

    model = make_tiny_llada()
    blocks = model.model.transformer.blocks
    model.model.transformer.blocks = torch.nn.ModuleList([*blocks, copy.deepcopy(blocks[1])])
    model.config.n_layers = 3
    return _message(lambda: model.generate(torch.tensor([[5, 6, 7]]), generation_config=hb.FastDLLMConfig(
        max_new_tokens=8, block_length=8, mask_token_id=95)))  # fmt: skip


@case("tied-head-quantized-embedding")
def _(**_):
    from conftest import make_tiny_llada

    with warnings.catch_warnings():  # torch deprecates torch.ao.quantization (for torchao); users still call it
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)
        model = torch.ao.quantization.quantize_dynamic(
            make_tiny_llada(weight_tying=True),
            {torch.nn.Embedding: torch.ao.quantization.float_qparams_weight_only_qconfig,
             torch.nn.Linear: torch.ao.quantization.default_dynamic_qconfig},
        )  # fmt: skip
    return _message(lambda: model(torch.tensor([[5, 6, 7]])))


@case("attention-backend-not-a-string")
def _(**_):
    from conftest import make_tiny_llada

    return _message(lambda: make_tiny_llada().set_attention_backend(["sdpa"]))


@case("dropout-out-of-range")
def _(**_):
    from conftest import make_tiny_llada

    return _message(lambda: make_tiny_llada(residual_dropout=1.5))


@case("decode-training-mode-attention-dropout")
def _(**_):
    from conftest import make_tiny_llada

    model = make_tiny_llada(attention_dropout=0.1).train()
    config = hb.FastDLLMConfig(max_new_tokens=8, block_length=8)
    return _message(lambda: model.generate(torch.tensor([[5, 6, 7]]), generation_config=config))


@case("forward-cache-other-dtype")
def _(**_):
    from conftest import make_tiny_llada

    model = make_tiny_llada()
    cache = hb.BranchCache.for_model(model.config, 1, 3, dtype=torch.float64)
    return _message(lambda: model(torch.tensor([[5, 6, 7]]), cache=cache))


# ---------------------------------------------------------------------------------- load_model


# ---------------------------------------------------------------------------------- load_model


@case("model-typo-offline")
def _(monkeypatch, **_):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return _message(lambda: hb.load_model("tiny-lada"))


@case("model-missing-folder")
def _(**_):
    return _message(lambda: hb.load_model("./no-such-model"))


@case("truncated-safetensors")
def _(tmp_path, **_):
    folder = tmp_path / "damaged"
    shutil.copytree(hb.TINY_LLADA, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return _message(lambda: hb.load_model(str(folder)))


@case("folder-without-tokenizer")
def _(tmp_path, **_):
    folder = tmp_path / "weights-only"  # what model.save_pretrained(folder) alone writes
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(Path(hb.TINY_LLADA) / name, folder / name)
    return _message(lambda: hb.load_model(str(folder)))


@case("model-is-a-file")
def _(**_):
    return _message(lambda: hb.load_model(str(Path(hb.TINY_LLADA) / "config.json")), NotADirectoryError)


@case("folder-without-weights")
def _(tmp_path, **_):
    folder = tmp_path / "no-weights"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(hb.TINY_LLADA) / name, folder / name)
    return _message(lambda: hb.load_model(str(folder)))


@case("model-other-family")
def _(tmp_path, **_):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "llama"  # a tiny Llama checkpoint with a tokenizer: an autoregressive model, not ours
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(hb.TINY_LLADA) / name, folder / name)
    return _message(lambda: hb.load_model(str(folder), device="cpu"))


@case("dtype-float8")
def _(**_):
    return _message(lambda: hb.load_model("tiny-llada", torch_dtype=torch.float8_e4m3fn))


def _edited_weights(tmp_path: Path, edit: Callable[[dict], None]) -> str:
    """A copy of the embedded tiny-llada whose model.safetensors ``edit`` changed."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "edited-weights"
    shutil.copytree(hb.TINY_LLADA, folder)
    weights = load_file(str(folder / "model.safetensors"))
    edit(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


@case("weights-missing-tensor")
def _(tmp_path, **_):
    folder = _edited_weights(tmp_path, lambda w: w.pop("model.transformer.blocks.0.ff_out.weight"))
    return _message(lambda: hb.load_model(folder, device="cpu"))


@case("weights-wrong-shape")
def _(tmp_path, **_):
    def cut(w: dict) -> None:
        w["model.transformer.blocks.0.ff_out.weight"] = w["model.transformer.blocks.0.ff_out.weight"][:-1].clone()

    folder = _edited_weights(tmp_path, cut)
    return _message(lambda: hb.load_model(folder, device="cpu"))


@case("device-tpu")
def _(**_):
    return _message(lambda: hb.load_model("tiny-llada", device="tpu"))


@case("device-meta")
def _(**_):
    return _message(lambda: hb.load_model("tiny-llada", device="meta"))


@case("dtype-fp8")
def _(**_):
    return _message(lambda: hb.load_model("tiny-llada", dtype="fp8"))


# ---------------------------------------------------------------------------------------- CLI


@case("cli-empty-prompt")
def _(capsys, **_):
    return _cli(["generate", "--prompt", "  "], capsys)


@case("cli-threshold-nan")
def _(capsys, **_):
    return _cli(["generate", "--threshold", "nan"], capsys)


@case("cli-threshold-string")
def _(capsys, **_):
    return _cli(["generate", "--threshold", "high"], capsys)


@case("bench-sweep-blocks-not-integers")
def _(capsys, **_):
    return _cli(["bench", "--sweep-blocks", "16,x"], capsys)


@case("cli-threshold-range")
def _(capsys, monkeypatch, **_):
    import hf_blockbatch.hub as hub

    def no_load(*_a, **_k):
        raise AssertionError("the model was loaded before --threshold was checked")

    monkeypatch.setattr(hub, "load_model", no_load)
    return _cli(["generate", "--threshold", "1.5"], capsys)


@case("cli-demo-port")
def _(capsys, **_):
    return _cli(["demo", "--port", "99999"], capsys)


@case("cli-demo-max-new-tokens")
def _(capsys, **_):
    return _cli(["demo", "--max-new-tokens", "5"], capsys)


@case("cli-device-tpu")
def _(capsys, **_):
    return _cli(["generate", "--device", "tpu"], capsys)


@case("bench-set-wrong-type")
def _(capsys, **_):
    return _cli(["bench", "--set", "blockbatch.threshold=high"], capsys)


@case("bench-configs-wrong-type")
def _(capsys, tmp_path, **_):
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"blockbatch": {"threshold": "high"}}))
    return _cli(["bench", "--configs", str(path)], capsys)


@case("bench-configs-not-an-object")
def _(capsys, tmp_path, **_):
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"blockbatch": 1}))
    return _cli(["bench", "--configs", str(path)], capsys)


@case("bench-configs-invalid-json")
def _(capsys, tmp_path, **_):
    path = tmp_path / "configs.json"
    path.write_text("{blockbatch: 1}")
    return _cli(["bench", "--configs", str(path)], capsys)


def _bench_on_gsm8k_rows(second_row: str, capsys, tmp_path) -> str:
    """``hf-blockbatch bench --task gsm8k --data`` on a file of a good row and ``second_row``."""
    path = tmp_path / "gsm8k.jsonl"
    path.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n' + second_row + "\n")
    return _cli(["bench", "--task", "gsm8k", "--data", f"gsm8k={path}", "--limit", "1", "--no-progress", "--no-plots",
                 "--output-dir", str(tmp_path / "out"), "--device", "cpu"], capsys)  # fmt: skip


@case("bench-data-invalid-json")
def _(capsys, tmp_path, **_):
    return _bench_on_gsm8k_rows("not json", capsys, tmp_path)


@case("bench-reference-on-dream")
def _(capsys, tmp_path, **_):
    return _cli(["bench", "--model", "tiny-dream", "--task", "arith", "--methods", "fast_dllm", "blockbatch_reference",
                 "--limit", "1", "--no-progress", "--no-plots", "--output-dir", str(tmp_path / "out"), "--device", "cpu"],
                capsys)  # fmt: skip


@case("bench-folder-in-the-way")
def _(capsys, tmp_path, **_):
    (tmp_path / "out" / "summary.md").mkdir(parents=True)
    return _cli(["bench", "--task", "arith", "--methods", "fast_dllm", "--limit", "1", "--no-progress", "--no-plots",
                 "--output-dir", str(tmp_path / "out"), "--device", "cpu"], capsys)  # fmt: skip


@case("bench-output-not-writable")
def _(capsys, tmp_path, monkeypatch, **_):
    import os

    real = os.access  # a read-only file system, as os.access reports it (root ignores permissions)
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == tmp_path and mode & os.W_OK
                        else real(path, mode))  # fmt: skip
    return _cli(["bench", "--task", "arith", "--methods", "fast_dllm", "--limit", "1", "--no-progress", "--no-plots",
                 "--output-dir", str(tmp_path / "out"), "--device", "cpu"], capsys)  # fmt: skip


@case("bench-code-sandbox-cannot-start")
def _(capsys, tmp_path, monkeypatch, **_):
    import errno

    from hf_blockbatch.tasks import execution

    def no_child(*args, **kwargs):  # what ulimit -n 10 gives the sandbox's Popen
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(execution.subprocess, "Popen", no_child)
    monkeypatch.setattr(execution, "_START_RETRY_DELAYS", ())  # a shortage that lasts: no waits for it to pass
    return _cli(["bench", "--task", "code", "--methods", "fast_dllm", "--limit", "1", "--no-progress", "--no-plots",
                 "--output-dir", str(tmp_path / "out"), "--device", "cpu"], capsys)  # fmt: skip


@case("bench-plots-without-matplotlib")
def _(capsys, tmp_path, monkeypatch, **_):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    return _cli(["bench", "--task", "arith", "--methods", "fast_dllm", "--limit", "1", "--no-progress",
                 "--output-dir", str(tmp_path / "out"), "--device", "cpu"], capsys)  # fmt: skip


@case("bench-at-tuned-block-no-early-stop")
def _(capsys, tmp_path, **_):
    return _cli(["bench", "--task", "arith", "--methods", "fast_dllm_early_stop", "fast_dllm_drafted", "--at-tuned-block",
                 "fast_dllm_drafted", "--set", "fast_dllm_early_stop.early_stop=false", "--limit", "1", "--no-progress",
                 "--no-plots", "--output-dir", str(tmp_path / "out"), "--device", "cpu"], capsys)  # fmt: skip


@case("bench-at-tuned-block-invalid-there")
def _(capsys, tmp_path, **_):
    return _cli(["bench", "--task", "arith", "--methods", "vanilla", "--sweep-blocks", "16", "--at-tuned-block", "vanilla",
                 "--set", "vanilla.steps=33", "--limit", "1", "--no-progress", "--no-plots",
                 "--output-dir", str(tmp_path / "out"), "--device", "cpu"], capsys)  # fmt: skip


@case("bench-data-row-lacks-a-field")
def _(capsys, tmp_path, **_):
    return _bench_on_gsm8k_rows('{"question": "2 + 2?"}', capsys, tmp_path)


@case("bench-data-gsm8k-answer-without-number")
def _(capsys, tmp_path, **_):
    return _bench_on_gsm8k_rows('{"question": "2 + 2?", "answer": "four"}', capsys, tmp_path)


@case("bench-max-new-tokens")
def _(capsys, **_):
    return _cli(["bench", "--set", "blockbatch.max_new_tokens=8"], capsys)


# --------------------------------------------------------------------------------- lm-eval adapter


@case("lm-eval-gen-length")
def _(**_):
    from hf_blockbatch.eval.lm_eval_model import HFBlockBatchLM

    return _message(lambda: HFBlockBatchLM(pretrained="tiny-llada", method="blockbatch", gen_length=0))


@case("lm-eval-temperature")
def _(**_):
    from hf_blockbatch.eval.lm_eval_model import HFBlockBatchLM

    return _message(lambda: HFBlockBatchLM(pretrained="tiny-llada", method="fast_dllm", temperature=0.7))


@case("lm-eval-max-new-tokens")
def _(**_):
    from hf_blockbatch.eval.lm_eval_model import HFBlockBatchLM

    return _message(lambda: HFBlockBatchLM(pretrained="tiny-llada", method="blockbatch", max_new_tokens=64))


@case("lm-eval-no-room-in-a-later-task")
def _(monkeypatch, **_):
    from types import SimpleNamespace

    from hf_blockbatch.eval.lm_eval_model import HFBlockBatchLM

    def no_decode(*_a, **_k):
        raise AssertionError("a request decoded before the refusal")

    lm = HFBlockBatchLM(pretrained="tiny-llada", method="fast_dllm", block_length=8)
    monkeypatch.setattr(lm.model, "generate", no_decode)
    # two tasks' requests, as the harness hands them over: the second's max_gen_toks fills the model's context
    requests = [SimpleNamespace(args=("Question: 1 + 2?\nAnswer:", {"until": ["\n"], "max_gen_toks": g}))
                for g in (16, lm.model.config.context_length)]  # fmt: skip
    return _message(lambda: lm.generate_until(requests))


@case("lm-eval-method")
def _(**_):
    from conftest import make_tiny_llada

    from hf_blockbatch.eval.lm_eval_model import HFBlockBatchLM

    return _message(lambda: HFBlockBatchLM(pretrained=make_tiny_llada(), tokenizer=_tokenizer(), method="greedy"))


@case("lm-eval-loglikelihood")
def _(**_):
    from conftest import make_tiny_llada

    from hf_blockbatch.eval.lm_eval_model import HFBlockBatchLM

    lm = HFBlockBatchLM(pretrained=make_tiny_llada(), tokenizer=_tokenizer(), method="fast_dllm")
    return _message(lambda: lm.loglikelihood([]), NotImplementedError)


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(hb.TINY_LLADA)))


@case("paired-difference-string")
def _(**_):
    from hf_blockbatch.eval.stats import paired_difference

    return _message(lambda: paired_difference({0: True, 1: False}, {0: True, 1: "False"}))


# ---------------------------------------------------------------------------------------- demo


def _demo_app():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from demo import app

    return app


@case("demo-empty-prompt")
def _(**_):
    app = _demo_app()
    return _message(lambda: app.check_settings("   "), app.InputError)


@case("demo-long-prompt")
def _(**_):
    app = _demo_app()
    return _message(lambda: app.check_settings("x" * 5000), app.InputError)


@case("demo-cli-port")
def _(capsys, **_):
    app = _demo_app()
    capsys.readouterr()
    with contextlib.suppress(SystemExit):  # argparse exits
        app.main(["--port", "99999"])
    return capsys.readouterr().err.strip().splitlines()[-1].split("error: ", 1)[1]


@case("demo-cli-model")
def _(capsys, **_):
    app = _demo_app()
    capsys.readouterr()
    assert app.main(["--model", "./no-such-model"]) == 2
    return capsys.readouterr().err.strip().splitlines()[-1].split("error: ", 1)[1]
