"""Where K/V live: :class:`BranchCache`, a transformers ``Cache`` with one row per branch.

A masked-diffusion decoder keeps a *fixed-length* canvas per row (prompt + masked answer), so
unlike an autoregressive cache nothing is ever appended: every layer holds a preallocated
``[rows, length, kv_heads, head_dim]`` tensor and forwards overwrite slices of it in place.

The token-major layout (length before heads) is deliberate: flattening ``[rows * length]`` is
a free view, which is exactly the packed key buffer that variable-length attention kernels
(flash-attn varlen, PyTorch varlen) consume, so no per-step copy of the cache is needed.

The row operations are what BlockBatch needs: broadcast one row's K/V into its branches after
the initial forward, copy the leader's row into a lagging branch (sync), and keep a subset of
rows when requests finish. All layers' keys and values are views of one ``[layers, 2, R, L, H, D]``
storage, so a row operation covers every layer at once (a sync happens on most BlockBatch steps;
these copies are memory-bound, and the layout lets each be a single pass over the bytes moved). The key-padding mask and the RoPE positions of each row travel with the rows,
so a row operation can never separate K/V from the mask they were computed under.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_blockbatch.checks import COMPUTE_DTYPES, check_device, check_positive_int

if TYPE_CHECKING:  # the model modules import this one
    from hf_blockbatch.models.dream import DreamConfig
    from hf_blockbatch.models.llada import LLaDAConfig

logger = logging.getLogger(__name__)

# Writes detach: K/V are kept for reuse by later forwards, never differentiated through (the
# layers share one storage, which a write of a grad-requiring tensor would pull into the graph).

__all__ = ["BranchCache", "BranchCacheLayer", "checked_padding_mask", "release_pooled_storage", "reuse_storage"]


class _StoragePool:
    """CPU memory for K/V storage, kept from one decode for the next.

    A large CPU tensor is fresh memory-mapped pages, and every page faults on first touch, a cost
    paid again by every call that allocates anew. Decoders lend their storage back when they return (no view of it leaves them) and
    the next decode of the same dtype reuses it, as a serving engine preallocates its KV pool once.
    One buffer per dtype is kept, the largest lent; a decode that finds it taken (another thread is
    decoding) allocates its own. A buffer that is too small is replaced by one :data:`GROWTH` times
    its size (or the size asked, if larger), as a vector grows: batches of a run differ by a few
    prompt tokens, and an exact fit would fault in fresh pages again for every slightly longer
    batch (RESULTS §29: 1–3 times in a 500-item run). GPUs need none of this: PyTorch's caching
    allocator reuses freed device memory.
    """

    #: how much larger than the buffer it replaces a new one is at least
    GROWTH: ClassVar[float] = 1.25

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[torch.dtype, torch.Tensor] = {}
        self._local = threading.local()

    @property
    def lending(self) -> list[torch.Tensor] | None:
        """Buffers taken inside the current thread's :func:`reuse_storage` block (None: outside)."""
        return getattr(self._local, "lent", None)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            buffer = self._free.pop(dtype, None)
        if buffer is None or buffer.numel() < numel:
            size = numel if buffer is None else max(numel, math.ceil(buffer.numel() * self.GROWTH))
            logger.debug("allocating %.1f MB of K/V storage", size * torch.finfo(dtype).bits / 8e6)
            with torch.inference_mode(False):  # an inference tensor could not be written outside inference mode later
                buffer = torch.empty(size, dtype=dtype)
        self.lending.append(buffer)
        return buffer[:numel]

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            kept = self._free.get(buffer.dtype)
            if kept is None or kept.numel() < buffer.numel():
                self._free[buffer.dtype] = buffer

    def release(self) -> None:
        with self._lock:
            self._free.clear()

    @contextmanager
    def lend(self) -> Iterator[None]:
        """This thread's decodes take buffers inside the block, and give them all back at its end."""
        if self.lending is not None:  # nested: the outer block gives them back
            yield
            return
        self._local.lent = []
        try:
            yield
        finally:
            lent, self._local.lent = self._local.lent, None
            for buffer in lent:
                self.give(buffer)


_POOL = _StoragePool()


@contextmanager
def reuse_storage() -> Iterator[None]:
    """CPU :class:`BranchCache` storage built in this block (in this thread) comes from, and goes
    back to, a pool kept between blocks. Only for code that keeps no cache, nor any view of one,
    past the block: the decoders wrap each ``generate`` in it. Nested blocks are one block."""
    with _POOL.lend():
        yield


def release_pooled_storage() -> None:
    """Free the CPU K/V storage kept for the next decode (see :func:`reuse_storage`)."""
    _POOL.release()


def _stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as the cache keeps it: without autograd history (only a forward outside inference mode
    and ``no_grad`` carries one) and in the cache's dtype. Returned as is when it already is: a
    window forward writes every layer, and a no-op ``detach``/``to`` is still a call on the host."""
    if t.requires_grad:
        t = t.detach()
    return t if t.dtype == dtype else t.to(dtype)


def checked_padding_mask(mask: torch.Tensor) -> torch.Tensor:
    """A ``[B, L]`` padding mask as bool, refused unless it holds 0 and 1 only. Why: ``.bool()`` reads 0.5 or 2 as 1,
    where the official codes add ``(1 - mask) * min`` to the scores (0.5 masks the key, 2 overflows): a weighting is
    not a padding mask. A bool mask (what the decoders pass) is returned as it is, without a host sync."""
    if mask.dtype == torch.bool:
        return mask
    as_bool = mask.bool()
    odd = as_bool != mask
    if bool(odd.any()):
        raise ValueError(
            "attention_mask must hold 0 (padding) and 1 (a token) only, as the tokenizer returns it; got "
            f"{sorted(set(mask[odd].tolist()))[:3]}."
        )
    return as_bool


def _row_numbers(name: str, rows: torch.Tensor | list[int] | int, device: torch.device) -> torch.Tensor:
    """``rows`` (a tensor, a list or an int) as a 1-d long tensor of row numbers, refused unless its dtype is an
    integer one. Why: ``as_tensor(..., dtype=long)`` reads a bool mask ``[True, False, True]`` as the rows 1, 0, 1
    and truncates 0.9 to row 0, a silent wrong copy. Only the dtype and the shape are checked, which needs no host
    sync: the row operations run on most decoding steps, so what the decoders pass (a 1-d long tensor on the
    cache's device) is answered first, with three reads of its metadata."""
    if isinstance(rows, torch.Tensor) and rows.dtype is torch.long and len(rows.shape) == 1 and rows.device == device:
        return rows
    if not isinstance(rows, torch.Tensor):
        try:
            rows = torch.as_tensor(rows)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"{name} must be row numbers (a 1-d integer tensor, a list of ints or an int), got "
                            f"{type(rows).__name__}.") from e  # fmt: skip
        if rows.numel() == 0:  # as_tensor([]) is float32
            rows = rows.long()
    if rows.dtype == torch.bool or rows.is_floating_point() or rows.is_complex():
        hint = " (for a bool mask, pass mask.nonzero().squeeze(1))" if rows.dtype == torch.bool else ""
        raise TypeError(f"{name} must hold integer row numbers, got dtype {rows.dtype}{hint}.")
    if rows.dim() > 1:
        raise ValueError(f"{name} must be a 1-d list of row numbers, got shape {tuple(rows.shape)}.")
    return rows.reshape(-1).to(device=device, dtype=torch.long)


def _check_rows_in_range(name: str, rows: list[int], num_rows: int) -> None:
    """Refuse row numbers outside ``[0, num_rows)``, given as a list already on the host (no sync of its own),
    before anything is written: negative rows do not count from the end here."""
    bad = [r for r in rows if not 0 <= r < num_rows]
    if bad:
        raise ValueError(f"{name} holds rows {bad[:3]} outside the cache's rows 0..{num_rows - 1}.")


class BranchCacheLayer(CacheLayerMixin):
    """K/V of one layer for all rows: ``keys``/``values`` of shape ``[R, L, H_kv, D]``."""

    is_compileable = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor,
                 rewritten: Callable[[torch.Tensor | None], None] | None = None) -> None:  # fmt: skip
        """Point the layer at ``keys``/``values`` (:meth:`point_at`); ``rewritten`` is told the rows each write
        changes."""
        super().__init__()
        self.point_at(keys, values)
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device
        self._rewritten = rewritten  # told which rows a write changed (the cache's row versions)

    def point_at(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold ``keys``/``values`` ``[R, L, H_kv, D]`` and their ``[R * L, H_kv, D]`` views, which window
        forwards scatter into (a layer's rows are one contiguous run, also in a prefix of its rows)."""
        self.keys, self.values = keys, values
        self.flat_keys, self.flat_values = keys.view(-1, *keys.shape[2:]), values.view(-1, *values.shape[2:])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Never needed: the layer is preallocated when the cache is built."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace the whole layer (full-canvas forward over every row)."""
        self.keys.copy_(key_states.detach())
        self.values.copy_(value_states.detach())
        if self._rewritten is not None:
            self._rewritten(None)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(L, 0)``, key length and offset, for any query: queries see the whole preallocated canvas."""
        return self.keys.shape[1], 0

    def get_seq_length(self) -> int:
        """``L``: a layer is preallocated at the canvas length, so it is always full."""
        return self.keys.shape[1]

    def get_max_length(self) -> int:
        """``L``: a canvas never grows."""
        return self.keys.shape[1]


class BranchCache(Cache):
    """Preallocated K/V for ``num_rows`` canvases of ``length`` positions.

    The storage is allocated uninitialized (``torch.empty``), as every decoder fills it before it
    reads it: a masked-diffusion decode starts with a full forward, which writes every position of
    its rows (left padding included), and the other rows receive copies of written rows
    (``broadcast_rows``, ``copy_rows``). Zeroing it first would cost a pass over memory that no read
    needs, and
    ``tests/test_cache.py`` checks that a NaN-filled storage decodes the same tokens. Write a row
    with a full forward (``model(canvas, cache=cache, cache_rows=...)``) before a window forward
    reads it. Inside :func:`reuse_storage` (every ``generate`` call), CPU storage comes from a pool
    kept between calls, which spares the page faults of fresh memory.

    Args:
        num_layers, num_rows, length, num_kv_heads, head_dim: geometry.
        attention_mask: ``[R, L]`` (1 = real token, 0 = left padding); ``None`` means no padding.
        model_type: the ``config.model_type`` this cache was built for; forwards of another model
            type refuse it (a cache is only meaningful for the weights that filled it).
    """

    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        length: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        attention_mask: torch.Tensor | None = None,
        model_type: str | None = None,
    ) -> None:
        """Check the geometry, ``dtype`` and ``device``, then allocate the storage uninitialized (inside
        :func:`reuse_storage`, CPU storage from its pool), each row its own version; no ``attention_mask``:
        no padding."""
        # sizes < 1 would fail later with an IndexError (no layers) or a negative dimension inside torch
        sizes = {"num_layers": num_layers, "num_rows": num_rows, "length": length, "num_kv_heads": num_kv_heads,
                 "head_dim": head_dim}  # fmt: skip
        for name, size in sizes.items():
            check_positive_int(name, size)
        # torch said "empty(): argument 'dtype' must be torch.dtype, not str", or listed every device type it knows.
        # A name is refused, not read: transformers' own caches take a torch.dtype too (only from_pretrained reads
        # names). A model's new_cache() passes its torch.device, which needs no check.
        if not isinstance(dtype, torch.dtype) or dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be a floating torch.dtype ({', '.join(map(str, COMPUTE_DTYPES))}), got "
                             f"{dtype!r}: pass e.g. torch.float16, or build the cache with model.new_cache().")  # fmt: skip
        if not isinstance(device, torch.device):
            check_device(device)
        shape = (num_layers, 2, num_rows, length, num_kv_heads, head_dim)
        on_cpu = (torch.device(device) if device is not None else torch.get_default_device()).type == "cpu"
        if _POOL.lending is not None and on_cpu:
            storage = _POOL.take(math.prod(shape), dtype).view(shape)
        else:
            storage = torch.empty(shape, dtype=dtype, device=device)
        super().__init__(layers=[BranchCacheLayer(storage[i, 0], storage[i, 1], self.rewritten)
                                 for i in range(num_layers)])  # fmt: skip
        self._set_storage(storage, point=False)  # the layers were just built on it
        # uninitialized rows: every one its own version (see the class docstring); the next fresh versions from here
        self.row_version = torch.arange(num_rows, device=device)
        self._next_version = num_rows
        self.model_type = model_type
        if attention_mask is None:
            attention_mask = torch.ones(num_rows, length, dtype=torch.bool, device=device)
        self.set_attention_mask(attention_mask.to(device))

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_model(
        cls,
        config: LLaDAConfig | DreamConfig,
        num_rows: int,
        length: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> BranchCache:
        """Build an empty cache with the geometry of a model config (see ``models.base``)."""
        geometry = config.kv_geometry()
        return cls(
            geometry["num_layers"],
            num_rows,
            length,
            geometry["num_kv_heads"],
            geometry["head_dim"],
            dtype=dtype or torch.float32,
            device=device,
            attention_mask=attention_mask,
            model_type=config.model_type,
        )

    def _set_storage(self, storage: torch.Tensor, base: torch.Tensor | None = None, point: bool = True) -> None:
        """Point every layer (unless ``point`` is off) at its slice of ``storage`` ``[layers, 2, R, L, H, D]``,
        the first rows of the contiguous ``base`` (itself when ``None``; a prefix after :meth:`keep_rows`)."""
        self.storage = storage
        # Gathers and scatters across rows index the contiguous base, where a row or a flat
        # ``row * L + position`` slot sits at the same index: on CPUs, ``index_select`` along a
        # middle dimension of the prefix view (non-contiguous) first copies the whole storage,
        # 40 ms for a 100-row tiny-model cache against 0.1 ms on the base.
        self._base = storage if base is None else base
        self._row_views: list[torch.Tensor] | None = None  # built on first use, per storage
        if point:
            for i, layer in enumerate(self.layers):
                layer.point_at(storage[i, 0], storage[i, 1])

    def set_attention_mask(self, attention_mask: torch.Tensor) -> None:
        """Set the key-padding mask; RoPE positions follow it so padding never shifts positions."""
        if attention_mask.shape != (self.num_rows, self.length):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but the cache holds "
                f"{self.num_rows} rows of length {self.length}."
            )
        mask = checked_padding_mask(attention_mask)
        # Left padding only: the varlen backends see each row as [padding | tokens], and RoPE
        # positions start at the first real token. One check per mask change, not per step.
        if mask.shape[1] > 1 and bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError(
                "attention_mask must be left-padded (zeros, then ones, in every row); pad prompts on the "
                "left, e.g. tokenizer(..., padding=True, padding_side='left')."
            )
        if not bool(mask.any(-1).all()):
            raise ValueError("Every row of attention_mask needs at least one real token.")
        self.key_mask = mask
        self.position_ids = (self.key_mask.long().cumsum(-1) - 1).clamp_min(0)
        # A cheap flag lets the attention backends skip masking when no row is padded. It costs
        # one host sync, here, once per mask change, never per step.
        self.has_padding = bool((~self.key_mask).any())

    # ------------------------------------------------------------------ geometry
    @property
    def num_rows(self) -> int:
        """``R``, the rows the cache holds now: :meth:`keep_rows` lowers it (the allocation may hold more)."""
        return self.layers[0].keys.shape[0]

    @property
    def length(self) -> int:
        """``L``, the canvas length (prompt and answer positions, left padding included); fixed at construction."""
        return self.layers[0].keys.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype K/V are stored in: writes cast a forward's K/V to it."""
        return self.layers[0].keys.dtype

    @property
    def device(self) -> torch.device:
        """The device of the K/V storage, where row numbers given to the row operations are moved."""
        return self.layers[0].keys.device

    def nbytes(self) -> int:
        """Bytes of K/V in the cache's rows (the mask and positions are negligible). Dropping rows
        with :meth:`keep_rows` in ascending order keeps the allocation until the cache is freed."""
        return self.storage.nbytes

    # ------------------------------------------------------------------ writes
    def rewritten(self, rows: torch.Tensor | None) -> None:
        """Rows whose K/V a write changed (``None``: all): versions that no row holds, one per row, so that a
        later :meth:`copy_rows` copies them. (Each call's versions lie above every earlier call's.)"""
        base = self._next_version
        if rows is None:
            self.row_version = torch.arange(base, base + self.num_rows, device=self.row_version.device)
        else:
            self.row_version.index_copy_(0, rows, rows + base)
        self._next_version = base + self._base.shape[2]  # a row index is below the allocation's row count

    def write_rows(
        self, layer_idx: int, rows: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Overwrite whole rows of one layer (a full-canvas forward over ``rows``). A forward writes
        every layer, the first one first: the rows' versions change there."""
        if layer_idx == 0:
            self.rewritten(rows)
        layer = self.layers[layer_idx]
        keys, values = _stored(keys, layer.dtype), _stored(values, layer.dtype)
        if rows is None:
            layer.keys.copy_(keys)
            layer.values.copy_(values)
        else:
            layer.keys.index_copy_(0, rows, keys)
            layer.values.index_copy_(0, rows, values)

    def write_tokens(
        self, layer_idx: int, flat_slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write packed K/V ``[T, H_kv, D]`` at flat slots ``row * L + position`` (a window forward):
        two calls per layer, on flat views made once per storage. The rows' versions change at the
        first layer (a forward writes every layer, the first one first)."""
        if layer_idx == 0:
            self.rewritten(flat_slots // self.length)
        layer = self.layers[layer_idx]
        layer.flat_keys.index_copy_(0, flat_slots, _stored(keys, layer.dtype))
        layer.flat_values.index_copy_(0, flat_slots, _stored(values, layer.dtype))

    # ------------------------------------------------------------------ row operations
    def _slabs(self) -> torch.Tensor:
        """The storage as ``[layers * 2, R, L * H * D]``: a row is one contiguous run per slab (the
        storage may be a prefix of its rows after :meth:`keep_rows`, still a view)."""
        return self.storage.view(self.storage.shape[0] * 2, self.num_rows, -1)

    def _base_slabs(self, positions: bool = False) -> torch.Tensor:
        """The contiguous base as ``[layers * 2, R_base, L * H * D]``, or with ``positions``
        ``[layers * 2, R_base * L, H * D]``: rows ``< R`` (slots ``< R * L``) are this cache's."""
        shape = (self._base.shape[0] * 2, self._base.shape[2] * (self.length if positions else 1), -1)
        return self._base.view(shape)

    def _rows(self) -> list[torch.Tensor]:
        """One ``[layers * 2, L * H * D]`` view per row, made once per storage: a row copy is then
        a single ``copy_``, not two selects and a copy."""
        if self._row_views is None:
            self._row_views = list(self._slabs().unbind(1))
        return self._row_views

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, same_mask: bool = False) -> None:
        """``row[dst[i]] = row[src[i]]`` for every layer (a leader sync).

        ``dst`` must not repeat; ``src`` may (one leader copied into several rows). With
        ``same_mask`` the caller promises that ``src`` and ``dst`` rows already share their padding
        mask (branches of one request), and only K/V are copied. A destination that holds its
        source's version already holds its K/V (see the class docstring): only the others are copied.
        """
        src, dst = _row_numbers("src", src, self.device), _row_numbers("dst", dst, self.device)
        if src.shape != dst.shape:
            raise ValueError(f"copy_rows: src has {src.numel()} rows but dst has {dst.numel()}.")
        # the versions are read at clamped rows, so that a row out of range reaches the check below (on a GPU an
        # index_select out of range is a device-side assert, fatal to the process) before anything is written
        last = self.num_rows - 1
        version = self.row_version.index_select(0, src.clamp(0, last))
        stale = version != self.row_version.index_select(0, dst.clamp(0, last))
        # one read back to the host for the pairs and which of them differ
        triples = torch.stack((src, dst, stale.long())).T.tolist()
        _check_rows_in_range("src", [s for s, _, _ in triples], self.num_rows)
        dst_rows = [d for _, d, _ in triples]
        _check_rows_in_range("dst", dst_rows, self.num_rows)
        if len(set(dst_rows)) != len(dst_rows):
            raise ValueError(f"copy_rows: dst repeats a row ({dst_rows[:8]}); each row can take one source.")
        pairs = [(s, d) for s, d, differ in triples if differ]
        if pairs and not {s for s, _ in pairs} & {d for _, d in pairs}:
            # One strided copy per row, on every device: a single pass over memory where index_select
            # followed by index_copy_ makes two, and no temporary of the copied rows (on a GPU, a
            # draft's rows copied after refreshes of many requests at once would need as many cache
            # rows again). Only when no row is both a source and a destination: each must read its
            # source's old row.
            row = self._rows()
            for s_row, d_row in pairs:
                row[d_row].copy_(row[s_row])
        elif pairs:
            base = self._base_slabs()
            base.index_copy_(1, dst, base.index_select(1, src))
        self.row_version.index_copy_(0, dst, version)
        if not same_mask:
            self.key_mask.index_copy_(0, dst, self.key_mask.index_select(0, src))
            self.position_ids.index_copy_(0, dst, self.position_ids.index_select(0, src))

    def copy_positions(self, src: torch.Tensor, dst: torch.Tensor, where: torch.Tensor) -> None:
        """``row[dst[i]][p] = row[src[i]][p]`` for every layer and every position ``p`` where the
        ``[n, L]`` bool ``where[i]`` holds: a lookahead draft row takes back its main row's K/V where
        it wrote its own, and a main row takes an adopted draft's. Only K/V; no position of a ``dst``
        row may also be read from it as a ``src`` (rows of one call are disjoint). One gather and one
        scatter over flat ``row * L + position`` slots: the data moved is the positions, not rows.
        Nothing to take (most of a draft row's take-backs at batch 1) writes nothing and keeps the rows' versions.

        The dtypes and shapes are checked (no host sync: this runs every lookahead step): a ``where`` wider than
        the canvas would address another row's slots. Rows out of range are read back only when the copy fails on
        them (a ValueError naming them): the slots are those of this cache's rows, not of its whole allocation, which
        after :meth:`keep_rows` (or reused storage) holds more rows, so a row past the cache's last read a dropped
        row's K/V in silence, or wrote outside the cache. On a GPU such an index is a device-side assert."""
        src, dst = _row_numbers("src", src, self.device), _row_numbers("dst", dst, self.device)
        if src.shape != dst.shape:
            raise ValueError(f"copy_positions: src has {src.numel()} rows but dst has {dst.numel()}.")
        if where.dtype != torch.bool or where.shape != (src.shape[0], self.length):
            raise ValueError(f"copy_positions: where must be a bool tensor of shape [len(src), length] = "
                             f"[{src.shape[0]}, {self.length}], got {where.dtype} of shape {tuple(where.shape)}.")  # fmt: skip
        i, p = where.nonzero(as_tuple=True)
        if not i.numel():  # (nonzero has read its count back already: no sync of its own)
            return
        flat = self._base_slabs(positions=True)[:, : self.num_rows * self.length]  # this cache's slots only
        try:
            taken = flat.index_select(1, torch.add(p, src[i], alpha=self.length))
            # along dim 0 of the transposed view: 1.6x faster on CPUs than along dim 1
            flat.transpose(0, 1).index_copy_(0, torch.add(p, dst[i], alpha=self.length), taken.transpose(0, 1))
        except (IndexError, RuntimeError):  # torch's message counts flat slots: name the rows, when they are the cause
            _check_rows_in_range("src", src.tolist(), self.num_rows)
            _check_rows_in_range("dst", dst.tolist(), self.num_rows)
            raise
        self.rewritten(dst)

    def broadcast_rows(self, group: int) -> None:
        """Copy the first row of every run of ``group`` consecutive rows into the other rows of the
        run (BlockBatch's initial forward: one row per request, K/V shared by its branches, whose
        padding masks are already equal). One strided copy for the whole cache. ``group`` must divide
        the number of rows (a group that does not would fail inside ``view``, 0 by dividing by zero)."""
        check_positive_int("group", group)
        if self.num_rows % group:
            raise ValueError(f"broadcast_rows: group={group} does not divide the cache's {self.num_rows} rows.")
        slabs = self._slabs()
        runs = slabs.view(slabs.shape[0], self.num_rows // group, group, -1)
        runs[:, :, 1:].copy_(runs[:, :, :1].expand(-1, -1, group - 1, -1))
        version = self.row_version.view(-1, group)
        version[:, 1:] = version[:, :1]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (in that order), e.g. drop the rows of finished requests.

        Ascending rows (dropping finished requests) are moved down inside the existing storage, one
        strided copy per moved row, on every device. A fresh allocation of the kept rows would live
        beside the whole cache until the copy ends: 1.5x the cache at the first drop, on a GPU whose
        batch was sized to what fits (a drafted request holds 4 rows), and on a CPU page faults as
        well. The copies run in stream order, and a source row is never overwritten before it is
        read. Rows in any other order (``reorder_cache``) are gathered into new storage.

        ``rows`` are row numbers (integers in ``[0, num_rows)``), not a bool mask: one is refused, as are rows out
        of range, before anything is moved (this runs when requests retire, and reads the rows back anyway).
        """
        rows = _row_numbers("rows", rows, self.device)
        slabs = self._slabs()
        kept_rows = rows.tolist()
        _check_rows_in_range("rows", kept_rows, self.num_rows)
        if all(a < b for a, b in zip(kept_rows, kept_rows[1:])):
            row = self._rows()
            for i, r in enumerate(kept_rows):  # r >= i: a source is never overwritten before it is read
                if r != i:
                    row[i].copy_(row[r])
            self._set_storage(self.storage[:, :, : len(kept_rows)], base=self._base)
        else:
            kept = slabs.new_empty(slabs.shape[0], rows.shape[0], slabs.shape[2])
            for i in range(slabs.shape[0]):  # dim-0 index_select per slab: ~3x faster on CPUs than one on dim 1
                torch.index_select(slabs[i], 0, rows, out=kept[i])
            self._set_storage(kept.view(*self.storage.shape[:2], rows.shape[0], *self.storage.shape[3:]))
        # kept rows keep their (validated) masks and positions, and their versions
        self.row_version = self.row_version.index_select(0, rows)
        self.key_mask = self.key_mask.index_select(0, rows)
        self.position_ids = self.position_ids.index_select(0, rows)
        self.has_padding = bool((~self.key_mask).any())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """transformers' beam-search hook, which means the same as :meth:`keep_rows`."""
        self.keep_rows(beam_idx)

    def __repr__(self) -> str:
        """The geometry, dtype and model type, never the K/V themselves (a cache can hold gigabytes)."""
        return (
            f"BranchCache(layers={len(self.layers)}, rows={self.num_rows}, length={self.length}, "
            f"kv_heads={self.layers[0].keys.shape[2]}, head_dim={self.layers[0].keys.shape[3]}, "
            f"dtype={self.dtype}, model_type={self.model_type!r})"
        )
