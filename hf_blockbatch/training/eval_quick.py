"""Cheap held-out checks run *during* training, to pick the best checkpoint.

Why a separate, deliberately simple decoder: the real decoders (vanilla, Fast-dLLM, BlockBatch)
live in :mod:`hf_blockbatch.generation` and are what the project measures. Training only needs
a stable, dependency-free signal of "can this checkpoint answer", so this module does a plain
full-forward decode: semi-autoregressive blocks, and inside each block a fixed number of the
most confident masked positions is committed per step (LLaDA's low-confidence remasking).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from hf_blockbatch.training.objective import sft_loss

logger = logging.getLogger(__name__)

__all__ = ["aligned_logits", "greedy_decode", "masked_token_accuracy", "decode_accuracy"]


def aligned_logits(logits: torch.Tensor, logit_shift: int) -> torch.Tensor:
    """Logits re-indexed so that ``out[:, i]`` predicts token ``i`` for either family.

    Dream's forward (``logit_shift = 1``) returns, at position ``i``, the prediction for token
    ``i + 1``; moving them one place right makes both families look like LLaDA. Position 0 of a
    shifted model has no prediction; it receives a copy of position 0's logits and must never be
    read (it is always a prompt token).
    """
    if logit_shift == 0:
        return logits
    if logit_shift != 1:
        raise ValueError(f"unsupported logit_shift {logit_shift}")
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


@torch.no_grad()
def greedy_decode(
    model: Any,
    prompts: Sequence[Sequence[int]],
    gen_length: int,
    mask_id: int,
    pad_id: int,
    tokens_per_step: int = 4,
    block_length: int = 32,
) -> torch.Tensor:
    """Decode ``gen_length`` tokens after each prompt; returns the generated ids ``[B, gen_length]``.

    Prompts of different lengths are left-padded with ``pad_id`` and masked out of attention
    (the models keep the true RoPE positions). Each block of ``block_length`` positions is
    filled in ``ceil(block_length / tokens_per_step)`` steps, committing the highest-probability
    predictions among the still-masked positions of the block.
    """
    device = model.device
    shift = int(getattr(model, "logit_shift", 0))
    B = len(prompts)
    P = max(len(p) for p in prompts)
    L = P + gen_length
    ids = torch.full((B, L), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros((B, L), dtype=torch.bool, device=device)
    for r, p in enumerate(prompts):
        ids[r, P - len(p) : P] = torch.as_tensor(list(p), dtype=torch.long, device=device)
        attn[r, P - len(p) :] = True
    ids[:, P:] = mask_id
    neg = torch.finfo(torch.float32).min
    for b0 in range(P, L, block_length):
        b1 = min(b0 + block_length, L)
        for _ in range(math.ceil((b1 - b0) / tokens_per_step)):
            still = ids[:, b0:b1] == mask_id
            if not bool(still.any()):
                break
            logits = aligned_logits(model(ids, attention_mask=attn).logits, shift)[:, b0:b1].float()
            probs = F.softmax(logits, dim=-1)
            conf, pred = probs.max(dim=-1)
            conf = torch.where(still, conf, torch.full_like(conf, neg))
            k = min(tokens_per_step, b1 - b0)
            top = conf.topk(k, dim=-1).indices
            chosen = torch.zeros_like(still).scatter_(1, top, True) & still
            block = ids[:, b0:b1]
            ids[:, b0:b1] = torch.where(chosen, pred, block)
    return ids[:, P:]


def completion_text(tokenizer: Any, gen_ids: Sequence[int], stop_ids: Sequence[int]) -> str:
    """The completion up to the first stop token (end of turn or EOS), special tokens removed."""
    out: list[int] = []
    stops = set(stop_ids)
    for t in gen_ids:
        if int(t) in stops:
            break
        out.append(int(t))
    return tokenizer.decode(out, skip_special_tokens=True)


@torch.no_grad()
def masked_token_accuracy(
    model: Any, batches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> dict[str, float]:
    """Loss and accuracy on pre-noised held-out batches ``(noisy_ids, clean_ids, masked)``.

    The batches are noised once, with a fixed seed, so successive evaluations are comparable.
    """
    shift = int(getattr(model, "logit_shift", 0))
    device = model.device
    tot_loss, tot_correct, tot_n = 0.0, 0, 0
    for noisy, clean, masked in batches:
        noisy, clean, masked = noisy.to(device), clean.to(device), masked.to(device)
        logits = model(noisy).logits.float()
        n = int(masked.sum())
        tot_loss += float(sft_loss(logits, clean, masked, shift)) * n
        pred = aligned_logits(logits, shift).argmax(-1)
        tot_correct += int((pred == clean)[masked].sum())
        tot_n += n
    return {"heldout_loss": tot_loss / max(tot_n, 1), "heldout_acc": tot_correct / max(tot_n, 1)}


@torch.no_grad()
def decode_accuracy(
    model: Any,
    tokenizer: Any,
    task: Any,
    items: Sequence[Any],
    gen_length: int,
    ids: dict[str, int],
    tokens_per_step: int = 4,
    block_length: int = 32,
) -> tuple[float, list[str]]:
    """Fraction of ``items`` the quick decoder answers correctly (scored by ``task.score``)."""
    prompts = [tokenizer(task.prompt(it, tokenizer), add_special_tokens=False)["input_ids"] for it in items]
    gen = greedy_decode(model, prompts, gen_length, ids["mask"], ids["pad"], tokens_per_step, block_length)
    texts = [completion_text(tokenizer, row.tolist(), (ids["eot"], ids["eos"])) for row in gen]
    correct = sum(bool(task.score(it, txt).correct) for it, txt in zip(items, texts))
    return correct / max(len(items), 1), texts
