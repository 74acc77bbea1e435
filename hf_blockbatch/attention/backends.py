"""How packed window queries meet the cached keys: interchangeable attention backends.

Every backend answers the same two questions:

* ``window(q, k_cache, v_cache, wb, scale)``: packed queries ``[T, H, D]`` of a window forward
  attend to their own row of the cache (``[R, L, H_kv, D]``, already holding the window's fresh
  K/V); returns ``[T, H, D]``.
* ``dense(q, k, v, key_mask, scale, dropout_p=0.0)``: a full-canvas bidirectional forward, ``[B, L, H, D]``
  tensors, ``key_mask`` ``[B, L]`` (valid keys), ``[B, L, L]`` (keys per query) or ``None``; ``dropout_p``
  drops attention weights (the model passes its ``attention_dropout`` in training mode, else 0). Training
  runs the full forward, so only ``dense`` takes a dropout: window forwards decode (the model refuses them
  in training mode with attention dropout on, ``DiffusionLMMixin._context``).

Backends: ``flash_varlen`` (flash-attn, CUDA, fp16/bf16), ``torch_varlen`` (PyTorch's own
varlen kernel, CUDA), ``sdpa_grouped`` (one ``scaled_dot_product_attention`` per group of rows with equal
query counts, merged where padding is cheaper than a call: the fastest on CPU for BlockBatch's
windows of different sizes and lookahead's drafts, see ``benchmarks/attention_cpu.py``), ``sdpa`` (windows padded to the longest) and ``reference``
(explicit float32 softmax, for tests). ``auto`` picks the first that can run.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hf_blockbatch.attention.metadata import LengthGroup, WindowBatch

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "available_backends", "get_backend", "BACKENDS"]


def _pad(q: torch.Tensor, wb: WindowBatch) -> torch.Tensor:
    """Packed ``[T, H, D]`` → padded ``[A, H, W, D]`` (invalid slots hold a copy of a real query)."""
    return q[wb.pad_index].transpose(1, 2)


def _unpad(out: torch.Tensor, wb: WindowBatch) -> torch.Tensor:
    """Padded ``[A, H, W, D]`` → packed ``[T, H, D]``, gathered by the step's prebuilt indices."""
    return out.transpose(1, 2)[wb.token_local, wb.token_col]


def _rows_kv(cache_t: torch.Tensor, wb: WindowBatch) -> torch.Tensor:
    """The active rows of a cache tensor, ``[A, H_kv, L, D]`` (a view when all rows are active)."""
    t = cache_t if wb.all_rows else cache_t.index_select(0, wb.rows)
    return t.transpose(1, 2)


def _bool_key_mask(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, L]`` valid keys or ``[B, W, L]`` keys per query → SDPA's ``[B, 1, 1 or W, L]``."""
    if key_mask is None:
        return None
    return key_mask[:, None] if key_mask.dim() == 3 else key_mask[:, None, None, :]


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` on ``[B, H, W, D]`` queries and ``[B, H_kv, L, D]`` keys, dropping
    attention weights with probability ``dropout_p`` (0: none, SDPA's default).

    Grouped-query heads go through ``enable_gqa``, except on CUDA with a mask: PyTorch's fused
    CUDA kernels do not take both, and it would fall back to the math kernel, which materialises
    float32 ``[B, H, W, L]`` scores (a padded Dream batch's every full forward). There the K/V heads
    are expanded instead, as transformers' SDPA integration does.
    """
    gqa = q.shape[1] != k.shape[1]
    if gqa and attn_mask is not None and q.is_cuda:
        groups = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=gqa)  # fmt: skip


class AttentionBackend:
    """Base class; subclasses override :meth:`window` (and :meth:`dense` where they can do better)."""

    name = "base"

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this backend can run here: ``auto`` and :func:`get_backend` ask before choosing it."""
        return True

    def window(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, wb: WindowBatch, scale: float
    ) -> torch.Tensor:
        """Packed queries ``[T, H, D]`` attend to their rows of the cache ``[R, L, H_kv, D]`` (already
        holding the window's fresh K/V), keys masked by ``wb``; returns ``[T, H, D]``."""
        raise NotImplementedError

    def dense(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None,
        scale: float,
        dropout_p: float = 0.0,
    ) -> torch.Tensor:
        """A full-canvas bidirectional forward on ``[B, L, H, D]`` tensors; ``key_mask`` is ``[B, L]``
        (valid keys), ``[B, L, L]`` (keys per query) or ``None``; ``dropout_p``: the attention weights'
        dropout (training only). SDPA unless a subclass does better."""
        out = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), _bool_key_mask(key_mask), scale,
                    dropout_p)  # fmt: skip
        return out.transpose(1, 2)

    def __repr__(self) -> str:
        """``ClassName()``: a backend holds no settings, so its class is all there is to show."""
        return f"{type(self).__name__}()"


class ReferenceBackend(AttentionBackend):
    """Explicit float32 softmax attention: slow, obviously correct, the yardstick in tests."""

    name = "reference"

    @staticmethod
    def _attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None,
        scale: float,
        dropout_p: float = 0.0,
    ) -> torch.Tensor:
        # q [B, H, W, D], k/v [B, H_kv, L, D], key_mask [B, L] | [B, W, L] | None
        groups = q.shape[1] // k.shape[1]
        k = k.float().repeat_interleave(groups, dim=1)
        v = v.float().repeat_interleave(groups, dim=1)
        scores = torch.einsum("bhwd,bhld->bhwl", q.float(), k) * scale
        if key_mask is not None:
            scores = scores.masked_fill(~_bool_key_mask(key_mask), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if dropout_p:  # on the weights, as SDPA and the official eager attention drop them
            probs = F.dropout(probs, dropout_p)
        return torch.einsum("bhwl,bhld->bhwd", probs, v).to(q.dtype)

    def window(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, wb: WindowBatch, scale: float
    ) -> torch.Tensor:
        out = self._attend(_pad(q, wb), _rows_kv(k_cache, wb), _rows_kv(v_cache, wb), wb.key_mask, scale)
        return _unpad(out, wb)

    def dense(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None,
        scale: float,
        dropout_p: float = 0.0,
    ) -> torch.Tensor:
        out = self._attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), key_mask, scale, dropout_p)
        return out.transpose(1, 2)


class SDPABackend(AttentionBackend):
    """Windows padded to the longest one, through one ``scaled_dot_product_attention`` call.

    Padding wastes ``A × W − T`` query slots; no gather of cache rows is needed when every row is
    active. Best when all windows have the same length (Fast-dLLM), otherwise ``sdpa_grouped``.
    """

    name = "sdpa"

    def window(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, wb: WindowBatch, scale: float
    ) -> torch.Tensor:
        out = _sdpa(_pad(q, wb), _rows_kv(k_cache, wb), _rows_kv(v_cache, wb), _bool_key_mask(wb.key_mask), scale)
        return _unpad(out, wb)


class GroupedSDPABackend(AttentionBackend):
    """Rows grouped by query count, one ``scaled_dot_product_attention`` per group, at the price of
    gathering each group's cache rows: BlockBatch's windows 4…128 would waste two thirds of a batch
    padded to the longest. Where padding a few shorter rows is cheaper than another call (small
    widths, few rows: a batch-1 step with lookahead drafts), groups are merged and padded
    (``WindowBatch.length_groups``, ``GROUP_CALL_COST``). On CPUs this is the fastest path once the
    windows of a step differ (see ``benchmarks/attention_cpu.py``)."""

    name = "sdpa_grouped"

    def window(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, wb: WindowBatch, scale: float
    ) -> torch.Tensor:
        groups = wb.length_groups(q.shape[1] * q.shape[2])  # indices and masks built once per step
        # one group holds every row in order, so its real slots are already in packed order: no scatter
        single = len(groups) == 1
        out = None if single else torch.empty_like(q)
        for g in groups:
            k, v = self._rows(g, k_cache, v_cache)
            qg = q if single and g.real is None else q.index_select(0, g.index)  # (single, unpadded: in order)
            qg = qg.reshape(g.count, g.width, *q.shape[1:])
            o = _sdpa(qg.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.key_mask, scale)
            o = o.transpose(1, 2).reshape(-1, *q.shape[1:])
            if g.real is not None:  # a padded group: its real slots only
                o = o.index_select(0, g.real)
            if single:
                return o
            out.index_copy_(0, g.target, o)
        return out

    @staticmethod
    def _rows(g: LengthGroup, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A group's cache rows: evenly spaced ones as a strided view (no copy), others gathered."""
        if g.view is not None:
            return k_cache[g.view], v_cache[g.view]
        return k_cache.index_select(0, g.rows), v_cache.index_select(0, g.rows)


class _VarlenBackend(AttentionBackend):
    """A CUDA variable-length kernel reading the cache in place: each cache row is two key
    segments (its left padding, with no queries, then its tokens), see ``WindowBatch``."""

    _fn: Callable[..., torch.Tensor] | None = None

    @classmethod
    def _import(cls) -> Callable[..., torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def _load(cls) -> Callable[..., torch.Tensor] | None:
        if cls._fn is None:
            try:
                cls._fn = cls._import()
            except ImportError:
                return None
        return cls._fn

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and cls._load() is not None

    def window(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, wb: WindowBatch, scale: float
    ) -> torch.Tensor:
        wb.ensure_segments()
        k = k_cache.reshape(-1, *k_cache.shape[2:])  # [R * L, H_kv, D]: a view, no copy
        v = v_cache.reshape(-1, *v_cache.shape[2:])
        # At a longest window of 1 with grouped-query heads, flash-attn (and PyTorch's copy of it)
        # reshapes the queries as one per sequence, which two segments per row (one with no
        # queries) break. The bound only sizes the kernel's grid, so 2 computes the same.
        max_q = max(wb.max_len, 2)
        return self._call(self._load(), q, k, v, wb, max_q, scale)

    def _call(
        self,
        fn: Callable[..., torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        wb: WindowBatch,
        max_q: int,
        scale: float,
    ) -> torch.Tensor:
        """One kernel call on the packed queries and the cache flattened to ``[R * L, H_kv, D]``."""
        raise NotImplementedError


class TorchVarlenBackend(_VarlenBackend):
    """PyTorch's variable-length attention kernel (``torch.nn.attention.varlen``), CUDA only."""

    name = "torch_varlen"

    @classmethod
    def _import(cls) -> Callable[..., torch.Tensor]:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        cls._gqa, cls._scale = "enable_gqa" in params, "scale" in params
        return varlen_attn

    def _call(
        self,
        fn: Callable[..., torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        wb: WindowBatch,
        max_q: int,
        scale: float,
    ) -> torch.Tensor:
        kwargs = {}
        if self._scale:
            kwargs["scale"] = scale
        elif not math.isclose(scale, q.shape[-1] ** -0.5):  # PyTorch 2.9's kernel always scales by D^-0.5
            raise ValueError(
                f"This PyTorch's varlen_attn has no `scale` argument and cannot use softmax scale {scale}: "
                "upgrade PyTorch (>= 2.10), or model.set_attention_backend('sdpa_grouped')."
            )
        if q.shape[1] != k.shape[1]:
            if self._gqa:
                kwargs["enable_gqa"] = True
            else:  # older PyTorch: expand the KV heads
                groups = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return fn(q, k, v, wb.seg_cu_q, wb.seg_cu_k, max_q, wb.length, **kwargs)


class FlashVarlenBackend(_VarlenBackend):
    """``flash_attn.flash_attn_varlen_func`` (flash-attn 2), CUDA, fp16/bf16, native GQA."""

    name = "flash_varlen"

    @classmethod
    def _import(cls) -> Callable[..., torch.Tensor]:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func

    def _call(
        self,
        fn: Callable[..., torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        wb: WindowBatch,
        max_q: int,
        scale: float,
    ) -> torch.Tensor:
        return fn(q, k, v, wb.seg_cu_q, wb.seg_cu_k, max_q, wb.length, softmax_scale=scale, causal=False)


BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (FlashVarlenBackend, TorchVarlenBackend, GroupedSDPABackend, SDPABackend, ReferenceBackend)
}
_AUTO_ORDER = ("flash_varlen", "torch_varlen", "sdpa_grouped", "sdpa")


def available_backends(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """Names of the backends that can run on this device and dtype."""
    device = torch.device(device)
    return [name for name, cls in BACKENDS.items() if cls.is_available(device, dtype)]


def get_backend(name: str, device: torch.device | str, dtype: torch.dtype) -> AttentionBackend:
    """Instantiate a backend by name (``"auto"`` picks the fastest that can run here)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:  # torch's message lists every device type it was built to know
        raise ValueError(f"device={device!r} is not a device PyTorch knows: use cpu or cuda (cuda:0, ...).") from err
    # checked as a string first: a list (say, from a JSON config) failed the dict lookup with "unhashable type"
    if not isinstance(name, str) or name not in ("auto", *BACKENDS):
        raise ValueError(f"Unknown attention backend {name!r}; choose one of {['auto', *BACKENDS]}.")
    if name == "auto":
        for candidate in _AUTO_ORDER:
            if BACKENDS[candidate].is_available(device, dtype):
                name = candidate
                break
    cls = BACKENDS[name]
    if not cls.is_available(device, dtype):
        raise ValueError(
            f"Attention backend {name!r} cannot run on {device} with {dtype}; available here: "
            f"{available_backends(device, dtype)}."
        )
    return cls()
