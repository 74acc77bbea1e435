"""How few forwards could any of our decoders need, if an oracle chose the decoder per item?

Issue 16 asks BlockBatch for ≤ 0.75 × the NFE of the tuned Fast-dLLM at no loss of accuracy. This
script bounds what the decoders measured by ``benchmarks/beyond_paper.py`` can reach together: for
every training item it takes, among all configs decoded on that item, the fewest forwards of a
config that answered it correctly (and, for an item no config answers, the fewest forwards of any
config). That oracle is at least as accurate as the baseline on every item the baseline answers,
and no single decoder of the family, which must commit to one rule for all items, can use fewer
forwards at that accuracy unless it beats the oracle on some item.

    python benchmarks/nfe_oracle.py      # reads benchmarks/results/beyond_paper/<model>_150_*.json

Writes ``benchmarks/results/beyond_paper/nfe_oracle.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from hf_blockbatch.eval.script_args import out_file, run_main

HERE = Path(__file__).resolve().parent / "results" / "beyond_paper"
BASELINE = "fd_es_b64"


def oracle(files: list[Path], suite: str) -> dict[str, float] | None:
    """Per-item best of every config decoded on the same items (same model, suite and limit)."""
    per: dict[str, tuple[list[bool], list[int]]] = {}
    for f in files:
        for name, r in json.loads(f.read_text())["suites"].get(suite, {}).items():
            per[name] = (r["correct"], r["nfe_items"])
    if BASELINE not in per:
        return None
    base_ok, base_nfe = per[BASELINE]
    n_items = len(base_nfe)
    cheapest = [min(n[i] for _, n in per.values()) for i in range(n_items)]
    right = [min((n[i] for c, n in per.values() if c[i]), default=None) for i in range(n_items)]
    # every item answered where some config answers it
    best = [r if r is not None else a for r, a in zip(right, cheapest)]
    # the fewest forwards at the baseline's accuracy: answer the items that are cheapest to answer
    # (extra forwards over the item's cheapest decode), as many as the baseline answers
    extra = sorted(r - a for r, a in zip(right, cheapest) if r is not None)
    at_base = (sum(cheapest) + sum(extra[: sum(base_ok)])) / n_items
    base = statistics.fmean(base_nfe)
    return {"configs": len(per), "items": n_items, "base_acc": 100 * sum(base_ok) / n_items, "base_nfe": base,
            "oracle_acc": 100 * sum(r is not None for r in right) / n_items, "oracle_nfe": statistics.fmean(best),
            "ratio": statistics.fmean(best) / base, "at_base_nfe": at_base, "at_base_ratio": at_base / base}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=out_file, default=str(HERE / "nfe_oracle.md"),
                   help="where the table goes (the committed one: RESULTS §35, over the runs committed by then)")
    args = p.parse_args(argv)
    lines = ["| model | suite | configs | items | baseline acc % / NFE | oracle: every answerable item, acc % / NFE (× baseline) | "
             "oracle at the baseline's accuracy: NFE (× baseline) |", "|---|---|---:|---:|---|---|---|"]  # fmt: skip
    for model in ("tiny-llada", "tiny-dream"):
        files = sorted(HERE.glob(f"{model}_150_*.json"))
        for suite in ("arith", "code", "lists"):
            r = oracle(files, suite)
            if r is not None:
                lines.append(f"| {model} | {suite} | {r['configs']} | {r['items']} | {r['base_acc']:.1f} / {r['base_nfe']:.2f} | "
                             f"{r['oracle_acc']:.1f} / {r['oracle_nfe']:.2f} ({r['ratio']:.2f} ×) | "
                             f"{r['at_base_nfe']:.2f} ({r['at_base_ratio']:.2f} ×) |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(run_main(main))
