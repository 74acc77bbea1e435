"""The paper's Table 1 shape on the tiny checkpoints, against the tuned baseline, from bench folders.

``python benchmarks/paper_table.py`` reads ``benchmarks/results/paper_table/<model>-<suite>/summary.json``
(and ``paper_table_extra/``, ``paper_table_sparse/``, ``paper_table_sparse_confident/`` and the per-model
``paper_table_paired*/<model>/`` and ``paper_table_lookahead*/<model>/``, where the reference variant and the beyond-paper configs ran on the
same items) and prints one Markdown row per method: accuracy, NFE, NFE as the authors count it, query
tokens, and the NFE and query-token ratios to the tuned Fast-dLLM (early stop, the sweep's most accurate block,
ties to the lower NFE). Latency is left out on purpose: these runs shared the two cores, see RESULTS §8.
``--plots`` also draws every method of those folders on one accuracy-vs-NFE and one
accuracy-vs-query-tokens plot per model (``paper_table_combined/<model>/``).
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ORDER = ("fast_dllm", "fast_dllm_early_stop", "fast_dllm_b16", "fast_dllm_b64", "localleap", "localleap_early_stop",
         "blockbatch_reference", "blockbatch", "blockbatch_localleap", "bb_agree_widest", "bb_lean_agree_widest",
         "fd_es_sparse_b32", "fd_es_sparse_b64", "bb_sparse_agree_widest", "bb_lean_sparse_agree_widest",
         "bb_sparse_confident", "bb_lean_sparse_confident", "fd_es_sparse_b64_r6", "bb_lean_sparse_confident_r6",
         "bb_lean_sparse_confident_r6_p1", "fd_es_b32_la1", "fd_es_b64_la1", "fd_es_b32_la2", "fd_es_b64_la2",
         "fd_es_b32_la3", "fd_es_b64_la3", "fd_es_b64_la6", "fd_es_b32_la2_m8", "fd_es_b64_la2_m8", "fd_es_b32_la3_m8",
         "fd_es_b64_la3_m8", "fd_es_sparse_b32_r6", "fd_es_b32_sq_r6_la3_m8", "fd_es_b64_sq_r6_la3_m8",
         "fd_es_b32_sq_r6_la6_m8", "fd_es_b64_sq_r6_la6_m8", "fd_es_b32_sq_r6_la2_m8", "fd_es_b64_sq_r6_la2_m8",
         "fd_es_b32_sq_r6_la3_m16_ct", "fd_es_b64_sq_r6_la3_m16_ct", "fd_es_b32_sq_r6_la3_m16_ctr2",
         "fd_es_b64_sq_r6_la3_m16_ctr2", "fd_es_b32_sq_r6_la3_m16_ctr2_q2", "fd_es_b64_sq_r6_la3_m16_ctr2_q2",
         "fd_es_b32_sq_r6_la6_m16_ctr2_q2", "fd_es_b64_sq_r6_la6_m16_ctr2_q2")  # fmt: skip
#: folders of runs on the same items as ``paper_table/`` (method names do not repeat across them)
EXTRA = ("paper_table_extra", "paper_table_sparse", "paper_table_sparse_confident")
#: per-model runs of every suite on the same items (§11: ``<folder>/<model>/summary.json``); their
#: Fast-dLLM sweep repeats ``paper_table/``'s, so only their other methods are taken
PER_MODEL = ("paper_table_paired", "paper_table_paired_r6", "paper_table_paired_p1", "paper_table_lookahead",
             "paper_table_lookahead_gated", "paper_table_lookahead_sparse", "paper_table_lookahead_sparse_la2",
             "paper_table_lookahead_contained", "paper_table_lookahead_contained_r2", "paper_table_lookahead_budget",
             "paper_table_lookahead_budget_la6")


def _cells(folder: Path) -> dict[str, dict]:
    path = folder / "summary.json"
    if not path.is_file():
        return {}
    tasks = json.loads(path.read_text())["tasks"]
    return next(iter(tasks.values()))["methods"]


def _folder_cells(folder: Path) -> tuple[dict[str, dict], str]:
    """Every method run on a folder's items (its own and the extra folders'), and the tuned
    Fast-dLLM among them: early stop, the most accurate, ties to the lower NFE."""
    cells = _cells(folder)
    for extra in EXTRA:
        cells.update(_cells(RESULTS / extra / folder.name))
    model, suite = folder.name.rsplit("-", 1)
    for extra in PER_MODEL:
        path = RESULTS / extra / model / "summary.json"
        if path.is_file():
            theirs = json.loads(path.read_text())["tasks"].get(suite, {}).get("methods", {})
            cells.update({k: c for k, c in theirs.items() if k not in cells and not k.startswith("fast_dllm")})
    fast = [(k, c) for k, c in cells.items() if k.startswith("fast_dllm") and c.get("early_stop")]
    tuned, _ = max(fast, key=lambda kc: (kc[1]["accuracy"], -kc[1]["nfe_mean"]))
    return cells, tuned


def plots(out: Path = RESULTS / "paper_table_combined") -> list[Path]:
    """Per model, the accuracy-vs-NFE and accuracy-vs-query-tokens plots of every method of every
    folder above, one panel per suite, the Fast-dLLM block sweep as the fixed-block frontier and the
    tuned baseline starred: the Pareto points of issues 15 and 16 against it."""
    from hf_blockbatch.eval.runner import accuracy_plots

    by_model: dict[str, dict] = {}
    for folder in sorted((RESULTS / "paper_table").iterdir()):
        model, suite = folder.name.rsplit("-", 1)
        cells, tuned = _folder_cells(folder)
        by_model.setdefault(model, {"tasks": {}})["tasks"][suite] = {"methods": cells, "headline": {"tuned_fast_dllm": tuned}}
    paths = []
    for model, summary in by_model.items():
        (out / model).mkdir(parents=True, exist_ok=True)
        paths += accuracy_plots(summary, out / model)
    return paths


def rows() -> list[str]:
    out = ["| model / suite | method | accuracy % [95 % CI] | NFE | NFE (authors) | query tokens | NFE / tuned | query tokens / tuned |",
           "|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for folder in sorted((RESULTS / "paper_table").iterdir()):
        cells, tuned_name = _folder_cells(folder)
        tuned = cells[tuned_name]
        for name in ORDER:
            c = cells.get(name)
            if c is None:
                continue
            label = c["label"] + (" **(tuned)**" if c is tuned else "")
            lo, hi = (100 * x for x in c["ci95"])
            out.append(f"| {folder.name} | {label} | {100 * c['accuracy']:.1f} [{lo:.1f}, {hi:.1f}] | {c['nfe_mean']:.2f} | "
                       f"{c['nfe_authors_mean']:.2f} | {c['query_tokens_mean']:.0f} | {c['nfe_mean'] / tuned['nfe_mean']:.2f} | "
                       f"{c['query_tokens_mean'] / tuned['query_tokens_mean']:.2f} |")  # fmt: skip
    return out


if __name__ == "__main__":
    import sys

    print("\n".join(rows()))
    if "--plots" in sys.argv[1:]:
        print("\n".join(str(p) for p in plots()))
