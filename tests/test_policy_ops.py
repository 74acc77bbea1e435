"""The decoding policy's tensor operations (everything outside the model's forwards), counted exactly.

The project guide asks the policy to stay within 5 % of decoding time at batch 16 on the tiny model; its cost is
about one dispatch per operation (benchmarks/RESULTS.md §28), and ``benchmarks/policy_overhead.py`` counts them per
forward. These are ceilings at a small decode of the embedded tiny LLaDA: the exact counts of the current code. A
change that trims the policy lowers them; one that must add operations raises them and says why in its commit.
"""

from __future__ import annotations

import functools

import pytest

import hf_blockbatch as hb
from hf_blockbatch.eval.forward_log import ForwardLog
from hf_blockbatch.tasks import get_suite

#: config -> (forwards, policy operations) of 8 arith test prompts at batch 8, 48 new tokens, block 16, threshold 0.9
#: (+2 per decode, not per forward, for the read after the first forward that fails a model giving NaN or +inf
#: logits there at once, instead of after 4 x max_new_tokens + 16 idle forwards: engine.nonfinite_logits_error)
CEILINGS = {
    "fast_dllm_sparse": (13, 1278),
    "blockbatch_sparse": (16, 4035),
    "drafted": (12, 3730),
    "drafted_contained": (12, 4091),
}


def _config(name: str) -> hb.DiffusionGenerationConfig:
    common = {"max_new_tokens": 48, "threshold": 0.9}
    return {
        "fast_dllm_sparse": lambda: hb.FastDLLMConfig(block_length=16, window_queries="sparse", **common),
        "blockbatch_sparse": lambda: hb.BlockBatchConfig(window_queries="sparse", **common),
        "drafted": lambda: hb.FastDLLMConfig.drafted(block_length=16, **common),
        "drafted_contained": lambda: hb.FastDLLMConfig.drafted(exact=False, block_length=16, **common),
    }[name]()


@functools.cache
def _model_and_prompts():
    model, tok = hb.load_model("tiny-llada", device="cpu")
    suite = get_suite("arith")
    texts = [suite.prompt(item, tok) for item in suite.items("test", 8)]
    enc = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    return model, enc.input_ids, enc.attention_mask


@pytest.mark.parametrize("name", list(CEILINGS))
def test_policy_operations_stay_within_their_ceiling(name):
    model, ids, mask = _model_and_prompts()
    cfg = _config(name)
    # a first decode fills the tables built once per process (canvas positions, draft shapes), so the count is
    # the same whichever tests ran before
    model.generate(ids, attention_mask=mask, generation_config=cfg)
    with ForwardLog(model) as log:
        model.generate(ids, attention_mask=mask, generation_config=cfg)
        log.end_decode()
    forwards, ops = CEILINGS[name]
    assert len(log.records) == forwards  # the same decode (a trim changes no token and no forward)
    assert log.policy_ops <= ops, f"{name}: {log.policy_ops} policy operations, over the ceiling of {ops}"
