"""Helpers shared by the generation tests: peaked tiny models and a plain reference decoder.

The reference decoder is written for clarity, not speed: batch size 1, Python loops, greedy
decoding, and only the model's public forwards (``model(x)``, ``model(x, cache=...)`` and
``model.forward_windows``). It restates the official Fast-dLLM / LLaDA loops:

* vanilla / Fast-dLLM ``none``: per block, full forwards until the block has no mask;
* ``prefix``: per block, one full forward (fills the cache, commits), then steps that query the
  block and the masked suffix against the cache until the block has no mask;
* ``dual``: the same, but each step queries only the block.

The cached loops always run at least one step after the block-start forward (as the official
code does, even when that forward already completed the block).
"""

from __future__ import annotations

from collections import Counter

import torch
from conftest import EOS_ID, MASK_ID, make_tiny_dream, make_tiny_llada


def run_padded(model, prompts: list[list[int]], cfg):
    """``generate`` over ``prompts`` left-padded into one batch (token 0 as padding, masked out)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return model.generate(ids, attention_mask=mask, generation_config=cfg, return_dict_in_generate=True)


def homogeneity_p(a: Counter, b: Counter, pool_below: int = 10) -> float:
    """The p-value of Pearson's chi-square test that two samples of outcomes come from one distribution
    (outcomes seen fewer than ``pool_below`` times in both together pooled into one category)."""
    na, nb = sum(a.values()), sum(b.values())
    rare = [k for k in a.keys() | b.keys() if a[k] + b[k] < pool_below]
    cells = [(a[k], b[k]) for k in a.keys() | b.keys() if a[k] + b[k] >= pool_below]
    cells.append((sum(a[k] for k in rare), sum(b[k] for k in rare)))
    cells = [c for c in cells if sum(c)]
    share = [(x + y) / (na + nb) for x, y in cells]  # each cell's share of all draws, under one distribution
    stat = sum((x - f * na) ** 2 / (f * na) + (y - f * nb) ** 2 / (f * nb) for (x, y), f in zip(cells, share))
    half = torch.tensor([(len(cells) - 1) / 2, stat / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


def spy_caches(monkeypatch, fill: float | None = None) -> list:
    """Every ``BranchCache`` built from now on, in order; ``fill`` overwrites each new storage (NaN:
    a decode that reads K/V nothing wrote turns its logits into NaN, a visible failure)."""
    import hf_blockbatch as hb

    built: list = []
    init = hb.BranchCache.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if fill is not None:
            self.storage.fill_(fill)
        built.append(self)

    monkeypatch.setattr(hb.BranchCache, "__init__", spy)
    return built


def output_head(model) -> torch.nn.Linear:
    return model.lm_head if hasattr(model, "lm_head") else model.model.transformer.ff_out


def peaked(family: str, scale: float = 20.0, seed: int = 0):
    """A tiny model whose output head is scaled, so confidences spread over (0, 1)."""
    model = make_tiny_llada(seed) if family == "llada" else make_tiny_dream(seed)
    with torch.no_grad():
        output_head(model).weight.mul_(scale)
    return model


def eos_model(family: str, seed: int = 0):
    """A peaked model whose EOS row copies (slightly amplified) the row of the token it predicts
    most on masks: EOS becomes the confident prediction of most masked positions."""
    model = peaked(family, seed=seed)
    x = torch.tensor([[1, 2, 3, 4, 5, 6] + [MASK_ID] * 8])
    with torch.no_grad():
        top = int(model(x).logits[0, -1].argmax())
        w = output_head(model).weight
        w[EOS_ID] = w[top] * 1.05
    return model


# ----------------------------------------------------------------------------- reference rules
def ref_select(conf: dict[int, float], threshold=None, factor=None, quota=None) -> list[int]:
    """Positions to commit among the candidates ``conf`` (position -> confidence)."""
    order = sorted(conf, key=lambda p: -conf[p])
    if not order:
        return []
    if threshold is not None:
        return [order[0]] + [p for p in order[1:] if conf[p] >= threshold]
    if factor is not None:
        count = 1
        for n in range(1, len(order) + 1):
            if (n + 1) * (1 - conf[order[n - 1]]) < factor:
                count = n
        return order[:count]
    return order[:quota]


def ref_quota(masked: int, steps: int) -> list[int]:
    """LLaDA's get_num_transfer_tokens for one row, written as a loop."""
    out = [0] * steps
    for i in range(masked):
        out[i % steps] += 1
    return out


def ref_generate(
    model,
    prompt: list[int],
    max_new_tokens: int,
    block: int,
    mode: str,
    threshold: float | None = None,
    factor: float | None = None,
    steps: int | None = None,
    select=None,
) -> tuple[list[int], int]:
    """Greedy reference decode; ``mode`` in {"none", "prefix", "dual"} (vanilla is "none" with
    ``steps``). ``select(conf) -> positions`` replaces the threshold / factor / quota rule (e.g.
    LocalLeap's plain restatement). Returns (prompt + generated tokens, NFE)."""
    Lp = len(prompt)
    L = Lp + max_new_tokens
    x = torch.tensor([prompt + [MASK_ID] * max_new_tokens])
    shift = model.logit_shift
    num_blocks = -(-max_new_tokens // block)
    per_block = steps // num_blocks if steps is not None else None
    nfe = 0

    def commit(logits_of, bs: int, be: int, step: int, schedule) -> None:
        # logits_of(p) -> [V] logits predicting position p
        conf, tok = {}, {}
        for p in range(bs, be):
            if int(x[0, p]) == MASK_ID:
                probs = logits_of(p).double().softmax(-1)
                probs[MASK_ID] = -1.0  # the mask token is never proposed
                c, t = probs.max(-1)
                conf[p], tok[p] = float(c), int(t)
        quota = schedule[step] if schedule is not None else None
        chosen = select(conf) if select is not None else ref_select(conf, threshold, factor, quota)
        for p in chosen:
            x[0, p] = tok[p]

    def block_has_mask(bs: int, be: int) -> bool:
        return bool((x[0, bs:be] == MASK_ID).any())

    with torch.no_grad():
        for k in range(num_blocks):
            bs, be = Lp + k * block, min(Lp + (k + 1) * block, L)
            schedule = ref_quota(be - bs, per_block) if per_block is not None else None
            if mode == "none":
                step = 0
                while block_has_mask(bs, be):
                    full = model(x).logits
                    nfe += 1
                    commit(lambda p, full=full: full[0, p - shift], bs, be, step, schedule)
                    step += 1
                continue
            cache = model.new_cache(1, L)
            full = model(x, cache=cache).logits
            nfe += 1
            commit(lambda p, full=full: full[0, p - shift], bs, be, 0, schedule)
            step = 1
            while True:
                q_end = L if mode == "prefix" else be
                win = model.forward_windows(x, torch.tensor([bs]), torch.tensor([q_end]), cache).logits
                nfe += 1
                commit(lambda p, win=win, bs=bs: win[p - bs], bs, be, step, schedule)
                step += 1
                if not block_has_mask(bs, be):
                    break
    return x[0].tolist(), nfe
