"""What researchers do to a loaded model before decoding or fine-tuning it: wrap it in PEFT adapters, enable
activation checkpointing, quantize it, save it in shards. Each must decode (and train) as the untransformed model
where the transform is exact, and run where it is not.

PEFT is not a dependency: its tests skip without it; what it needed from our classes is tested without it too.
"""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, MASK_ID, make_tiny_dream, make_tiny_llada

import hf_blockbatch as hb

FAMILIES = ["llada", "dream"]
#: each model family's attention projections, as the official checkpoints name them (LoRA's usual targets)
ATTENTION = {"llada": ["q_proj", "k_proj", "v_proj", "attn_out"], "dream": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _model(family: str) -> torch.nn.Module:
    return make_tiny_llada() if family == "llada" else make_tiny_dream()


def _prompts() -> dict[str, torch.Tensor]:
    """Two prompts, the second left-padded."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [EOS_ID, EOS_ID, 11, 12, 13, 14]])
    return {"input_ids": ids, "attention_mask": (torch.arange(6) >= torch.tensor([[0], [2]])).long()}


CONFIGS = {
    "vanilla": lambda: hb.VanillaDiffusionConfig(max_new_tokens=16, steps=16, block_length=8, mask_token_id=MASK_ID),
    "fast_dllm": lambda: hb.FastDLLMConfig(max_new_tokens=16, block_length=8, threshold=0.5, mask_token_id=MASK_ID),
    "blockbatch": lambda: hb.BlockBatchConfig(max_new_tokens=16, mask_token_id=MASK_ID),
    "drafted": lambda: hb.FastDLLMConfig.drafted(max_new_tokens=16, block_length=16, threshold=0.5,
                                                 mask_token_id=MASK_ID),  # fmt: skip
}


def _decode(model: torch.nn.Module, name: str) -> torch.Tensor:
    return model.generate(**_prompts(), generation_config=CONFIGS[name]())


@pytest.mark.parametrize("family", FAMILIES)
def test_prepare_inputs_for_generation_exists_for_wrappers_and_refuses_a_call(family: str) -> None:
    """PEFT's causal-LM wrapper reads ``prepare_inputs_for_generation`` when it wraps a model, then swaps its own in
    around ``generate``: our classes lacked it (``AttributeError`` inside ``get_peft_model``). It exists, a call says
    what to call instead, and generate() decodes the same with the attribute swapped as PEFT swaps it."""
    model = _model(family)
    ref = _decode(model, "fast_dllm")
    with pytest.raises(NotImplementedError, match="masked diffusion: generate\\(\\) builds its canvas"):
        model.prepare_inputs_for_generation(torch.tensor([[5, 6]]))
    saved = model.prepare_inputs_for_generation
    model.prepare_inputs_for_generation = lambda *a, **k: saved(*a, **k)
    assert torch.equal(_decode(model, "fast_dllm"), ref)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_peft_lora_decodes_trains_and_merges(family: str, task_type: str | None) -> None:
    """LoRA on the attention projections: with B at its zero init every decoder gives the base model's tokens; one
    step of the SFT objective trains the adapters only; the merged model decodes as the adapted one."""
    peft = pytest.importorskip("peft")
    from hf_blockbatch.training.objective import apply_noise, sft_loss

    model = _model(family)
    ref = {name: _decode(model, name) for name in CONFIGS}
    kwargs = {"task_type": task_type} if task_type else {}
    torch.manual_seed(1)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION[family],
                                                      lora_dropout=0.0, **kwargs))  # fmt: skip
    for name in CONFIGS:
        assert torch.equal(_decode(lora, name), ref[name]), name
    lora.train()
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    is_prompt = torch.arange(12).expand(2, 12) < 4
    noisy, masked = apply_noise(ids, is_prompt, MASK_ID, torch.Generator().manual_seed(0))
    loss = sft_loss(lora(noisy).logits, ids, masked, lora.logit_shift)
    loss.backward()
    torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=1.0).step()
    trained = {n for n, p in lora.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)
    lora.eval()
    adapted = _decode(lora, "fast_dllm")
    merged = lora.merge_and_unload()
    assert type(merged) is type(model)
    assert torch.equal(_decode(merged, "fast_dllm"), adapted)
