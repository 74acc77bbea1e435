"""Two other designs of keyed sampling noise, timed on the same draws as the shipped one (RESULTS §44).

Why: after the logit bound (§42) and the noise screen (§43), a keyed draw where most ids can still win costs about
as much as hashing every id: no bound on a hash skips an id unhashed. Two designs would skip the hashing, each with
another noise than ``generation/noise.py``'s (so other seeded samples, the same law):

* **inverse CDF**: one keyed uniform per slot, and the token where it falls in the float64 cumulative sum of the
  softmax at temperature T (the mask id's probability set to 0). One hash per slot instead of one per id.
* **block maxima**: each block of 64 ids first draws its largest uniform (the 64th root of a uniform, the law of the
  maximum of 64) and which id holds it (a second hash), then every other id of the block a uniform below it (its
  own hash, scaled by the maximum): the same independent uniforms in law. A block's best score is then at most its
  largest logit plus the lift of its maximum, and every block's maximum-holding id gives an exact score that the
  winner reaches, so whole blocks are skipped without hashing their ids. The same float64 operations on the same
  numbers in the pruned and the full draw: the script checks that they pick the same tokens.

Neither is in the library: this measures them against ``sampling.gumbel_tokens`` on the draws ``keyed_draw.py``
replays (seeded sparse Fast-dLLM decodes of training items on both tiny checkpoints), and on its synthetic rows:
LLaDA's vocabulary with a peaked head, and flat rows (an untrained model's) at 8,192 and 126,464 ids.

    PYTHONPATH=$PWD python benchmarks/noise_designs.py --items 16 --repeats 5

Writes ``benchmarks/results/noise_designs.json`` and ``.md``.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from keyed_draw import parse_replay, replay, replay_parser, write

from hf_blockbatch.eval.script_args import run_main
from hf_blockbatch.generation import noise, sampling

#: ids per block of the block-maxima design
BLOCK = 64
#: the block parts' offset (apart from the token ids' and the other key parts' in ``noise.py``), and as int32 bits
_BLOCK_PART = 0x9E3779B9 * 11 & noise.MASK32
_BLOCK_BITS = _BLOCK_PART - (1 << 32) if _BLOCK_PART >> 31 else _BLOCK_PART
#: a pruned block draw scores at most this share of the blocks, else every id (as the shipped draw's 10 %)
BLOCK_MAX_SHARE = 0.1


def cdf_draw(logits: torch.Tensor, temperature: float, keys: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """``[T]`` the inverse-CDF token of each row: one keyed uniform per slot, float64 cumulative probabilities."""
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    p = torch.log_softmax(scaled, dim=-1).double().exp_()
    if mask_id is not None:
        p[:, mask_id] = 0.0
    c = p.cumsum_(-1)
    u = noise.confidence_uniform(keys) * c[:, -1]
    return torch.searchsorted(c, u[:, None], right=True).squeeze(1).clamp_max_(logits.shape[1] - 1)


def _block_noise(keys: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, blocks]`` each block's largest uniform (float64) and the offset of the id that holds it."""
    parts = noise.mix32((torch.arange(blocks, device=keys.device) + _BLOCK_PART) & noise.MASK32).to(torch.int32)
    codes = noise._codes(keys[:, None], parts)
    top = noise.code_uniforms(codes).pow_(1.0 / BLOCK)
    at = noise._mix32_bits(codes.bitwise_xor_(_BLOCK_BITS)).bitwise_and_(BLOCK - 1).long()
    return top, at


def _block_uniforms(u: torch.Tensor, top: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``[n, BLOCK]`` uniforms of whole blocks: each id's own uniform ``u`` scaled below its block's largest
    ``top`` ``[n]``, which the id at offset ``at`` ``[n]`` holds (``u`` is overwritten)."""
    return u.mul_(top[:, None]).scatter_(1, at[:, None], top[:, None])


def block_full_draw(logits: torch.Tensor, temperature: float, keys: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """``[T]`` the block-maxima design's Gumbel argmax over every id."""
    T, V = logits.shape
    top, at = _block_noise(keys, V // BLOCK)
    u = _block_uniforms(noise.uniform(keys, V).view(-1, BLOCK), top.view(-1), at.view(-1)).view(T, V)
    return sampling._full_draw(u, temperature, logits, mask_id)


def block_draw(logits: torch.Tensor, temperature: float, keys: torch.Tensor,
               mask_id: int | None) -> tuple[torch.Tensor, bool]:  # fmt: skip
    """``([T], pruned)``: the block-maxima draw, scoring only the blocks that can hold the winner (``pruned``), or
    every id where more than :data:`BLOCK_MAX_SHARE` of the blocks can."""
    T, V = logits.shape
    nb = V // BLOCK
    blocks = logits.view(T, nb, BLOCK)
    top, at = _block_noise(keys, nb)
    lift = top.log().neg_().log_().mul_(-temperature)  # [T, nb]: the most noise each block's ids can draw
    holder = torch.arange(nb, device=logits.device) * BLOCK + at  # [T, nb] the id holding each maximum
    exact = logits.gather(1, holder).double() + lift  # its exact score
    if mask_id is not None:
        exact.masked_fill_(holder == mask_id, -math.inf)
    reach = exact.amax(1, keepdim=True)  # the winner scores at least this
    keep = blocks.amax(-1).double() + lift >= reach - 1e-6
    if int(keep.count_nonzero()) > BLOCK_MAX_SHARE * T * nb or not bool(torch.isfinite(reach).all()):
        return block_full_draw(logits, temperature, keys, mask_id), False
    r, b = keep.nonzero(as_tuple=True)
    ids = (b * BLOCK)[:, None] + torch.arange(BLOCK, device=logits.device)  # [n, BLOCK]
    u = noise.uniform_at(keys[r][:, None].expand_as(ids).reshape(-1), ids.reshape(-1), V).view(-1, BLOCK)
    scores = sampling._scores(_block_uniforms(u, top[r, b], at[r, b]), temperature, blocks[r, b])
    if mask_id is not None:
        scores.masked_fill_(ids == mask_id, -math.inf)
    rows = r[:, None].expand_as(ids).reshape(-1)
    return sampling._first_best(rows, ids.reshape(-1), scores.reshape(-1), T, V), True


def _ms(fn, draws: list[tuple], repeats: int) -> float:
    """Milliseconds of ``fn`` over all ``draws``, the median of ``repeats`` passes."""
    passes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for logits, keys, mask_id in draws:
            fn(logits, keys, mask_id)
        passes.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(passes)


def timed(draws: list[tuple], temperature: float, repeats: int) -> dict:
    """The shipped draw, the inverse-CDF draw, and the block draw (with its full draw) over all ``draws``; how many
    block draws were pruned, and whether the pruned block draws picked their full draw's tokens."""
    pruned, same = 0, True
    for logits, keys, mask_id in draws:
        tokens, was_pruned = block_draw(logits, temperature, keys, mask_id)
        pruned += was_pruned
        same &= torch.equal(tokens, block_full_draw(logits, temperature, keys, mask_id))
    shipped = _ms(lambda x, k, m: sampling.gumbel_tokens(x, temperature, None, k, m), draws, repeats)
    inverse = _ms(lambda x, k, m: cdf_draw(x, temperature, k, m), draws, repeats)
    block = _ms(lambda x, k, m: block_draw(x, temperature, k, m), draws, repeats)
    block_full = _ms(lambda x, k, m: block_full_draw(x, temperature, k, m), draws, repeats)
    return {"draws": len(draws), "rows": sum(d[0].shape[0] for d in draws), "shipped_ms": shipped, "cdf_ms": inverse,
            "block_ms": block, "block_full_ms": block_full, "block_pruned": pruned, "block_same_tokens": same}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_replay(replay_parser(__doc__.split("\n\n")[0], repeats=5, out="noise_designs"), argv, BLOCK)
    rows = replay(args, timed)
    head = ["# Keyed noise: the shipped draw against two other designs", "",
            f"`benchmarks/noise_designs.py`; the draws of seeded sparse Fast-dLLM decodes of {args.items} training items "
            f"per suite (block 32, batch {args.batch_size}), each design timed over all of them, the median of "
            f"{args.repeats} passes; {args.threads} thread(s). *Shipped*: `sampling.gumbel_tokens`; *CDF*: one uniform per "
            "slot, inverse CDF; *block*: block maxima, pruned where at most 10 % of the blocks can win (*pruned*: how "
            "many draws), else its full draw. × is the shipped time over the design's.", "",
            "| model | suite | T | draws | rows | shipped ms | CDF ms (×) | block ms (×) | block full ms | pruned | "
            "block same tokens |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip

    def line(r: dict) -> str:
        return (f"| {r['model']} | {r['suite']} | {r['temperature']:g} | {r['draws']} | {r['rows']} | "
                f"{r['shipped_ms']:.1f} | {r['cdf_ms']:.1f} ({r['shipped_ms'] / r['cdf_ms']:.2f}) | "
                f"{r['block_ms']:.1f} ({r['shipped_ms'] / r['block_ms']:.2f}) | {r['block_full_ms']:.1f} | "
                f"{r['block_pruned']} | {'yes' if r['block_same_tokens'] else '**no**'} |")  # fmt: skip

    write(args, rows, head, line)
    if not all(r["block_same_tokens"] for r in rows):
        raise SystemExit("a pruned block draw picked other tokens than its full draw: see the table")


if __name__ == "__main__":
    raise SystemExit(run_main(main))
