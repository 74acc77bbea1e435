"""Refreshes of Fast-dLLM's cache: the block-start forward, and early stop between refreshes
(``Run.settle``)."""

from __future__ import annotations

import pytest
import torch
from _generation_helpers import run_padded

import hf_blockbatch as hb
from hf_blockbatch.eval.runner import load_task


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_skipping_the_completed_block_step_stops_at_the_block_holding_eos(family):
    """``skip_completed_block_step`` with early stop: a block-start forward that completes a block holding
    EOS ends the request there. (Before, the next block's forward ran first, and the option meant to save
    a forward cost 38 % more of them on tiny-dream's code at block 16.) The same tokens as without the
    option, never more forwards, and fewer in all."""
    model, tok = hb.load_model(f"tiny-{family}", device="cpu")
    task = load_task("code")
    prompts = [tok(task.prompt(it, tok), add_special_tokens=False).input_ids for it in task.items("train", limit=12)]
    kw = dict(max_new_tokens=96, block_length=16, early_stop=True)
    official = run_padded(model, prompts, hb.FastDLLMConfig(**kw))
    skipped = run_padded(model, prompts, hb.FastDLLMConfig(skip_completed_block_step=True, **kw))
    assert torch.equal(skipped.sequences, official.sequences)
    assert bool((skipped.nfe <= official.nfe).all()) and int(skipped.nfe.sum()) < int(official.nfe.sum())
