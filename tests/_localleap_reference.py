"""LocalLeap restated plainly for the tests, and a small batched decoder that drives the real rule.

``ref_localleap`` is the rule of Kong et al. 2025 written one position at a time, the way the
paper states it: anchors are this step's candidates with confidence ≥ the anchor threshold; a
candidate within ``radius`` canvas positions of an anchor needs only the relaxed threshold, any
other candidate the anchor threshold; the most confident candidate is always committed.

``rule_decode`` runs greedy block-wise decoding (the vanilla / Fast-dLLM ``none`` loop of
``ref_generate``: full forwards until the block has no mask) for several prompts at once, with the
vectorised rule choosing each step's commits for all rows together. Rows advance independently, so
a step's ``[A, W]`` scores mix rows in different blocks. It records every step, so the tests can
check what the engine must also guarantee (committed tokens never change, a step always commits).
Forwards are per row (batch 1), so its confidences are those ``ref_generate`` sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from conftest import MASK_ID, VOCAB

from hf_blockbatch.generation.rules import candidate_scores


def ref_localleap(conf: dict[int, float], anchor: float, relaxed: float, radius: int) -> list[int]:
    """Positions to commit among the candidates ``conf`` (canvas position -> confidence)."""
    if not conf:
        return []
    best = max(conf, key=lambda p: (conf[p], -p))  # the most confident, the leftmost on ties
    anchors = [p for p in conf if conf[p] >= anchor]
    chosen = []
    for p in sorted(conf):
        near_anchor = any(abs(p - a) <= radius for a in anchors)
        needed = relaxed if near_anchor else anchor
        if p == best or conf[p] >= needed:
            chosen.append(p)
    return chosen


class ScriptedModel(torch.nn.Module):
    """A stand-in denoiser whose confidences spread over (0.48, 0.97) and move as tokens are
    committed: position p proposes a fixed token with logit ``level[p, n]`` (all other logits 0),
    ``n`` the number of non-mask tokens on the canvas. Lets a decode exercise LocalLeap's relaxed
    commits, which the random tiny checkpoints rarely reach (their confidences cluster)."""

    logit_shift = 0

    def __init__(self, length: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        # softmax of one logit l against VOCAB - 1 zeros: 0.48 at l = 4.5, 0.97 at l = 8
        self.level = 4.5 + 3.5 * torch.rand(length, length + 1, generator=g)
        self.token = torch.randint(0, MASK_ID - 1, (length,), generator=g)

    def forward(self, x: torch.Tensor):
        n = int((x[0] != MASK_ID).sum())
        logits = torch.zeros(1, x.shape[1], VOCAB)
        positions = torch.arange(x.shape[1])
        logits[0, positions, self.token[positions]] = self.level[positions, n]
        return type("Out", (), {"logits": logits})()


@dataclass
class Step:
    """One step of one row: the canvas before, the candidates' confidences, what was committed."""

    row: int
    before: list[int]
    conf: dict[int, float]
    committed: list[int]
    after: list[int] = field(default_factory=list)


def rule_decode(model, prompts: list[list[int]], max_new_tokens: int, block: int, select):
    """Decode ``prompts`` greedily, block by block, committing ``select(scores)`` each step.

    ``select`` takes ``[A, block]`` scores (``-inf`` off the candidates) and ``decoded`` masks, one
    row per prompt, each row the span of its current block. Returns (canvases, NFE per row, steps).
    """
    shift = model.logit_shift
    canvases = [torch.tensor(p + [MASK_ID] * max_new_tokens) for p in prompts]
    starts = [len(p) for p in prompts]
    nfe = [0] * len(prompts)
    trace: list[Step] = []
    with torch.no_grad():
        while True:
            spans = []  # (row, block start, block end) of every row with a mask left
            for a, x in enumerate(canvases):
                masked = (x[starts[a] :] == MASK_ID).nonzero()
                if len(masked):
                    k = int(masked[0]) // block
                    spans.append((a, starts[a] + k * block, min(starts[a] + (k + 1) * block, len(x))))
            if not spans:
                return [x.tolist() for x in canvases], nfe, trace
            conf = torch.zeros(len(spans), block, dtype=torch.float64)
            tokens = torch.zeros(len(spans), block, dtype=torch.long)
            candidates = torch.zeros(len(spans), block, dtype=torch.bool)
            decoded = torch.zeros(len(spans), block, dtype=torch.bool)
            for i, (a, bs, be) in enumerate(spans):
                x = canvases[a]
                logits = model(x[None]).logits[0, bs - shift : be - shift]
                nfe[a] += 1
                probs = logits.double().softmax(-1)
                probs[:, MASK_ID] = -1.0  # the mask token is never proposed
                c, t = probs.max(-1)
                width = be - bs
                conf[i, :width], tokens[i, :width] = c, t
                candidates[i, :width] = x[bs:be] == MASK_ID
                decoded[i, :width] = x[bs:be] != MASK_ID
            chosen = select(candidate_scores(conf, candidates))
            if not chosen.any(-1)[candidates.any(-1)].all():
                raise AssertionError("a step committed nothing for a row with candidates: the decode would never end")
            for i, (a, bs, _) in enumerate(spans):
                x = canvases[a]
                step = Step(
                    row=a,
                    before=x.tolist(),
                    conf={bs + w: float(conf[i, w]) for w in range(block) if candidates[i, w]},
                    committed=[bs + w for w in range(block) if chosen[i, w]],
                )
                for w in range(block):
                    if chosen[i, w]:
                        x[bs + w] = tokens[i, w]
                step.after = x.tolist()
                trace.append(step)
