"""A plain restatement of the authors' bulk BlockBatch decoder, for tests and side-by-side checks.

The authors' research code (github Laurence-Wu/BlockBatch,
``llada/generate_blockBatching_original_bulk.py``) is read, never copied: this module restates
what it does in our own structure, on one request, with Python loops over branches and positions
(clarity first, speed irrelevant), using only our models' public forwards:

* ``model(x, cache=cache, cache_rows=rows)``: the initial forward and the refreshes;
* ``model.forward_windows(canvas, starts, ends, cache, rows=rows)``: the batched block step;
* ``model.new_cache(rows, length)`` and ``cache.copy_rows(src, dst, same_mask=True)``.

``docs/reference_variant.md`` spells out the algorithm and the points (a-i of issue 15, plus the
ones found while restating it) where it differs from our default BlockBatch. In short, per request:

1. **Initial forward** over one row; its K/V go to every branch row. Every branch (block sizes
   sorted ascending) resets its refresh counter, takes the probability map of every generated
   position from these logits, and applies the threshold rule to its first block.
2. Then, and after every block step: **advance** (every unfinished branch whose window has no
   mask jumps to the block of its own size holding its first mask; each jump adds one to its
   ``blocks_since_refresh``, and it is *due* when ``blocks_since_refresh * size >= refresh``),
   **merge** then **sync** (skipped while no branch has committed a token), **refresh** (one full
   forward over *every* unfinished branch, once any unfinished one is due).
3. **Block step**: one batched window forward over the unfinished branches whose window still
   holds a mask (none: no forward at all). Each such branch overwrites the map of its window,
   applies the threshold rule, and checks its window for EOS (fully decoded and holding EOS: the
   probability of EOS at the first one, softmax in bfloat16). Then, before anything else, the
   request stops if some branch has EOS: the highest EOS probability wins, ties to the smallest
   block.
4. Otherwise, once every branch is done, the branch with the most progress wins (the smallest
   block on ties, i.e. always the smallest block, as every done branch has full progress).

``decoded`` (what the leader and the sync lag use) counts only the threshold rule's commits (a
sync sets it to the leader's); merged tokens are not counted. The authors' NFE is the winner's
own forwards (initial + block steps it took part in + refreshes it took part in); ours is every
forward of the request.

Greedy decoding (temperature 0) and ``low_confidence`` remasking only: the authors' harness uses
nothing else with this decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AUTHORS_DEFAULTS", "MAP_FLOOR", "reference_blockbatch"]

#: the authors' harness defaults (``llada/eval_blockBatching.py`` and the decoder's constants)
AUTHORS_DEFAULTS = dict(block_sizes=(4, 8, 16, 32, 64), threshold=0.9, merge_threshold=0.5, sync_threshold=8,
                        refresh_interval=32)  # fmt: skip
#: the authors' probability map keeps only tokens above this probability (the others read as 0)
MAP_FLOOR = 0.1


@dataclass
class _Branch:
    row: int
    size: int
    start: int
    end: int
    done: bool = False
    progress: int = 0
    decoded: int = 0  # threshold-rule commits (+ the leader's count at a sync); merges excluded
    merged: int = 0
    blocks_since_refresh: int = 0
    refresh_due: bool = False
    probs: torch.Tensor | None = None  # [G, V] float32: the last softmax covering each generated position
    eos_hit: bool = False
    eos_prob: float = 0.0
    nfe_init: int = 0
    nfe_block: int = 0
    nfe_refresh: int = 0


def reference_blockbatch(
    model,
    prompt: list[int],
    gen_length: int,
    block_sizes=AUTHORS_DEFAULTS["block_sizes"],
    threshold: float = AUTHORS_DEFAULTS["threshold"],
    merge_threshold: float = AUTHORS_DEFAULTS["merge_threshold"],
    sync_threshold: int = AUTHORS_DEFAULTS["sync_threshold"],
    refresh_interval: int = AUTHORS_DEFAULTS["refresh_interval"],
    eos_token_id: int | None = None,
    mask_id: int | None = None,
    eos_softmax_dtype: torch.dtype = torch.bfloat16,
    stats: dict | None = None,
) -> tuple[list[int], int, int]:
    """Decode one prompt as the authors' bulk BlockBatch does.

    Returns ``(tokens, nfe_ours, nfe_authors)``: the winner's whole canvas (prompt included; after
    an EOS stop, positions past the EOS block may still hold masks), every forward of the request,
    and the winner's own forwards (the authors' count). ``stats``, when given, is filled with
    counts (winner block size, stop reason, block steps, refreshes, syncs, merged tokens, query
    tokens fed through the model).

    ``eos_token_id`` / ``mask_id`` default to the model config's (the authors read
    ``config.eos_token_id``: one id). ``eos_softmax_dtype``: the authors' winner rule takes the EOS
    probability from a bfloat16 softmax; ``torch.float32`` gives the exact probability.
    """
    cfg = model.config
    mask_id = cfg.mask_token_id if mask_id is None else mask_id
    eos_id = cfg.eos_token_id if eos_token_id is None else eos_token_id
    sizes = sorted(int(b) for b in block_sizes)
    if not prompt:
        raise ValueError("the prompt must not be empty")
    if not sizes or any(b <= 0 or gen_length % b for b in sizes):
        raise ValueError(f"every block size must divide gen_length {gen_length} (the authors' code asserts it); "
                         f"got {sizes}")  # fmt: skip
    shift = model.logit_shift
    Lp, G = len(prompt), gen_length
    L = Lp + G
    N = len(sizes)

    canvas = torch.full((N, L), mask_id, dtype=torch.long)
    canvas[:, :Lp] = torch.tensor(prompt)
    cache = model.new_cache(N, L)
    branches = [_Branch(row=i, size=b, start=Lp, end=Lp + b) for i, b in enumerate(sizes)]
    counts = dict(
        forwards=0, block_steps=0, skipped_steps=0, refreshes=0, syncs=0, query_tokens=0, mask_commits=0
    )

    # ---------------------------------------------------------------- small pieces
    def has_mask(row: int, start: int, end: int) -> bool:
        return bool((canvas[row, start:end] == mask_id).any())

    def threshold_rule(br: _Branch, logits: torch.Tensor) -> None:
        """``logits[i]`` predicts position ``br.start + i``. Proposal: argmax of the logits (the
        mask token is not excluded); confidence: its float64 softmax probability; commit every
        masked position with confidence >= threshold, and always the most confident one (the
        first in position order on ties)."""
        masked = [p for p in range(br.start, br.end) if int(canvas[br.row, p]) == mask_id]
        if not masked:
            return
        proposal, confidence = {}, {}
        for p in masked:
            lg = logits[p - br.start]
            proposal[p] = int(lg.argmax())
            confidence[p] = float(lg.double().softmax(-1)[proposal[p]])
        best = max(masked, key=lambda p: confidence[p])  # max() keeps the first maximum
        chosen = [p for p in masked if confidence[p] >= threshold or p == best]
        for p in chosen:
            canvas[br.row, p] = proposal[p]
        br.decoded += len(chosen)  # a committed mask token counts too (the position stays masked)
        counts["mask_commits"] += sum(proposal[p] == mask_id for p in chosen)

    def set_map(br: _Branch, start: int, logits: torch.Tensor) -> None:
        """The map of positions ``start ..`` becomes the float32 softmax of ``logits``."""
        if br.probs is None:
            br.probs = torch.zeros(G, logits.shape[-1])
        br.probs[start - Lp : start - Lp + logits.shape[0]] = logits.float().softmax(-1)

    def map_prob(br: _Branch, p: int, token: int) -> float:
        value = float(br.probs[p - Lp, token])
        return value if value > MAP_FLOOR else 0.0

    def snap_window(br: _Branch) -> None:
        """Window = the block of the branch's size holding its first mask (done if none)."""
        masks = (canvas[br.row, Lp:] == mask_id).nonzero().flatten().tolist()
        if not masks:
            br.done, br.start, br.end, br.progress = True, L, L, G
            return
        k = masks[0] // br.size
        br.start, br.end, br.progress = Lp + k * br.size, min(Lp + (k + 1) * br.size, L), k * br.size

    def advance(br: _Branch) -> None:
        """A finished window moves on; each move (however many blocks it jumps) counts one block."""
        snap_window(br)
        if not br.done:
            br.blocks_since_refresh += 1
            if br.blocks_since_refresh * br.size >= refresh_interval:
                br.refresh_due = True

    def advance_all() -> None:
        for br in branches:
            if not br.done and not has_mask(br.row, br.start, br.end):
                advance(br)

    def after_full_forward(br: _Branch, row_logits: torch.Tensor) -> None:
        """Initial forward and refresh: counter reset, map of every generated position, rule on
        the current window. No advance and no EOS check here."""
        br.blocks_since_refresh, br.refresh_due = 0, False
        predicting = row_logits[Lp - shift : L - shift]  # [G, V]: row i predicts position Lp + i
        set_map(br, Lp, predicting)
        threshold_rule(br, predicting[br.start - Lp : br.end - Lp])

    def leader() -> _Branch:
        return max(branches, key=lambda b: b.decoded)  # every branch, done ones too; first on ties

    def compatible(dst: _Branch, src: _Branch) -> bool:
        a, b = canvas[dst.row, Lp:], canvas[src.row, Lp:]
        both = (a != mask_id) & (b != mask_id)
        return bool((a[both] == b[both]).all())

    def merge_into(dst: _Branch, sources: list[_Branch]) -> None:
        """Scan the union of the sources' windows (each position once, sources in order); for a
        position still masked in ``dst``, take the source token ``dst``'s own map rates highest
        (first source on ties); commit it if that probability > merge_threshold."""
        seen: set[int] = set()
        filled = 0
        for src in sources:
            if src.done:
                continue
            for p in range(src.start, src.end):
                if p in seen:
                    continue
                seen.add(p)
                if int(canvas[dst.row, p]) != mask_id or not bool((dst.probs[p - Lp] > MAP_FLOOR).any()):
                    continue
                best_token, best_prob = None, 0.0
                for s in sources:
                    token = int(canvas[s.row, p])
                    if s.done or token == mask_id:
                        continue
                    prob = map_prob(dst, p, token)
                    if prob > best_prob:
                        best_token, best_prob = token, prob
                if best_token is not None and best_prob > merge_threshold:
                    canvas[dst.row, p] = best_token
                    filled += 1
        dst.merged += filled
        if filled and not dst.done and not has_mask(dst.row, dst.start, dst.end):
            advance(dst)

    def merge_and_sync() -> None:
        if leader().decoded == 0:
            return
        # destinations by decreasing window end (stable: the smaller block first on ties), each
        # taking the compatible branches after it in that order as sources
        order = sorted((b for b in branches if not b.done), key=lambda b: -b.end)
        for i, dst in enumerate(order):
            sources = [s for s in order[i + 1 :] if compatible(dst, s)]
            if sources:
                merge_into(dst, sources)
        lead = leader()
        for br in branches:
            if br is lead or br.done or lead.decoded - br.decoded <= sync_threshold:
                continue
            # canvas and K/V only: the map, EOS state and refresh counter stay the branch's own
            canvas[br.row] = canvas[lead.row]
            cache.copy_rows([lead.row], [br.row], same_mask=True)
            snap_window(br)
            br.decoded = lead.decoded
            counts["syncs"] += 1

    def refresh_if_due() -> None:
        if not any(b.refresh_due and not b.done for b in branches):
            return
        active = [b for b in branches if not b.done]
        rows = [b.row for b in active]
        logits = model(canvas[rows], cache=cache, cache_rows=torch.tensor(rows)).logits
        counts["forwards"] += 1
        counts["refreshes"] += 1
        counts["query_tokens"] += L * len(rows)
        for br, row_logits in zip(active, logits):
            br.nfe_refresh += 1
            after_full_forward(br, row_logits)

    def block_step() -> None:
        stepping = [b for b in branches if not b.done and has_mask(b.row, b.start, b.end)]
        if not stepping:
            counts["skipped_steps"] += 1
            return  # no forward at all (and nothing counted)
        out = model.forward_windows(canvas, torch.tensor([b.start for b in stepping]),
                                    torch.tensor([b.end for b in stepping]), cache,
                                    rows=torch.tensor([b.row for b in stepping]))  # fmt: skip
        counts["forwards"] += 1
        counts["block_steps"] += 1
        counts["query_tokens"] += sum(b.end - b.start + shift for b in stepping)
        cu = out.cu_seqlens.tolist()
        for j, br in enumerate(stepping):
            logits = out.logits[cu[j] : cu[j + 1]]
            br.nfe_block += 1
            set_map(br, br.start, logits)
            threshold_rule(br, logits)
            window = canvas[br.row, br.start : br.end]
            if not bool((window == mask_id).any()) and bool((window == eos_id).any()):
                first = int((window == eos_id).nonzero()[0])
                br.eos_hit = True
                br.eos_prob = float(logits[first].to(eos_softmax_dtype).softmax(-1)[eos_id])

    def finish(winner: _Branch, reason: str) -> tuple[list[int], int, int]:
        if stats is not None:
            stats.update(
                counts,
                winner_block=winner.size,
                stop=reason,
                merged_tokens=sum(b.merged for b in branches),
                nfe_winner=dict(init=winner.nfe_init, block=winner.nfe_block, refresh=winner.nfe_refresh),
            )
        nfe_authors = winner.nfe_init + winner.nfe_block + winner.nfe_refresh
        return canvas[winner.row].tolist(), counts["forwards"], nfe_authors

    # ---------------------------------------------------------------- the request
    with torch.no_grad():
        logits = model(canvas[:1], cache=cache, cache_rows=torch.tensor([0])).logits[0]
        if N > 1:
            cache.copy_rows([0] * (N - 1), list(range(1, N)), same_mask=True)
        counts["forwards"] += 1
        counts["query_tokens"] += L
        for br in branches:
            br.nfe_init += 1
            after_full_forward(br, logits)
        advance_all()
        merge_and_sync()
        refresh_if_due()

        steps = 0
        while not all(b.done for b in branches):
            steps += 1
            # each step commits >= 1 token per stepping branch, unless what it commits is the mask token
            if steps > 2 * N * G + 8:
                raise RuntimeError(
                    "no progress: the model keeps proposing the mask token for a masked position (the authors' "
                    "threshold rule does not exclude it, and their loop would never end)"
                )
            block_step()
            ready = [b for b in branches if b.eos_hit and not has_mask(b.row, b.start, b.end)]
            if ready:
                return finish(max(ready, key=lambda b: b.eos_prob), "eos")  # first maximum: smallest block
            advance_all()
            merge_and_sync()
            refresh_if_due()
    return finish(max(branches, key=lambda b: b.progress), "all_done")
