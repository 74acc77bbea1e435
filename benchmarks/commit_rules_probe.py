"""Commit rules that need a decoding loop of their own, beside plain thresholds (RESULTS §31).

Two published training-free rules promise fewer forwards than Fast-dLLM's threshold, and neither fits the
library's decoders, whose invariants they break on purpose (a committed token is masked again; a whole window
commits on a signal other than each token's confidence). This probe runs them in a plain uncached loop, so
that their claim can be checked on any checkpoint the library loads (the tiny ones here; a real LLaDA or
Dream the same way):

* **revokable commits** (WINO: Hong et al. 2025, arXiv 2507.18578): commit the block's masks at a low
  threshold τ_in, at most clamp(0.7 × the block's masks, 5, 20) of them per step; a *shadow* copy of the block
  rides in the same forward, each shadow query attending to the whole canvas but the position it checks,
  through the model's per-query attention mask (the checked token is hidden from the shadow's own attention in
  every layer; the other positions' keys still carry it from the layers below, as in the authors' code); a
  committed token whose shadow probability is under τ_back is masked again, fewer than the previous step
  committed (so a step may leave more masks than it found, but a block ends). ``wino``: as released, every
  committed token checked at every step that commits more than one, shadows seeing each other. Modifiers, in
  any combination: ``-loo``, a shadow sees no shadow, itself included (what a shifted model needs: a shadow
  there holds the real token of the position before the one it checks); ``-extras``, a token committed at
  ≥ τ_back is trusted, one committed below is checked until it passes once; ``-nocap``, no limit on a step's
  commits. The threshold is the library's (≥ τ_in), the release's is > τ_in: they differ only at equality;
* **all-in completion** (after Prophet: Li et al. 2025, arXiv 2508.19982): Fast-dLLM's threshold, and when the
  gap between the two most likely tokens of the block's masks (their smallest, ``allin-min``, or their mean,
  ``allin-mean``) reaches g, every mask of the block is committed at once;
* **entropy-bounded commits** (EB-sampler: Ben-Hamu et al. 2025, arXiv 2505.24857; DiffusionGemma's default
  sampler): instead of a threshold, the masks in order of confidence, as many as keep the sum of their
  predictive entropies minus the largest of them within γ nats (``entropy:γ``; at least one). It commits no
  token it would take back, so unlike the two above it is also a transfer rule of the library's decoders
  (``FastDLLMConfig(rule="entropy", entropy_bound=γ)``, whose uncached decode this loop equals);
* **isolated relaxed commits** (``isolated<d>:τ``, this project's, RESULTS §33): the threshold's commits, and a
  mask at confidence ≥ τ when no other position within d of it was masked in the canvas the forward saw. A
  mask whose neighbourhood is decoded was predicted in its full local context, so the usual cause of parallel
  errors (two dependent neighbours committed from their marginals) cannot reach it; the rule asks whether
  such a lone mask is safe at a lower confidence. Positions past the block count as masked;
* **a learned commit filter** (``learned:p``, after Learn2PD: Bao et al. 2025, arXiv 2509.25188): the threshold's
  commits, and a mask whose proposal a small classifier (:class:`Filter`, one hidden layer of 16) rates at ≥ p
  to be the token the threshold decode ends with there. It reads :data:`FEATURES` of each mask (its two best
  probabilities, their gap, its entropy, the previous forward's best probability there and whether the best
  token is the same, which neighbours are decoded, how much of the block is) and is fitted per checkpoint on
  ``--fit-limit`` training items of every suite that follow the ones the rules are judged on, by the
  threshold decode's own trajectories, on masks under its threshold.

The loop is Fast-dLLM without a cache: blocks left to right, a full forward per step, the library's greedy
proposals (``sample_tokens``) and threshold rule (``threshold_select``), and its early stop (the first completed
block holding an end token). ``threshold:0.9`` is therefore ``FastDLLMConfig(cache="none", early_stop=True)``
exactly (``tests/test_commit_rules_probe.py``), and every rule is compared with it on the
same items: the tiny suites' training items by default, where rules are chosen, never their test splits.

    PYTHONPATH=$PWD python benchmarks/commit_rules_probe.py --model tiny-llada --limit 200 \\
        --rules threshold:0.8 wino:0.8 wino-nocap:0.8 wino-extras-nocap:0.8 allin-min:0.7 allin-mean:0.9
    # tiny-dream (shifted): the leave-one-out variants, wino-loo:… and wino-loo-extras-nocap:…
    # (RESULTS §31 gives the full commands behind its tables)

A real checkpoint: ``--model <folder or repo> --device cuda --dtype bfloat16 --suites gsm8k --split test`` (the
real benchmarks ship their test split only, found where ``hf-blockbatch bench`` finds them). Writes
``benchmarks/results/commit_rules/<model>[_<split>]_<limit>[<tag>].json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hf_blockbatch.eval.runner import (
    ALL_TASKS,
    _check_prompts_fit,
    _encode,
    _score_all,
    check_scoring,
    load_for_benchmark,
    load_task,
    write_report,
)
from hf_blockbatch.eval.script_args import (
    nonnegative_int,
    out_folder,
    positive_int,
    probability,
    run_main,
    torch_device,
)
from hf_blockbatch.generation.outputs import answer_texts, end_token_ids
from hf_blockbatch.generation.rules.entropy import entropy_select
from hf_blockbatch.generation.rules.threshold import threshold_select
from hf_blockbatch.generation.sampling import Sampled, sample_tokens

logger = logging.getLogger("commit_rules_probe")

BASELINE = "threshold:0.9"


#: what the learned filter reads of each mask of the block, at each step (:func:`features`)
FEATURES = ("p1", "p2", "gap", "entropy", "p1_before", "same_as_before", "same_x_p1", "left_decoded", "right_decoded",
            "decoded_within_2", "block_decoded", "logit_p1")  # fmt: skip


def features(got: Sampled, masked: torch.Tensor, p1_before: torch.Tensor, top_before: torch.Tensor) -> torch.Tensor:
    """``[n, len(FEATURES)]`` float64 for the block's ``n`` positions: the proposal's two best probabilities,
    their gap, its entropy, the previous forward's best probability at the position and whether its best
    token was the same (0 and no in a block's first forward), whether the neighbours are decoded (the block's
    edges count as decoded on the left, masked on the right), the decoded share within 2 positions and of the
    block, and the best probability's logit."""
    p1, p2 = got.top_probs[:, 0].double(), got.top_probs[:, 1].double()
    decoded = (~masked).double()
    left = torch.cat([decoded.new_ones(1), decoded[:-1]])
    right = torch.cat([decoded[1:], decoded.new_zeros(1)])
    near = torch.nn.functional.avg_pool1d(torch.nn.functional.pad(decoded[None, None], (2, 2), value=1.0), 5, 1)[0, 0]
    same = (got.tokens == top_before).double()
    q = p1.clamp(1e-9, 1 - 1e-9)
    return torch.stack([p1, p2, p1 - p2, got.entropy.double(), p1_before, same, same * p1, left, right, near,
                        decoded.mean().expand_as(p1), q.log() - (-q).log1p()], -1)  # fmt: skip


class Filter(torch.nn.Module):
    """The learned rule's classifier: standardised :data:`FEATURES`, one tanh layer, the probability that a
    mask's proposal is the token the threshold decode ends with there."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, hidden: int = 16) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.net = torch.nn.Sequential(torch.nn.Linear(len(FEATURES), hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)).double()

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        return self.net((f - self.mean) / self.std).squeeze(-1)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(f))

    @classmethod
    def fit(cls, f: torch.Tensor, y: torch.Tensor, seed: int = 0) -> Filter:
        """Logistic loss (and a little weight decay) by L-BFGS on features ``f`` ``[N, F]`` and 0/1 labels ``y``."""
        torch.manual_seed(seed)
        model = cls(f.mean(0), f.std(0) + 1e-6)
        params = list(model.net.parameters())
        opt = torch.optim.LBFGS(params, max_iter=300, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model.logits(f), y) + 1e-4 * sum((w**2).sum() for w in params)
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
        return model.eval()


@dataclass(frozen=True)
class Rule:
    """One commit rule of the probe (see the module docstring); parsed from ``name:value``."""

    spec: str
    tau_in: float
    tau_back: float | None = None  # the shadows' check threshold; None: no check
    shadows_see_shadows: bool = True
    extras_only: bool = False
    cap: bool = False  # at most clamp(0.7 x the block's masks, 5, 20) commits per step (WINO's)
    allin: str | None = None  # "min" | "mean": the gap statistic of the all-in step
    gap: float = 1.0
    entropy_bound: float | None = None  # EB-sampler's γ, in nats: replaces the threshold
    isolation: int = 0  # isolated relaxed commits: no other mask within this radius (0: off)
    tau_lone: float = 1.0  # ... committed at this confidence
    learned: float | None = None  # the learned filter's probability to commit at (its filter: ``main`` fits it)
    filter: Filter | None = None

    @classmethod
    def parse(cls, spec: str, tau_back: float = 0.9) -> Rule:
        """The rule ``spec`` names, its value checked: a threshold, a probability or a gap in [0, 1] (0 offers every
        mask, which the probe's tests use; above 1 nothing reaches it, below 0 is a typo), an entropy bound >= 0
        (below 0 no prefix fits it, a step commits nothing and the loop never ends), and the shadows' ``tau_back`` in
        [0, 1] (0: nothing is masked again)."""
        name, _, value = spec.partition(":")
        try:
            x = float(value)
        except ValueError:
            raise ValueError(f"Rule {spec!r}: write name:number, e.g. threshold:0.8 or wino:0.7.") from None

        def within(what: str, high: float = 1.0) -> float:
            if not (math.isfinite(x) and 0 <= x <= high):
                raise ValueError(f"Rule {spec!r}: {what} must be {'>= 0' if high == math.inf else 'in [0, 1]'}, got {value}.")
            return x

        if name == "threshold":
            return cls(spec, within("the threshold"))
        if name in ("allin-min", "allin-mean"):
            return cls(spec, 0.9, allin=name.split("-")[1], gap=within("the gap of two probabilities"))
        if name == "entropy":
            return cls(spec, 1.0, entropy_bound=within("the entropy bound (nats)", math.inf))
        if name == "learned":
            return cls(spec, 0.9, learned=within("the filter's probability"))
        if name.startswith("isolated") and name[8:].isdigit() and int(name[8:]) >= 1:
            return cls(spec, 0.9, isolation=int(name[8:]), tau_lone=within("the lone masks' threshold"))
        base, *mods = name.split("-")
        if base == "wino" and set(mods) <= {"loo", "extras", "nocap"} and len(set(mods)) == len(mods):
            if not 0 <= tau_back <= 1:
                raise ValueError(f"Rule {spec!r}: tau_back must be in [0, 1], got {tau_back!r}.")
            return cls(spec, within("the threshold"), tau_back, shadows_see_shadows="loo" not in mods,
                       extras_only="extras" in mods, cap="nocap" not in mods)  # fmt: skip
        raise ValueError(f"Unknown rule {spec!r}: threshold, wino with any of -loo, -extras, -nocap (e.g. wino-loo-extras), "
                         "allin-min, allin-mean, entropy, isolated<d> with d >= 1, learned (each :value).")  # fmt: skip


def isolated(masked: torch.Tensor, radius: int, masks_after: bool) -> torch.Tensor:
    """``[n]`` bool: the block's masks with no other mask within ``radius`` positions. Positions before the
    block are decoded (blocks go left to right); those after it are masks when ``masks_after``."""
    edge = float(masks_after)
    counts = torch.nn.functional.pad(masked.float()[None, None], (radius, radius), value=0.0)
    counts[..., counts.shape[-1] - radius :] = edge
    counts = torch.nn.functional.avg_pool1d(counts, 2 * radius + 1, 1)[0, 0] * (2 * radius + 1)
    return masked & (counts.round() == 1)  # the mask itself is the one


def accept_cap(masks: int) -> int:
    """WINO's limit on one step's commits: 70 % of the block's masks, at least 5 and at most 20."""
    return min(max(int(0.7 * masks), 5), 20)


def shadow_layout(length: int, start: int, end: int, shift: int, shadows_see_shadows: bool,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The RoPE positions ``[1, T]`` and the per-query mask ``[1, T, T]`` (``T = length + n``) of a canvas of
    ``length`` positions followed by one shadow query per position ``p`` of the block ``[start, end)`` (``n`` of
    them). The shadow checking ``p`` sits at position ``p - shift`` (the hidden state whose logits predict ``p``).
    The canvas sees no shadow; a shadow sees the canvas but ``p``, and the other shadows only if
    ``shadows_see_shadows``."""
    n = end - start
    T = length + n
    positions = torch.cat([torch.arange(length), torch.arange(start - shift, end - shift)])[None].to(device)
    mask = torch.ones(1, T, T, dtype=torch.bool, device=device)
    mask[0, :length, length:] = False  # the canvas never sees a shadow
    mask[0, length:, length:] = shadows_see_shadows  # the shadows see each other (themselves included) as released
    mask[0, length:, start:end] = ~torch.eye(n, dtype=torch.bool, device=device)  # a shadow never sees what it checks
    return positions, mask


def decode(model, prompt: torch.Tensor, gen_length: int, block: int, rule: Rule, mask_id: int,
           end_ids: torch.Tensor, collect: list | None = None) -> tuple[torch.Tensor, int, int]:  # fmt: skip
    """One request (``prompt`` ``[1, P]``, no padding): the canvas ``[1, P + gen_length]``, the forwards and the
    query tokens it took. ``collect``: appends ``(features [n, F], 0/1 labels [n])`` of every mask at every
    step, labelled by whether its proposal is the token the decode ends with there (the learned rule's data)."""
    P = prompt.shape[1]
    L, sh, dev = P + gen_length, model.logit_shift, prompt.device
    if rule.tau_back is not None and sh and rule.shadows_see_shadows:
        raise ValueError(f"{rule.spec}: on a shifted model (Dream) a shadow holds the real token before the one it "
                         "checks, which the shadow of the next position would see: use wino-loo / wino-loo-extras.")  # fmt: skip
    x = torch.full((1, L), mask_id, dtype=torch.long, device=dev)
    x[:, :P] = prompt
    nfe = queries = 0
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (features, positions, proposals) for collect
    for s in range(P, L, block):
        e = min(s + block, L)
        n = e - s
        pos, mask = shadow_layout(L, s, e, sh, rule.shadows_see_shadows, dev) if rule.tau_back is not None else (None, None)
        blank = torch.full((1, n), mask_id, device=dev)  # an unshifted model's shadow inputs, the same every step
        trusted = torch.zeros(n, dtype=torch.bool, device=dev)  # committed at >= tau_back, or checked once
        last_commits = n + 1
        p1_before = torch.zeros(n, dtype=torch.float64, device=dev)  # the learned rule's memory of the last forward
        top_before = torch.full((n,), -1, dtype=torch.long, device=dev)
        while bool((x[0, s:e] == mask_id).any()):
            cur = x[0, s:e]
            masked = cur == mask_id
            if mask is None:
                logits = model(x).logits[0]
            else:
                shadow_in = x[:, s - sh : e - sh] if sh else blank
                logits = model(torch.cat([x, shadow_in], 1), attention_mask=mask, position_ids=pos).logits[0]
            nfe += 1
            queries += logits.shape[0]
            learning = rule.learned is not None or collect is not None
            got = sample_tokens(logits[s - sh : e - sh], 0.0, "low_confidence", 2, mask_id=mask_id,
                                entropy=rule.entropy_bound is not None or learning)  # fmt: skip
            scores = got.confidence.masked_fill(~masked, float("-inf"))
            if rule.entropy_bound is None:
                take = threshold_select(scores[None], rule.tau_in)[0]
            else:
                take = entropy_select(scores[None], got.entropy[None], rule.entropy_bound)[0]
            if rule.isolation:
                take |= isolated(masked, rule.isolation, e < L) & (scores >= rule.tau_lone)
            if learning:
                f = features(got, masked, p1_before, top_before)
                if collect is not None:
                    at = masked.nonzero().squeeze(1)
                    seen.append((f[at], s + at, got.tokens[at]))
                if rule.learned is not None:
                    take |= masked & (rule.filter(f) >= rule.learned)
                p1_before, top_before = got.top_probs[:, 0].double(), got.tokens
            if rule.cap and int(take.sum()) > (most := accept_cap(int(masked.sum()))):
                take = torch.zeros_like(take).index_fill_(0, scores.topk(most).indices, True)
            if rule.allin is not None:
                gap = (got.top_probs[:, 0] - got.top_probs[:, 1])[masked]
                if float(gap.min() if rule.allin == "min" else gap.mean()) >= rule.gap:
                    take = masked
            remask = torch.zeros_like(take)
            if rule.tau_back is not None and (rule.extras_only or int(take.sum()) > 1):
                loo = torch.log_softmax(logits[L:].float(), -1).gather(1, cur[:, None]).squeeze(1).exp()
                loo = loo.masked_fill(masked | trusted if rule.extras_only else masked, 2.0)
                if rule.extras_only:
                    trusted |= ~masked & (loo >= rule.tau_back)
                remask = loo < rule.tau_back
                if int(remask.sum()) >= last_commits:  # mask again fewer than the previous step committed
                    remask = torch.zeros_like(remask)
                    remask[loo.topk(last_commits - 1, largest=False).indices] = True
            new = torch.where(take, got.tokens, cur).masked_fill(remask, mask_id)
            if rule.tau_back is not None:
                trusted = (trusted | (take & (got.confidence >= rule.tau_back))) & ~remask
            x[0, s:e] = new
            last_commits = int(take.sum())
        if bool(torch.isin(x[0, s:e], end_ids).any()):  # early stop: a completed block holding an end token
            break
    if collect is not None:  # label the steps' proposals by the tokens the decode ended with
        collect += [(f, (x[0, at] == tokens).double()) for f, at, tokens in seen]
    return x, nfe, queries


def _prompts(task, items, tokenizer) -> list[str]:
    chat = bool(getattr(tokenizer, "chat_template", None))
    return [task.prompt(it, tokenizer, chat=chat) for it in items]


def fit_filter(model, tokenizer, suites: list[str], start: int, limit: int, block: int,
               split: str = "train") -> tuple[Filter, dict]:  # fmt: skip
    """The learned rule's classifier for one checkpoint, from the threshold decode of items ``start`` to
    ``start + limit`` of ``split`` in every suite (after the ``start`` items the rules are judged on): the masks
    under the threshold at every step, labelled by whether their proposal is the token the decode ends with."""
    base = Rule.parse(BASELINE)
    end_ids = torch.tensor(end_token_ids(tokenizer, model.config), device=model.device)
    data: list[tuple[torch.Tensor, torch.Tensor]] = []
    for suite in suites:
        task = load_task(suite)
        for prompt in tqdm(_prompts(task, task.items(split, limit=start + limit)[start:], tokenizer), desc=f"fit {suite}",
                           leave=False):  # fmt: skip
            ids, _ = _encode(tokenizer, [prompt], model.device)
            with torch.inference_mode():
                decode(model, ids, int(task.default_gen_length), block, base, model.config.mask_token_id, end_ids, data)
    if not data:
        raise SystemExit(f"learned: no {split} items after the first {start} of {', '.join(suites)} to fit the filter on; "
                         "lower --limit or use a split with more items.")  # fmt: skip
    f, y = torch.cat([d[0] for d in data]).cpu(), torch.cat([d[1] for d in data]).cpu()
    under = f[:, FEATURES.index("p1")] < base.tau_in
    if not bool(under.any()):
        raise SystemExit("learned: the threshold decode of the fitting items left no mask under its threshold to learn from.")
    info = {"items_per_suite": limit, "first_item": start, "masks": int(under.sum()), "final_share": float(y[under].mean())}
    return Filter.fit(f[under], y[under]).to(model.device), info


def suite_prompts(model, tokenizer, suite: str, limit: int, split: str, extra: int = 0) -> tuple[Any, list, list[str], int]:
    """The suite's task, its first ``limit`` items of ``split``, their prompts and its generation length, refused
    (ValueError) where the split is not the suite's or the longest prompt, ``extra`` positions more, does not fit the
    context. :func:`check_suites` calls it for every suite before the first decode."""
    task = load_task(suite)
    items = task.items(split, limit=limit)
    prompts = _prompts(task, items, tokenizer)
    gen_length = int(task.default_gen_length)
    _check_prompts_fit(model, tokenizer, suite, prompts, gen_length + extra)
    return task, items, prompts, gen_length


def check_suites(model, tokenizer, suites: list[str], limit: int, split: str, extra: int = 0) -> None:
    """Every suite's items and prompts (:func:`suite_prompts`), before any decode: a split a later suite lacks
    (``--suites arith gsm8k``, gsm8k holding its test split only) or a prompt it cannot fit was refused when that
    suite's turn came, after the suites before it had decoded (200 items each by default)."""
    check_scoring(load_task(suite) for suite in suites)
    for suite in suites:
        suite_prompts(model, tokenizer, suite, limit, split, extra)


def score_runs(model, tokenizer, suite: str, limit: int, split: str, runs: Mapping[str, Callable], extra: int = 0) -> dict:
    """Each run on the suite's first ``limit`` items of ``split``, one request at a time: per run, which items it
    answers, its forwards and its query tokens. ``runs[name](ids [1, P], gen_length, end_ids)`` decodes one request
    and returns ``(canvas, forwards, query tokens)``; ``extra`` positions beyond the canvas must fit the context too
    (the leave-one-out shadows)."""
    task, items, prompts, gen_length = suite_prompts(model, tokenizer, suite, limit, split, extra)
    end_ids = torch.tensor(end_token_ids(tokenizer, model.config), device=model.device)
    out: dict[str, dict] = {}
    for name, run in runs.items():
        texts, nfes, queries = [], [], []
        for prompt in tqdm(prompts, desc=f"{suite} {name}", leave=False):
            ids, _ = _encode(tokenizer, [prompt], model.device)
            with torch.inference_mode():
                x, nfe, q = run(ids, gen_length, end_ids)
            texts += answer_texts(tokenizer, x[:, ids.shape[1] :], end_ids.tolist())
            nfes.append(nfe)
            queries.append(q)
        out[name] = {"correct": [bool(sc.correct) for sc in _score_all(task, items, texts)], "nfe": nfes, "query_tokens": queries}
    return out


def run_suite(model, tokenizer, suite: str, limit: int, block: int, rules: list[Rule], split: str = "train") -> dict:
    """Every rule on the suite's first ``limit`` items of ``split``: per rule, correct items, forwards, query tokens."""
    mask_id = model.config.mask_token_id
    runs = {rule.spec: (lambda ids, gen, end, rule=rule: decode(model, ids, gen, block, rule, mask_id, end)) for rule in rules}
    return score_runs(model, tokenizer, suite, limit, split, runs, _shadows(rules, block))


def _shadows(rules: list[Rule], block: int) -> int:
    """Positions the rules need beyond the canvas: the leave-one-out shadows take a block more."""
    return block if any(r.tau_back is not None for r in rules) else 0


def summarize(raw: dict[str, dict], baseline: str = BASELINE) -> dict[str, dict]:
    """Accuracy, NFE and query tokens per rule, and against ``baseline`` (:data:`BASELINE`) on the same items."""
    base = raw[baseline]
    n = len(base["correct"])
    b_nfe, b_q = statistics.fmean(base["nfe"]), statistics.fmean(base["query_tokens"])
    rows = {}
    for spec, r in raw.items():
        nfe, q = statistics.fmean(r["nfe"]), statistics.fmean(r["query_tokens"])
        rows[spec] = {
            "accuracy": 100 * sum(r["correct"]) / n, "nfe": nfe, "query_tokens": q,
            "delta_points": 100 * (sum(r["correct"]) - sum(base["correct"])) / n,
            "nfe_ratio": nfe / b_nfe, "query_ratio": q / b_q,
            "won": sum(a and not b for a, b in zip(r["correct"], base["correct"])),
            "lost": sum(b and not a for a, b in zip(r["correct"], base["correct"])),
        }  # fmt: skip
    return rows


def table_rows(suites: dict[str, dict[str, dict]], baseline: str, specs: list[str], cell: Callable[[dict], str]) -> list[str]:
    """A report table's body from :func:`summarize`'s rows per suite: the baseline's accuracy and NFE, then a row per
    spec of ``cell(its summary)`` per suite."""
    rows = [f"| `{baseline}` | " + " | ".join(f"{r[baseline]['accuracy']:.1f} % · NFE {r[baseline]['nfe']:.2f}" for r in suites.values()) + " |"]
    return rows + [f"| `{spec}` | " + " | ".join(cell(r[spec]) for r in suites.values()) + " |" for spec in specs]


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The probes' model options: which checkpoint (a tiny one, a folder or a repo), on how many CPU threads,
    where and in which dtype (``--device cuda --dtype bfloat16`` for a real LLaDA or Dream)."""
    p.add_argument("--model", default="tiny-llada")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--device", type=torch_device, default="cpu", help="where the model runs (cuda for a real checkpoint)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def load_from_arguments(args: argparse.Namespace) -> tuple:
    """The model and tokenizer :func:`add_model_arguments`' options name."""
    return load_for_benchmark(args.model, args.threads, args.device, getattr(torch, args.dtype))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--suites", nargs="+", choices=ALL_TASKS, default=["arith", "code", "lists"], metavar="SUITE")
    p.add_argument("--limit", type=positive_int, default=200, help="items per suite")
    p.add_argument("--split", default="train", choices=("train", "test"), help="the tiny suites' training items by default; the real benchmarks "
                   "(gsm8k, math, humaneval, mbpp) ship their test split only: a check of a claim, not a place to tune")
    p.add_argument("--block", type=positive_int, default=64)
    p.add_argument("--rules", nargs="+", default=["threshold:0.8", "wino:0.8", "allin-min:0.7"],
                   help=f"name:value each (see the module docstring); {BASELINE} always runs, as the baseline")
    p.add_argument("--tau-back", type=probability, default=0.9, help="the leave-one-out check's threshold")
    p.add_argument("--fit-limit", type=nonnegative_int, default=300,
                   help="learned:p rules: training items per suite the filter is fitted on, after the --limit judged ones")
    p.add_argument("--out", type=out_folder, default="benchmarks/results/commit_rules")
    p.add_argument("--tag", default="", help="appended to the files' names (several rule sets per model)")
    args = p.parse_args(argv)
    try:  # a bad rule is said before the model loads
        rules = [Rule.parse(BASELINE)] + [Rule.parse(s, args.tau_back) for s in args.rules if s != BASELINE]
    except ValueError as err:
        p.error(str(err))
    if args.fit_limit < 1 and any(rule.learned is not None for rule in rules):
        p.error("--fit-limit must be at least 1: a learned rule's filter is fitted on that many items per suite")
    model, tokenizer = load_from_arguments(args)
    if model.logit_shift:  # refuse before any decode, not after the first suite
        for rule in rules:
            if rule.tau_back is not None and rule.shadows_see_shadows:
                raise ValueError(f"{rule.spec}: {args.model} is a shifted model; use wino-loo / wino-loo-extras.")
    check_suites(model, tokenizer, args.suites, args.limit, args.split, _shadows(rules, args.block))
    result = {"model": args.model, "split": args.split, "limit": args.limit, "block": args.block,
              "tau_back": args.tau_back, "suites": {}}  # fmt: skip
    if any(rule.learned is not None for rule in rules):  # fitted on other items than those it is judged on
        filt, result["filter"] = fit_filter(model, tokenizer, args.suites, args.limit, args.fit_limit, args.block, args.split)
        rules = [replace(rule, filter=filt) if rule.learned is not None else rule for rule in rules]
        logger.info("learned filter: %s", result["filter"])
    for suite in args.suites:
        rows = summarize(run_suite(model, tokenizer, suite, args.limit, args.block, rules, args.split))
        result["suites"][suite] = rows
        for spec, r in rows.items():
            logger.info("%s %s %s: %.1f %% · NFE %.2f (×%.3f) · query tokens %.0f (×%.2f) · +%d/−%d items", args.model,
                        suite, spec, r["accuracy"], r["nfe"], r["nfe_ratio"], r["query_tokens"], r["query_ratio"],
                        r["won"], r["lost"])  # fmt: skip
    split = "" if args.split == "train" else f"_{args.split}"
    suites = list(result["suites"])
    lines = [f"# Commit rules in an uncached loop: {args.model}, {args.limit} {'training' if args.split == 'train' else args.split} "
             f"items per suite, block {args.block}",
             "", f"Δ accuracy in points · NFE × · query tokens ×, against `{BASELINE}` (Fast-dLLM without a cache, early "
             f"stop) on the same items; τ_back {args.tau_back}.", "",
             "| rule | " + " | ".join(suites) + " |", "|---|" + "---|" * len(suites)]  # fmt: skip
    if "filter" in result:
        fit = result["filter"]
        lines[4:4] = [f"`learned:p`: the filter fitted on training items {fit['first_item']}–{fit['first_item'] + fit['items_per_suite'] - 1} "
                      f"of each suite ({fit['masks']} masks under the threshold, {100 * fit['final_share']:.1f} % of them "
                      "proposing the token the threshold decode ends with).", ""]  # fmt: skip
    lines += table_rows(result["suites"], BASELINE, [rule.spec for rule in rules[1:]],
                        lambda c: f"{c['delta_points']:+.1f} · {c['nfe_ratio']:.3f} · {c['query_ratio']:.2f}")  # fmt: skip
    write_report(Path(args.out) / f"{args.model.replace('/', '_')}{split}_{args.limit}{args.tag}", result, "\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(run_main(main))
