"""Building blocks shared by the LLaDA and Dream model classes.

Both families are Llama-shaped bidirectional transformers (RMSNorm, RoPE with half rotation,
SwiGLU MLP); they differ in parameter names, biases, GQA and where RoPE rounds. The shared
math lives here once; the family files only name the parameters the official checkpoints use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hf_blockbatch.attention.backends import AttentionBackend
from hf_blockbatch.attention.metadata import WindowBatch
from hf_blockbatch.cache import BranchCache

__all__ = ["init_weights", "RMSNorm", "RopeTable", "rope_cos_sin", "apply_rope", "ForwardContext", "dropout", "self_attention", "swiglu"]


class RMSNorm(nn.Module):
    """RMS norm computed in float32 and cast back before the gain, as both official codes do."""

    def __init__(self, dim: int, eps: float) -> None:
        """A gain of ones over ``dim`` features; ``eps`` is added to the mean square."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` scaled to unit RMS over its last dimension in float32, cast back to ``x``'s dtype, then times the
        gain ``weight``."""
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


@torch.no_grad()
def init_weights(module: nn.Module, std: float) -> None:
    """Initialisation for training from scratch (both families; checkpoints overwrite it)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin`` of shape ``[*positions.shape, 1, head_dim]`` (half-rotation layout), the
    sine's first half negated: :func:`apply_rope` multiplies it by the halves swapped, which is the
    official ``rotate_half(x) * sin`` with the negation moved from ``x`` onto the sine (exact in
    any float format), one operation instead of three.

    Computed per call from the positions: cheap (head_dim/2 frequencies), and it sidesteps
    non-persistent buffers, which meta-device loading leaves uninitialised.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], dim=-1)[..., None, :], torch.cat([-sin, sin], dim=-1)[..., None, :]


class RopeTable:
    """``cos``/``sin`` for positions ``[0, length)``, computed once per device (at least 256 positions
    at first; when a longer canvas arrives, grown to twice its size, or to the length asked if that is
    longer: never the model's whole context up front, which for Dream is 131k positions) and looked up
    by position. Each entry is computed exactly as :func:`rope_cos_sin` computes it, so the
    lookup is bitwise identical; it saves two transcendental passes per forward, which on small
    models is a visible share of a decoding step. A plain attribute, not a buffer, for the same
    reason as above (meta-device loading)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        """No table yet: a device's is computed at its first lookup."""
        self.head_dim, self.theta = head_dim, theta
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` must be ``< length`` (the canvas length, a host integer: no sync)."""
        table = self._tables.get(positions.device)
        if table is None or table[0].shape[0] < length:
            size = max(length, 2 * table[0].shape[0]) if table is not None else max(length, 256)
            pos = torch.arange(size, device=positions.device)
            cos, sin = rope_cos_sin(pos, self.head_dim, self.theta)
            table = self._tables[positions.device] = (cos[:, 0], sin[:, 0])
        cos, sin = table
        return cos[positions][..., None, :], sin[positions][..., None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, full_precision: bool) -> torch.Tensor:
    """Rotate ``x`` (``[..., H, D]``) by :func:`rope_cos_sin`'s tables (its sine signed). LLaDA rotates
    in float32 (``rope_full_precision``); Dream rotates in the activation dtype; the choice changes
    bf16 results, so it follows the config."""
    half = x.shape[-1] // 2
    if full_precision:
        xf = x.float()
        return (xf * cos + xf.roll(half, -1) * sin).to(x.dtype)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + x.roll(half, -1) * sin


def keep_rows(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``x`` (``[..., C]``), or the rows ``keep`` of it flattened to ``[N, C]``.

    Why: a forward's last layer feeds only the LM head, and the head reads a few positions (a window's masks,
    never the prompt); every position's K/V is still written (they come before its attention). So past its
    attention scores the last layer computes the kept rows alone: the output projection, the residual, the MLP."""
    return x if keep is None else x.reshape(-1, x.shape[-1]).index_select(0, keep)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Both official MLPs' activation, ``silu(gate) * up`` (elementwise): one definition for both families."""
    return F.silu(gate) * up


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` through dropout of probability ``p``, which the caller sets to 0.0 outside training (the forward's
    :class:`ForwardContext` holds it): at 0 ``x`` itself, with no op at all, as the official LLaDA ``Dropout``
    returns its input at ``p == 0``."""
    return F.dropout(x, p) if p else x


@dataclass
class ForwardContext:
    """What every layer of one forward shares: the mode, RoPE tables, the cache and its metadata.

    ``dense``: hidden states are ``[B, L, C]``; K/V of every position go to cache rows ``rows``
    (all rows when ``None``) if a cache is given. ``window``: hidden states are packed ``[T, C]``;
    their K/V go to ``wb.flat_slots`` and the queries attend to their rows of the cache.

    ``attention_dropout`` / ``residual_dropout``: the dropout probabilities of this forward, the config's in
    training mode and 0.0 in eval mode (``DiffusionLMMixin._context``), so that inference runs no dropout op.
    """

    mode: str
    backend: AttentionBackend
    cos: torch.Tensor
    sin: torch.Tensor
    rope_full_precision: bool
    cache: BranchCache | None = None
    rows: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    wb: WindowBatch | None = None
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0


def self_attention(
    x: torch.Tensor,
    q_proj: nn.Linear,
    k_proj: nn.Linear,
    v_proj: nn.Linear,
    o_proj: nn.Linear,
    layer_idx: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    ctx: ForwardContext,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bidirectional self-attention over the canvas, in either forward mode (see ForwardContext).

    ``keep``: only these rows of the flattened output are projected and returned (see :func:`keep_rows`)."""
    lead = x.shape[:-1]
    q = q_proj(x).view(*lead, num_heads, head_dim)
    k = k_proj(x).view(*lead, num_kv_heads, head_dim)
    v = v_proj(x).view(*lead, num_kv_heads, head_dim)
    q = apply_rope(q, ctx.cos, ctx.sin, ctx.rope_full_precision)
    k = apply_rope(k, ctx.cos, ctx.sin, ctx.rope_full_precision)
    scale = head_dim**-0.5
    if ctx.mode == "dense":
        if ctx.cache is not None:
            ctx.cache.write_rows(layer_idx, ctx.rows, k, v)
        out = ctx.backend.dense(q, k, v, ctx.key_mask, scale, ctx.attention_dropout)
    else:
        # write first, so the window's queries see the window's own fresh keys
        wb = ctx.wb
        if wb.write_src is None:
            ctx.cache.write_tokens(layer_idx, wb.flat_slots, k, v)
        else:  # the K/V of some queries also go to other rows (lookahead drafts): one scatter for both
            ctx.cache.write_tokens(layer_idx, wb.write_slots, k.index_select(0, wb.write_src),
                                   v.index_select(0, wb.write_src))  # fmt: skip
        layer = ctx.cache.layers[layer_idx]
        out = ctx.backend.window(q, layer.keys, layer.values, ctx.wb, scale)
    return o_proj(keep_rows(out.reshape(*lead, num_heads * head_dim), keep))
