"""Collect bench summaries into one compact Markdown table (for RESULTS.md and the model cards).

Usage: ``python benchmarks/make_tables.py benchmarks/results/tiny/tiny-llada-*`` — each argument is
a bench output folder holding ``summary.json``; rows are (suite, method) in the order they ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(folder: Path) -> list[str]:
    summary = json.loads((folder / "summary.json").read_text())
    out = []
    for task, data in summary["tasks"].items():
        for method in data["methods"].values():
            if method.get("alias_of"):
                continue
            lo, hi = method["ci95"]
            out.append(
                f"| {task} | {method['label']} | {100 * method['accuracy']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] "
                f"| {method['n']} | {method['nfe_mean']:.1f} | {method['latency_mean_s']:.3f} |"
            )
    return out


def main() -> None:
    print("| suite | method | accuracy % [95 % CI] | items | mean NFE | latency s/item |")
    print("|---|---|---|---:|---:|---:|")
    for arg in sys.argv[1:]:
        for line in rows(Path(arg)):
            print(line)


if __name__ == "__main__":
    main()
