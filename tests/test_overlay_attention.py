"""``benchmarks/overlay_attention.py``: a K/V overlay for the lookahead drafts, RESULTS §36.

The probe's times mean something only if its overlay layout computes the attention today's rows compute: on
captured steps of a real drafted decode, every query's output must match ``sdpa_grouped``'s, each request must
hold fewer K/V slots than its rows do today, and the capture must leave the backend as it found it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import load_benchmark

import hf_blockbatch as hb
from hf_blockbatch.attention.backends import GroupedSDPABackend
from hf_blockbatch.eval.runner import _encode, load_task
from hf_blockbatch.generation.configs import FastDLLMConfig

probe = load_benchmark("overlay_attention")


@torch.inference_mode()
@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_the_overlay_computes_todays_attention(name: str) -> None:
    model, tokenizer = hb.load_model(name, device="cpu")
    model.set_attention_backend("sdpa_grouped")
    task = load_task("lists")
    items = task.items("train", limit=4)
    batch = _encode(tokenizer, [task.prompt(it, tokenizer) for it in items], model.device)
    config = FastDLLMConfig.drafted(exact=False, max_new_tokens=task.default_gen_length, block_length=32)
    window = GroupedSDPABackend.window
    steps, decoded = probe.capture(model, [batch], config, limit=6)
    assert GroupedSDPABackend.window is window  # the capture's patch is undone
    assert steps and decoded == 4, "no step of the decode carried a draft"
    for c in steps:
        o = probe.build_overlay(c)
        scale = c.q.shape[-1] ** -0.5
        ours, today = probe.overlay_attention(c.q, o, scale), GroupedSDPABackend().window(c.q, c.k, c.v, c.wb, scale)
        torch.testing.assert_close(ours, today, rtol=1e-4, atol=1e-5)
        assert o.write_slots.numel() == c.q.shape[0]  # every query's K/V written once, no echoes
        L = c.k.shape[1]
        # a tail (none for a request whose drafts sit out the step), smaller than the draft rows it replaces
        assert max(o.tails) > 0 and all(t < (c.branches - 1) * L for t in o.tails)
        assert o.requests == len({int(r) // c.branches for r in c.wb.rows})
