"""The decoding regression cases: which prompts, configs and batchings the replay test covers.

``record.py`` decodes every case with the current code and writes ``outputs.json.gz``;
``tests/test_regression.py`` decodes them again and asserts the same tokens and NFE. Record only
when a change is *meant* to alter decoding, and say so in the commit.

The configs span every mechanism of the core: vanilla, Fast-dLLM with each cache mode, with and
without early stop, with the factor rule; BlockBatch's defaults and its refresh, merge and sync
variants. Each runs on both embedded tiny checkpoints and every suite, for one request alone and
for a left-padded batch of 8 (the same 8 prompts), greedy, so the outputs are exact.
"""

from __future__ import annotations

from typing import Any

import hf_blockbatch as hb

MODELS = ("tiny-llada", "tiny-dream")
#: (suite, number of test items, generation length)
SUITES = (("arith", 8, 64), ("code", 8, 48), ("lists", 8, 48))
BATCH = 8

CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "vanilla": (hb.VanillaDiffusionConfig, {"block_length": 16}),  # steps: half the length
    "fd_none": (hb.FastDLLMConfig, {"cache": "none", "block_length": 16}),
    "fd_prefix": (hb.FastDLLMConfig, {"cache": "prefix", "block_length": 16}),
    "fd_dual": (hb.FastDLLMConfig, {"cache": "dual", "block_length": 16}),
    "fd_dual_es": (hb.FastDLLMConfig, {"cache": "dual", "block_length": 16, "early_stop": True}),
    "fd_prefix_es": (hb.FastDLLMConfig, {"cache": "prefix", "block_length": 8, "early_stop": True}),
    "fd_factor": (hb.FastDLLMConfig, {"cache": "dual", "block_length": 16, "threshold": None, "factor": 1.0}),
    "fd_factor_es": (hb.FastDLLMConfig, {"cache": "dual", "block_length": 32, "threshold": None, "factor": 1.0,
                                         "early_stop": True}),
    "bb": (hb.BlockBatchConfig, {}),
    "bb_no_es": (hb.BlockBatchConfig, {"early_stop": False}),
    "bb_commit": (hb.BlockBatchConfig, {"eos_confidence": "commit"}),
    "bb_refresh_off": (hb.BlockBatchConfig, {"refresh": "off"}),
    "bb_divergence": (hb.BlockBatchConfig, {"refresh": "divergence", "divergence_threshold": 0.05}),
    "bb_refresh16": (hb.BlockBatchConfig, {"refresh_interval": 16}),
    "bb_no_merge": (hb.BlockBatchConfig, {"merge": False}),
    "bb_no_sync": (hb.BlockBatchConfig, {"sync": False}),
    "bb_merge_only": (hb.BlockBatchConfig, {"sync": False, "merge_threshold": 0.3, "block_sizes": [4, 16, 32]}),
    "bb_sync2": (hb.BlockBatchConfig, {"sync_threshold": 2, "block_sizes": [8, 32, 64]}),
    "bb_factor": (hb.BlockBatchConfig, {"threshold": None, "factor": 1.0}),
    "bb_skip": (hb.BlockBatchConfig, {"skip_completed_block_step": True, "block_sizes": [4, 8, 16, 32]}),
}


def make_config(name: str, gen_length: int) -> hb.DiffusionGenerationConfig:
    cls, options = CONFIGS[name]
    if cls is hb.VanillaDiffusionConfig:
        options = {**options, "steps": gen_length // 2}
    return cls(max_new_tokens=gen_length, **options)


def prompts(model_name: str, suite: str, n: int) -> list[str]:
    """The suite's first ``n`` test prompts, as the bench builds them for that checkpoint."""
    from hf_blockbatch.tasks import get_suite

    _, tokenizer = load(model_name)
    task = get_suite(suite)
    return [task.prompt(item, tokenizer, chat=True) for item in task.items("test", limit=n)]


_LOADED: dict[str, Any] = {}


def load(model_name: str):
    if model_name not in _LOADED:
        _LOADED[model_name] = hb.load_model(model_name, device="cpu")
    return _LOADED[model_name]


def decode(model_name: str, suite: str, n: int, gen_length: int, config: str, batch: int):
    """``(new tokens per prompt, NFE per prompt)`` for the case, decoding ``batch`` prompts per call."""
    import torch

    model, tokenizer = load(model_name)
    texts = prompts(model_name, suite, n)
    tokenizer.padding_side = "left"
    cfg = make_config(config, gen_length)
    tokens: list[list[int]] = []
    nfe: list[int] = []
    for i in range(0, n, batch):
        enc = tokenizer(texts[i : i + batch], add_special_tokens=False, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, generation_config=cfg, return_dict_in_generate=True)
        tokens += out.sequences[:, enc.input_ids.shape[1] :].tolist()
        nfe += out.nfe.tolist()
    return tokens, nfe


def all_cases():
    for model_name in MODELS:
        for suite, n, gen_length in SUITES:
            for config in CONFIGS:
                for batch in (1, BATCH):
                    yield model_name, suite, n, gen_length, config, batch


def key(model_name: str, suite: str, config: str, batch: int) -> str:
    return f"{model_name}/{suite}/{config}/b{batch}"
