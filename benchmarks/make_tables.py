"""Collect bench summaries into one compact Markdown table (for RESULTS.md and the model cards).

Usage: ``python benchmarks/make_tables.py benchmarks/results/tiny/tiny-llada-*`` — each argument is
a bench output folder holding ``summary.json``; rows are (suite, method) in the order they ran.

``--headline``: the paper's comparison against tuned baselines instead (vanilla, Fast-dLLM at the
paper's setting and at the suite's best block with early stop, LocalLeap, the authors' BlockBatch,
ours, where run), with NFE as both sides count it, query tokens, latency at the run's batch size
and at batch 1, and tokens per second; one row per folder, suite and method, as the bench's own
``summary.md`` writes it (``hf_blockbatch.eval.runner.headline_markdown``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_blockbatch.eval.runner import headline_markdown
from hf_blockbatch.eval.script_args import read_json, run_main


def _summary(folder: Path) -> dict:
    """A bench folder's ``summary.json``, refused in one line (a ``ValueError``) when it is absent, not JSON, or
    holds no tasks with methods: a bench wrote none there."""
    path = folder / "summary.json"
    if not path.is_file():
        raise ValueError(f"{path} is absent: pass bench output folders (each holds summary.json).")
    summary = read_json(path, dict, "a bench's summary.json")
    tasks = summary.get("tasks")
    if not isinstance(tasks, dict) or not all(isinstance(t, dict) and isinstance(t.get("methods"), dict) for t in tasks.values()):
        raise ValueError(f"{path}: no tasks with methods in it: not a summary.json that hf-blockbatch bench wrote.")
    return summary


def rows(folder: Path) -> list[str]:
    summary = _summary(folder)
    out = []
    for task, data in summary["tasks"].items():
        for name, method in data["methods"].items():
            if method.get("alias_of"):
                continue
            try:
                lo, hi = method["ci95"]
                out.append(
                    f"| {task} | {method['label']} | {100 * method['accuracy']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] "
                    f"| {method['n']} | {method['nfe_mean']:.1f} | {method['latency_mean_s']:.3f} |"
                )
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{folder / 'summary.json'}: {task} {name} lacks a figure of the table ({err!r}): "
                                 "not a summary.json that hf-blockbatch bench wrote.") from None
    return out


def headline(folders: list[Path]) -> list[str]:
    """One headline table over every folder's suites; the batch-size column names the folders' batch
    size when they agree."""
    keyed, batches = [], set()
    for folder in folders:
        summary = _summary(folder)
        meta = summary.get("meta", {})
        batches.add(meta.get("settings", {}).get("batch_size", "B"))
        model = Path(str(meta.get("settings", {}).get("model", folder.name))).name
        for task, data in summary["tasks"].items():
            table = data.get("headline_table")
            if table is None:
                raise ValueError(f"{folder}/summary.json has no headline table: it predates it; re-run its bench.")
            keyed += [(f"{model} / {task}", r) for r in table]
    return headline_markdown(keyed, batches.pop() if len(batches) == 1 else "B", first="Model / suite")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="bench output folders holding summary.json")
    parser.add_argument("--headline", action="store_true", help="the comparison against tuned baselines")
    args = parser.parse_args(argv)
    if args.headline:
        print("\n".join(headline(args.folders)))
        return
    body = [line for folder in args.folders for line in rows(folder)]  # every folder read before the header
    print("| suite | method | accuracy % [95 % CI] | items | mean NFE | latency s/item |")
    print("|---|---|---:|---:|---:|---:|")
    print("\n".join(body))


if __name__ == "__main__":
    raise SystemExit(run_main(main))
