"""The masked-diffusion SFT objective (LLaDA's): how a training row is noised, and the loss on it.

Why a module of its own: the training loop (:mod:`~hf_blockbatch.training.sft`) and the held-out
checks that pick its best checkpoint (:mod:`~hf_blockbatch.training.eval_quick`) must score the
same objective, and neither should import the other for it. The choices (a floor on ``t``, no
``1/t`` weight, Dream's shifted logits) are explained in :mod:`~hf_blockbatch.training.sft`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["apply_noise", "sft_loss"]


def apply_noise(
    ids: torch.Tensor,
    is_prompt: torch.Tensor,
    mask_id: int,
    generator: torch.Generator,
    t_min: float = 0.1,
    t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask each response token with probability ``t`` (per row, ``U(t_min, 1)`` unless given).

    Prompt tokens are never masked. Each row gets at least one masked token, so no example
    contributes nothing. Returns ``(noisy_ids, masked)``.
    """
    B, L = ids.shape
    if t is None:
        t = t_min + (1 - t_min) * torch.rand(B, generator=generator)
    u = torch.rand(B, L, generator=generator)
    masked = (u < t[:, None]) & ~is_prompt
    # rows with nothing masked: mask their response token with the smallest draw
    empty = ~masked.any(dim=1)
    if bool(empty.any()):
        u_resp = u.masked_fill(is_prompt, 2.0)
        first = u_resp.argmin(dim=1)
        masked[empty, first[empty]] = True
    noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
    return noisy, masked


def sft_loss(
    logits: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor, logit_shift: int = 0
) -> torch.Tensor:
    """Mean cross-entropy over the masked positions.

    ``logit_shift = 1`` (Dream): the logits at ``i - 1`` predict token ``i``, so the logits
    drop their last position and the targets/mask their first. Position 0 is always a prompt
    token, so nothing is lost.
    """
    if logit_shift:
        logits = logits[:, :-logit_shift]
        targets = targets[:, logit_shift:]
        masked = masked[:, logit_shift:]
    sel = logits[masked]
    if sel.numel() == 0:
        return logits.sum() * 0.0
    return F.cross_entropy(sel.float(), targets[masked])
