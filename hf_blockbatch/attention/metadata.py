"""Packing metadata for a window forward, built once per step and shared by every layer.

A window forward sends, for each active cache row ``r``, the query positions
``[start_r, end_r)``; the queries of all rows travel as one packed buffer of ``T = Σ lengths``
tokens, so the cost follows the sum of the window lengths, not rows × the longest window.
Everything a backend needs to map that buffer onto the cache is computed here, once, in the
style of vLLM's attention metadata: a layer never recomputes indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_blockbatch.cache import BranchCache

__all__ = [
    "GROUP_CALL_COST", "LengthGroup", "WindowBatch", "build_query_batch", "build_window_batch", "pack_ranges",
    "packed_index",
]


def packed_index(valid: torch.Tensor) -> torch.Tensor:
    """For a padded ``[A, W]`` view whose real slots are ``valid``, the row-major packed index of
    each slot (0 where invalid)."""
    return (valid.reshape(-1).cumsum(0) - 1).clamp_min(0).reshape(valid.shape)


def pack_ranges(
    starts: torch.Tensor, lengths: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack per-row ranges ``[start, start + length)`` into one buffer, row-major.

    Returns ``(token_row, token_col, token_pos, pad_index, pad_valid)``: for each packed token its
    row (local index), its slot in that row's range and its position; for the padded
    ``[A, max_len]`` view of the same tokens, the packed index of each slot (0 where invalid) and
    which slots are real. ``token_row`` and ``token_col`` index the padded view directly, so
    unpadding never needs a boolean mask (which would sync the host with the device).
    """
    offsets = torch.arange(max_len, device=starts.device)
    pad_valid = offsets[None, :] < lengths[:, None]
    token_row = torch.arange(starts.shape[0], device=starts.device)[:, None].expand_as(pad_valid)[pad_valid]
    token_col = offsets.expand_as(pad_valid)[pad_valid]
    return token_row, token_col, starts[token_row] + token_col, packed_index(pad_valid), pad_valid


#: ``sdpa_grouped`` pads a group's shorter query rows to its widest while that is cheaper than one more
#: attention call. A call (the rows' gathers, SDPA's own setup, the scatter back) costs about as much
#: as this many units of padded attention work, a unit being one padded query slot x one key x one
#: (head x head dimension) entry. Measured on this project's CPUs (``benchmarks/attention_cpu.py
#: --groups``): 25 us a call against 0.064-0.071 ns a unit, 3.7-4.0e5 units. So on the tiny models
#: (160 keys, 4 heads of 32) a call is worth ~20 padded slots, and at a realistic width (600 keys, 32
#: heads of 128) far less than one: there every query count keeps its own call (RESULTS §27, §51).
#: (Until §51 the fit counted each extra group's own queries as the call's cost: 1.0e6, which padded a
#: batch-1 step with drafts by 55-75 % of its query slots.)
GROUP_CALL_COST = 4.0e5


@dataclass(frozen=True)
class LengthGroup:
    """Rows of a step attended in one SDPA call, padded to the group's widest query row ``width``:
    what ``sdpa_grouped`` needs, built once per step for every layer."""

    index: torch.Tensor  # [count * width] packed query of each slot, row-major (a padded slot repeats a real query)
    count: int  # rows in the group
    width: int  # query slots per row
    rows: torch.Tensor | None  # [count] cache rows to gather (None: read through ``view``)
    view: slice | None  # the rows as a strided slice of the cache (evenly spaced rows), else None
    key_mask: torch.Tensor | None  # [count, 1, 1, L] valid keys, as SDPA takes them; None if no padding
    real: torch.Tensor | None  # [n] the slots holding a real query (None: all of them)
    target: torch.Tensor  # [n] their packed query index, where the group's outputs go (``index`` when unpadded)


@dataclass
class WindowBatch:
    """Where the packed queries of one window forward come from and go to.

    Shapes: ``A`` active rows, ``T`` packed query tokens, ``W`` the longest window.
    """

    rows: torch.Tensor  # [A] cache rows, ascending
    starts: torch.Tensor  # [A] first query position of each row
    lengths: torch.Tensor  # [A] query count of each row
    cu_seqlens: torch.Tensor  # [A+1] int32 cumulative lengths of the packed queries
    max_len: int  # W
    token_rows: torch.Tensor  # [T] cache row of each query
    token_local: torch.Tensor  # [T] active-row index (0..A-1) of each query
    token_col: torch.Tensor  # [T] slot of each query in its row's padded window: the padded view is [token_local, token_col]
    token_pos: torch.Tensor  # [T] canvas position of each query
    flat_slots: torch.Tensor  # [T] row * L + position: where each query's K/V goes in the cache
    rope_pos: torch.Tensor  # [T] RoPE position (padding-corrected) of each query
    pad_index: torch.Tensor  # [A, W] packed index of each padded slot (0 where invalid)
    pad_valid: torch.Tensor  # [A, W] which padded slots hold a real query
    key_mask: torch.Tensor | None  # [A, L] valid keys of the active rows; None if no padding
    all_rows: bool  # the active rows are every cache row, in order (no gather needed)
    num_rows: int  # rows in the cache
    length: int  # L
    row_valid: torch.Tensor  # [R] real (non-padding) tokens in each cache row
    # variable-length kernels see every cache row as two key segments (its left padding, with
    # zero queries, then its real tokens), so padded keys are never attended and the cache is
    # read in place, with no per-layer gather
    seg_cu_q: torch.Tensor | None = None  # [2R+1] int32
    seg_cu_k: torch.Tensor | None = None  # [2R+1] int32
    # echoes (a query forward's ``echo``): the K/V of some packed queries are also written at flat
    # slots of other rows, before any row attends, so those rows see them as cached K/V (a lookahead
    # draft row sees what its main row computes in the same forward). Each layer then writes once:
    # the packed K/V gathered by ``write_src`` [T + E] (every query, then each echo's source) at
    # ``write_slots`` [T + E] (``flat_slots``, then the echoes' slots); None without echoes
    write_src: torch.Tensor | None = None
    write_slots: torch.Tensor | None = None

    # the rows grouped for the grouped SDPA backend, built lazily once per step: (unit, groups)
    length_groups_: tuple[int, list[LengthGroup]] | None = None

    @property
    def num_tokens(self) -> int:
        """``T``: the step's packed queries, every active row's window together."""
        return self.token_pos.shape[0]

    def length_groups(self, unit: int = 0) -> list[LengthGroup]:
        """The step's rows as :class:`LengthGroup` s, built once per step (one host sync) with every
        index and mask a layer needs, so that a layer's work per group is its gathers, one attention
        call and one scatter. Rows are taken widest first; a row joins the current group, padded to
        its width, while the padded work ``rows x (width - own) x L x unit`` (``unit``: heads x head
        dimension) costs less than another call (:data:`GROUP_CALL_COST`), else it starts a group.
        ``unit`` 0: one group per distinct query count (no padding). A step with lookahead drafts has
        a dozen query counts: on a CPU at the tiny models' width, grouping by count alone made a
        batch-1 step call SDPA once per row in each layer."""
        if self.length_groups_ is None or self.length_groups_[0] != unit:
            lengths, rows = self.lengths.tolist(), self.rows.tolist()
            by_width: dict[int, list[int]] = {}
            for i, n in enumerate(lengths):
                by_width.setdefault(n, []).append(i)
            budget = GROUP_CALL_COST / (self.length * unit) if unit else 0.0  # padded slots a call is worth
            plan: list[tuple[int, list[int]]] = []  # (width, local rows)
            for w in sorted(by_width, reverse=True):
                if plan and len(by_width[w]) * (plan[-1][0] - w) <= budget:
                    plan[-1][1].extend(by_width[w])
                else:
                    plan.append((w, list(by_width[w])))
            groups = []
            for w, idx in plan:
                idx.sort()
                local = torch.tensor(idx, device=self.rows.device)
                cache_rows = [rows[i] for i in idx]
                step = cache_rows[1] - cache_rows[0] if len(cache_rows) > 1 else 1
                even = step > 0 and all(b - a == step for a, b in zip(cache_rows, cache_rows[1:]))
                view = slice(cache_rows[0], cache_rows[-1] + 1, step) if even else None
                key_mask = None if self.key_mask is None else self.key_mask[local][:, None, None, :]
                index = self.pad_index[local, :w].reshape(-1)
                real, target = None, index
                if any(lengths[i] != w for i in idx):  # padded: only the real slots go back
                    real = self.pad_valid[local, :w].reshape(-1).nonzero().squeeze(1)
                    target = index[real]
                groups.append(LengthGroup(index, len(idx), w, None if even else self.rows[local], view, key_mask,
                                          real, target))  # fmt: skip
            self.length_groups_ = (unit, groups)
        return self.length_groups_[1]

    def ensure_segments(self) -> None:
        """Build the two-segments-per-row layout for the varlen kernels (lazily, once per step)."""
        if self.seg_cu_q is not None:
            return
        device = self.rows.device
        q_per_row = torch.zeros(self.num_rows, dtype=torch.int32, device=device)
        q_per_row.index_copy_(0, self.rows, self.lengths.to(torch.int32))
        valid = self.row_valid.to(torch.int32)
        k_seg = torch.stack([self.length - valid, valid], dim=1).reshape(-1)
        q_seg = torch.stack([torch.zeros_like(q_per_row), q_per_row], dim=1).reshape(-1)
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        self.seg_cu_q = torch.cat([zero, q_seg.cumsum(0).to(torch.int32)])
        self.seg_cu_k = torch.cat([zero, k_seg.cumsum(0).to(torch.int32)])


def _check_rows(cache: BranchCache, rows: torch.Tensor | Sequence[int] | None, count: int) -> tuple[torch.Tensor, bool]:
    """``(rows, all_rows)`` as ascending cache rows, one per window."""
    all_rows = rows is None
    if rows is None:
        rows = torch.arange(cache.num_rows, device=cache.device)
    else:
        rows = torch.as_tensor(rows, device=cache.device, dtype=torch.long).reshape(-1)
    if rows.shape[0] != count:
        raise ValueError(
            f"Got {rows.shape[0]} rows but {count} windows: give one [start, end) window per row (one query row for a query forward)."
        )
    if rows.numel() == 0:
        raise ValueError("A window forward needs at least one row.")
    return rows, all_rows


def _batch(cache: BranchCache, rows: torch.Tensor, all_rows: bool, starts: torch.Tensor, lengths: torch.Tensor,
           packed: tuple[torch.Tensor, ...], max_len: int) -> WindowBatch:  # fmt: skip
    """The shared tail of both builders: ``packed`` is ``pack_ranges``' output for the queries."""
    if not all_rows and rows.shape[0] == cache.num_rows:
        all_rows = True  # strictly increasing and complete means arange
    local_rows, token_col, token_pos, pad_index, pad_valid = packed
    token_rows = rows[local_rows]
    cu = torch.zeros(rows.shape[0] + 1, dtype=torch.int32, device=cache.device)
    cu[1:] = lengths.cumsum(0).to(torch.int32)
    key_mask = None
    if cache.has_padding:
        key_mask = cache.key_mask if all_rows else cache.key_mask.index_select(0, rows)
    return WindowBatch(
        rows=rows,
        starts=starts,
        lengths=lengths,
        cu_seqlens=cu,
        max_len=max_len,
        token_rows=token_rows,
        token_local=local_rows,
        token_col=token_col,
        token_pos=token_pos,
        flat_slots=token_rows * cache.length + token_pos,
        rope_pos=cache.position_ids[token_rows, token_pos],
        pad_index=pad_index,
        pad_valid=pad_valid,
        key_mask=key_mask,
        all_rows=all_rows,
        num_rows=cache.num_rows,
        length=cache.length,
        row_valid=cache.key_mask.sum(-1),
    )


def _rows_error(cache: BranchCache, rows: torch.Tensor) -> ValueError:
    return ValueError(
        f"rows must be strictly increasing indices into the cache's {cache.num_rows} rows; got {rows.tolist()}."
    )


def _unsorted(rows: torch.Tensor) -> torch.Tensor:
    return (rows[1:] <= rows[:-1]).sum() if rows.numel() > 1 else rows.new_zeros(())


def build_window_batch(
    cache: BranchCache,
    starts: torch.Tensor | Sequence[int],
    ends: torch.Tensor | Sequence[int],
    rows: torch.Tensor | Sequence[int] | None = None,
) -> WindowBatch:
    """Validate the windows and build the packing metadata.

    Args:
        cache: the cache the windows read and write.
        starts, ends: ``[A]`` query windows ``[start, end)`` in canvas positions.
        rows: ``[A]`` ascending cache rows; ``None`` means every row, in order.
    """
    device = cache.device
    starts = torch.as_tensor(starts, device=device, dtype=torch.long).reshape(-1)
    ends = torch.as_tensor(ends, device=device, dtype=torch.long).reshape(-1)
    if starts.shape[0] != ends.shape[0]:
        raise ValueError(
            f"Got {starts.shape[0]} window starts and {ends.shape[0]} window ends: give one [start, end) window per row."
        )
    rows, all_rows = _check_rows(cache, rows, starts.shape[0])
    lengths = ends - starts
    # one host sync for all checks and the packed size: once per step, never per token
    stats = torch.stack(
        [starts.min(), ends.max(), lengths.min(), lengths.max(), lengths.sum(), rows.min(), rows.max(), _unsorted(rows)]
    ).tolist()
    s_min, e_max, len_min, len_max, total, r_min, r_max, unsorted = stats
    if s_min < 0 or e_max > cache.length or len_min <= 0:
        raise ValueError(
            f"Every window must satisfy 0 <= start < end <= {cache.length} (the canvas length); got starts "
            f"{starts.tolist()} and ends {ends.tolist()}."
        )
    if r_min < 0 or r_max >= cache.num_rows or unsorted:
        raise _rows_error(cache, rows)
    W = int(len_max)
    wb = _batch(cache, rows, all_rows, starts, lengths, pack_ranges(starts, lengths, W), W)
    assert wb.num_tokens == total
    return wb


def build_query_batch(
    cache: BranchCache, query_mask: torch.Tensor, rows: torch.Tensor | Sequence[int] | None = None
) -> WindowBatch:
    """The packing metadata of a forward whose queries are any set of positions per row.

    ``query_mask`` is ``[A, L]`` bool over canvas positions. The queries of a row are packed in
    increasing position order; a backend sees the same layout as for windows (a row of ``n``
    queries is a padded row of length ``n``), so every backend serves both: attention is
    bidirectional over the whole cache row, and a query's position only enters through RoPE and the
    slot its K/V are written to.
    """
    if query_mask.dim() != 2 or query_mask.shape[1] != cache.length or query_mask.dtype != torch.bool:
        raise ValueError(
            f"query_mask must be a bool [rows, {cache.length}] (one entry per canvas position), got "
            f"{query_mask.dtype} {tuple(query_mask.shape)}."
        )
    rows, all_rows = _check_rows(cache, rows, query_mask.shape[0])
    lengths = query_mask.sum(-1)
    len_min, len_max, r_min, r_max, unsorted = torch.stack(
        [lengths.min(), lengths.max(), rows.min(), rows.max(), _unsorted(rows)]
    ).tolist()  # one host sync per step
    if len_min <= 0:
        raise ValueError("Every row of a query forward needs at least one query position (query_mask row is empty).")
    if r_min < 0 or r_max >= cache.num_rows or unsorted:
        raise _rows_error(cache, rows)
    W = int(len_max)
    offsets = torch.arange(W, device=cache.device)
    pad_valid = offsets[None, :] < lengths[:, None]
    local_rows, token_col = pad_valid.nonzero(as_tuple=True)
    token_pos = query_mask.nonzero(as_tuple=True)[1]  # row-major, as the padded view's real slots
    pad_index = packed_index(pad_valid)
    packed = (local_rows, token_col, token_pos, pad_index, pad_valid)
    return _batch(cache, rows, all_rows, token_pos[pad_index[:, 0]], lengths, packed, W)
