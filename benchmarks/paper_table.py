"""The paper's Table 1 shape on the tiny checkpoints, against the tuned baseline, from bench folders.

``python benchmarks/paper_table.py`` reads ``benchmarks/results/paper_table/<model>-<suite>/summary.json``
(and ``paper_table_extra/``, ``paper_table_sparse/``, ``paper_table_sparse_confident/`` and the per-model
``paper_table_paired*/<model>/`` and ``paper_table_lookahead*/<model>/``, where the reference variant and the beyond-paper configs ran on the
same items) and prints one Markdown row per method: accuracy, NFE, NFE as the authors count it, query
tokens, and the NFE and query-token ratios to the tuned Fast-dLLM (early stop, the sweep's most accurate block,
ties to the lower NFE). Latency is left out on purpose: these runs shared the two cores, see RESULTS §8.
``--plots`` also draws every method of those folders on one accuracy-vs-NFE and one
accuracy-vs-query-tokens plot per model (``paper_table_combined/<model>/``).

``--targets`` writes issue 16's scorecard from the same runs (``results/targets/``): ``targets.md`` and
``targets.json``, one row per checkpoint and suite with the shipped point against each target, and two
plots (accuracy against NFE and against query tokens, a panel per checkpoint and suite) that show only
the baselines, the named presets and the target region, so the shipped point can be read off. Each
preset's run is found by its config (as ``run.json`` recorded it), not by a bench name, so a renamed
bench config cannot put another decoder under a preset's label. ``--heldout-sweep`` first records the tuned block
picked on training items (``results/targets/heldout_blocks.json``, from ``beyond_paper.py`` runs of the block
sweep), and the scorecard then adds the same table against the baseline at that block (RESULTS §36).
``--latency`` first records the CPU time per item of the tuned baseline and of the shipped preset, timed side by
side on the test splits at batch 1 and 32 by ``beyond_paper.py --split test --rounds k`` (``results/targets/latency.json``;
each run found by its config, and refused unless it decoded what the bench's runs decoded), and the scorecard then
judges the fifth target, the CPU latency, with the others (RESULTS §47).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_blockbatch.eval.runner import _replace_files, in_tuned_pool, tuned_fast_dllm
from hf_blockbatch.eval.script_args import read_json, run_main
from hf_blockbatch.eval.stats import paired_time_ratio

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
         "fd_es_b32_sq_r6_la6_m16_ctr2_q2", "fd_es_b64_sq_r6_la6_m16_ctr2_q2", "fast_dllm_b48", "fast_dllm_b80",
         "fast_dllm_b96", "fd_es_sparse_b48_r6", "fd_es_sparse_b80_r6", "fd_es_sparse_b96_r6", "fd_es_b48_sq_r6_la3_m8",
         "fd_es_b80_sq_r6_la3_m8", "fd_es_b96_sq_r6_la3_m8", "fd_es_b48_sq_r6_la3_m16_ctr2_q2",
         "fd_es_b80_sq_r6_la3_m16_ctr2_q2", "fd_es_b96_sq_r6_la3_m16_ctr2_q2")  # fmt: skip
#: folders of runs on the same items as ``paper_table/`` (method names do not repeat across them);
#: ``paper_table_blocks/`` completes the tuned baseline's block sweep to every multiple of 16 up to the generation
#: length (48, 80 and 96 beside 16, 32 and 64), with the presets at the blocks it finds most accurate (RESULTS §35);
#: ``paper_table_heldout/`` the shipped preset at the blocks picked on training items instead (§36);
#: ``paper_table_many_masks/`` and ``_heldout/`` the preset with §48's lower threshold above 16 masks, at both picks;
#: ``paper_table_runner_up/`` and ``_heldout/`` both drafted presets with §49's runner-up drafts
EXTRA = ("paper_table_extra", "paper_table_sparse", "paper_table_sparse_confident", "paper_table_blocks",
         "paper_table_heldout", "paper_table_many_masks", "paper_table_many_masks_heldout", "paper_table_runner_up",
         "paper_table_runner_up_heldout")
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
    Fast-dLLM among them (``eval.runner.tuned_fast_dllm``: the block sweep's points with early stop and
    ``fast_dllm_early_stop``, the most accurate, ties to the lower NFE)."""
    cells = _cells(folder)
    for extra in EXTRA:
        cells.update(_cells(RESULTS / extra / folder.name))
    model, suite = folder.name.rsplit("-", 1)
    for extra in PER_MODEL:
        path = RESULTS / extra / model / "summary.json"
        if path.is_file():
            theirs = json.loads(path.read_text())["tasks"].get(suite, {}).get("methods", {})
            cells.update({k: c for k, c in theirs.items() if k not in cells and not k.startswith("fast_dllm")})
    return cells, tuned_fast_dllm(cells)


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


# ------------------------------------------------------------------------------- issue 16's targets

TARGETS = RESULTS / "targets"
#: the tuned block picked on training items (``--heldout-sweep``), for the scorecard's held-out table
HELDOUT = TARGETS / "heldout_blocks.json"
#: the issue's thresholds: accuracy within this many points of the tuned baseline, NFE under these
#: fractions of the tuned and of the paper's baseline, query tokens under this fraction of the tuned
ACC_POINTS, NFE_TUNED, NFE_PAPER, QUERY_TUNED = 1.0, 0.75, 0.5, 1.0
#: the CPU latency of the tuned baseline and of the shipped preset, side by side on the test splits (``--latency``)
LATENCY = TARGETS / "latency.json"
#: the issue's latency target: the shipped preset's time per item at most this multiple of the tuned baseline's, at
#: each of these batch sizes
TIME_TUNED, LATENCY_BATCHES = 1.0, (1, 32)


def _presets() -> dict[str, tuple[Callable[[int, int], Any], bool]]:
    """Label -> (the config that label stands for at a generation length and the tuned block, drawn as
    the shipped point): the decoders a user meets by name, each found in the runs by its config."""
    import hf_blockbatch as hb
    from hf_blockbatch.eval.runner import build_method_configs

    def bench(name: str) -> Callable[[int, int], Any]:
        return lambda gen, block: build_method_configs([name], gen)[name]

    return {
        "Fast-dLLM, the paper's baseline": (bench("fast_dllm"), False),
        "BlockBatch, the authors' reference": (bench("blockbatch_reference"), False),
        "BlockBatch, the paper's defaults": (bench("blockbatch"), False),
        "BlockBatchConfig.lean()": (lambda gen, block: hb.BlockBatchConfig.lean(max_new_tokens=gen), False),
        "FastDLLMConfig.drafted()": (lambda gen, block: hb.FastDLLMConfig.drafted(max_new_tokens=gen, block_length=block), False),
        "FastDLLMConfig.drafted(exact=False)": (
            lambda gen, block: hb.FastDLLMConfig.drafted(exact=False, max_new_tokens=gen, block_length=block), True),
    }  # fmt: skip


def _recorded(model: str, suite: str) -> tuple[dict[str, dict], int]:
    """Every method's config as its run recorded it (``run.json``, ``to_diff_dict`` at run time) over the
    folders :func:`_folder_cells` reads, and the suite's generation length."""
    folders = [RESULTS / d / f"{model}-{suite}" for d in ("paper_table", *EXTRA)] + [RESULTS / d / model for d in PER_MODEL]
    configs: dict[str, dict] = {}
    gens = set()
    for folder in folders:
        path = folder / "run.json"
        task = json.loads(path.read_text())["tasks"].get(suite) if path.is_file() else None
        if task is not None:
            gens.add(task["gen_length"])
            for name, cfg in task["configs"].items():
                configs.setdefault(name, cfg)
    if len(gens) != 1:
        raise SystemExit(f"{model} {suite}: the runs disagree on the generation length ({sorted(gens)}) or are absent.")
    return configs, gens.pop()


def same_config(recorded: Mapping[str, Any], cfg: Any) -> bool:
    """Whether a config recorded by an earlier run is ``cfg``: every field equal, a field the recorded one
    lacks (added since) at its default, the transformers version aside."""
    now, default = cfg.to_diff_dict(), type(cfg)().to_diff_dict()
    keys = (set(recorded) | set(now)) - {"transformers_version"}
    return all(recorded.get(k, default.get(k)) == now.get(k, default.get(k)) for k in keys)


def _score_row(folder: Path, cells: Mapping[str, dict], tuned_name: str, presets: Mapping[str, tuple]) -> dict[str, Any]:
    """A checkpoint and suite's row of the scorecard against the baseline ``tuned_name``: each preset's run at that
    baseline's block (found by its config), the paper's baseline, and the shipped preset's ratios against the
    targets."""
    model, suite = folder.name.rsplit("-", 1)
    tuned = cells[tuned_name]
    block = tuned["block"]
    recorded, gen = _recorded(model, suite)
    found: dict[str, str | None] = {}
    for label, (make, _) in presets.items():
        cfg = make(gen, block)
        names = [n for n, r in recorded.items() if n in cells and same_config(r, cfg)]
        found[label] = names[0] if names else None
    shipped_label = next(label for label, (_, shipped) in presets.items() if shipped)
    paper, shipped, ref = (cells[found[k]] if found[k] else None for k in
                           ("Fast-dLLM, the paper's baseline", shipped_label, "BlockBatch, the authors' reference"))  # fmt: skip
    if paper is None or shipped is None:
        raise SystemExit(f"{folder.name}: no run of the paper's baseline or of {shipped_label} at block {block}.")
    delta = 100 * (shipped["accuracy"] - tuned["accuracy"])
    row = {
        "model": model, "suite": suite, "gen_length": gen, "tuned": tuned_name, "tuned_block": block,
        "methods": found, "shipped": found[shipped_label], "accuracy_points_vs_tuned": delta,
        "above_reference": None if ref is None else shipped["accuracy"] >= ref["accuracy"],
        "nfe_vs_tuned": shipped["nfe_mean"] / tuned["nfe_mean"], "nfe_vs_paper": shipped["nfe_mean"] / paper["nfe_mean"],
        "query_tokens_vs_tuned": shipped["query_tokens_mean"] / tuned["query_tokens_mean"],
    }  # fmt: skip
    row["met"] = {
        "accuracy": delta >= -ACC_POINTS - 1e-9 and row["above_reference"] is not False,
        "nfe_vs_tuned": row["nfe_vs_tuned"] <= NFE_TUNED, "nfe_vs_paper": row["nfe_vs_paper"] <= NFE_PAPER,
        "query_tokens": row["query_tokens_vs_tuned"] <= QUERY_TUNED,
    }  # fmt: skip
    row["cells"] = {k: cells[k] for k in {tuned_name, *(n for n in found.values() if n)}}
    row["frontier"] = sorted((k for k, c in cells.items() if in_tuned_pool(k, c)), key=lambda k: cells[k]["block"])
    row["cells"].update({k: cells[k] for k in row["frontier"]})
    return row


def scorecard(latency: bool = True) -> list[dict[str, Any]]:
    """One entry per checkpoint and suite: the tuned baseline (:func:`_folder_cells`), the paper's, each
    preset's run (``None`` where it did not run, e.g. the authors' reference on Dream) and the shipped
    preset's ratios against the targets; with ``latency`` and a recorded :data:`LATENCY`, the CPU time too."""
    presets = _presets()
    out = []
    for folder in sorted((RESULTS / "paper_table").iterdir()):
        cells, tuned_name = _folder_cells(folder)
        out.append(_score_row(folder, cells, tuned_name, presets))
    if latency and LATENCY.is_file():
        _judge_latency(out, json.loads(LATENCY.read_text()))
    return out


def latency_runs(paths: Sequence[Path]) -> dict[str, dict[str, dict[str, Any]]]:
    """The CPU latency target's figures, from ``beyond_paper.py --split test --rounds k`` runs (RESULTS §47): per
    checkpoint, suite and batch size, the time per item of the scorecard's tuned baseline and of its shipped preset
    (each found in the run by its config, as the scorecard finds the bench's runs), the ratio of their total times over
    the rounds (``paired_time_ratio``: each round's pair kept together; the ratio of the two medians before §52) and
    each round's own ratio (round-robin rounds: both sides of a pair timed in the same stretch; with ``--interleave``,
    batch by batch, RESULTS §50). A run is taken only if it decoded the whole test split as the bench's runs did (the
    same accuracy and mean NFE: the same decoders on the same items), so the time is that of the decodes the other
    targets judge."""
    from hf_blockbatch.generation.configs import config_from_dict

    rows = {(r["model"], r["suite"]): r for r in scorecard(latency=False)}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for path in paths:
        try:
            run = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SystemExit(f"{path}: cannot read it as a beyond_paper.py run ({err}).") from err
        if (not isinstance(run, dict) or run.get("split") != "test" or run.get("batch_size") is None
                or (run.get("rounds") or 1) < 2 or not {"model", "suites", "configs"} <= run.keys()):  # fmt: skip
            raise SystemExit(f"{path}: not a latency run on the test split (beyond_paper.py --split test --rounds 3).")
        bs, model = run["batch_size"], Path(run["model"]).name
        for suite, results in run["suites"].items():
            row = rows.get((model, suite))
            if row is None:
                raise SystemExit(f"{path}: the scorecard has no {model} {suite}.")
            recorded, gen = _recorded(model, suite)
            sides: dict[str, Any] = {}
            for side in ("tuned", "shipped"):
                bench = row["cells"][row[side]]
                names = [n for n in results if same_config(recorded[row[side]],
                                                           config_from_dict({"max_new_tokens": gen, **run["configs"][n]}))]
                if not names:
                    raise SystemExit(f"{path}: {model} {suite} has no run of the {side} decoder ({row[side]}).")
                r = results[names[0]]
                if r["n"] != bench["n"] or abs(r["nfe"] - bench["nfe_mean"]) > 1e-9 or abs(r["acc"] - 100 * bench["accuracy"]) > 1e-9:
                    raise SystemExit(f"{path}: {model} {suite} {names[0]} decoded otherwise than the bench's {row[side]} "
                                     f"({r['n']} items, NFE {r['nfe']:.4f}, accuracy {r['acc']:.1f} % against {bench['n']}, "
                                     f"{bench['nfe_mean']:.4f}, {100 * bench['accuracy']:.1f} %).")  # fmt: skip
                sides[side] = {"name": names[0], "decoder": row[side], "ms_item": r["ms_item"],
                               "policy_ms_item": r["policy_ms_item"], "round_seconds": r["rounds"]}  # fmt: skip
            tuned, shipped = sides["tuned"]["round_seconds"], sides["shipped"]["round_seconds"]
            out.setdefault(model, {}).setdefault(suite, {})[str(bs)] = {
                "source": Path(path).name, "items": results[sides["tuned"]["name"]]["n"], "rounds": len(tuned),
                "interleaved": bool(run.get("interleave")),
                "block": row["tuned_block"], **sides, "ratio": paired_time_ratio(shipped, tuned),
                "round_ratios": [a / b for a, b in zip(shipped, tuned)],
            }  # fmt: skip
    return out


def _judge_latency(card: list[dict[str, Any]], recorded: Mapping[str, Any]) -> None:
    """Each row's CPU time at :data:`LATENCY_BATCHES` from :data:`LATENCY`, and the latency target met where the shipped
    preset's ratio is at most :data:`TIME_TUNED` at every batch size (``None``: not measured). A recording made at
    another tuned block than the scorecard's, or of other decoders than the ones it scores (the bench run each side was
    matched to: a preset that changed since), is stale: refused."""
    for row in card:
        times = recorded.get(row["model"], {}).get(row["suite"], {})
        for t in times.values():
            if t["block"] != row["tuned_block"]:
                raise SystemExit(f"{LATENCY}: {row['model']} {row['suite']} was timed at block {t['block']}, the tuned block is "
                                 f"{row['tuned_block']}: re-record it (paper_table.py --targets --latency ...).")  # fmt: skip
            for side in ("tuned", "shipped"):
                if t[side].get("decoder") != row[side]:
                    raise SystemExit(f"{LATENCY}: {row['model']} {row['suite']} timed {t[side].get('decoder')} as the {side} "
                                     f"decoder, the scorecard scores {row[side]}: re-record it (paper_table.py --targets "
                                     "--latency ...).")  # fmt: skip
        row["latency"] = {str(bs): times[str(bs)] for bs in LATENCY_BATCHES if str(bs) in times}
        measured = len(row["latency"]) == len(LATENCY_BATCHES)
        row["met"]["cpu_time"] = all(t["ratio"] <= TIME_TUNED for t in row["latency"].values()) if measured else None


def heldout_blocks(sweeps: Sequence[Path]) -> dict[str, dict[str, dict[str, Any]]]:
    """The tuned block picked on *training* items: per checkpoint and suite, from ``beyond_paper.py`` runs of
    Fast-dLLM with early stop over the test sweep's blocks (every multiple of 16 up to the generation length), each
    block's accuracy and NFE and the block :func:`~hf_blockbatch.eval.runner.tuned_fast_dllm` picks among them. A run
    counts as a block's only if its config is that sweep point's (``same_config``)."""
    from hf_blockbatch.eval.runner import SWEEP_PREFIX, build_method_configs, load_task, sweep_block_sizes
    from hf_blockbatch.generation.configs import config_from_dict

    picks: dict[str, dict[str, dict[str, Any]]] = {}
    for path in sweeps:
        # a file that is not such a run is said in one line (it was a traceback), before anything is recorded
        run = read_json(path, dict, "a beyond_paper.py run of the block sweep (RESULTS §36)")
        if not {"model", "limit", "suites", "configs"} <= run.keys() or not isinstance(run["suites"], dict):
            raise ValueError(f"{path}: not a beyond_paper.py run (it lacks model, limit, suites or configs): give the "
                             "runs of the block sweep of RESULTS §36")  # fmt: skip
        for suite, results in run["suites"].items():
            gen = int(load_task(suite).default_gen_length)
            points = build_method_configs([], gen, {}, "auto")
            cells: dict[str, dict[str, Any]] = {}
            for name, r in results.items():
                recorded = config_from_dict({"max_new_tokens": gen, **run["configs"][name]}).to_diff_dict()
                for point, cfg in points.items():
                    if point not in cells and same_config(recorded, cfg):
                        cells[point] = {"accuracy": r["acc"] / 100, "nfe_mean": r["nfe"], "block": cfg.block_length,
                                        "early_stop": True, "n": r["n"]}  # fmt: skip
            missing = [b for b in sweep_block_sizes("auto", gen) if f"{SWEEP_PREFIX}{b}" not in cells]
            if missing:
                raise SystemExit(f"{path}: {run['model']} {suite} has no run of the sweep's blocks {missing}.")
            pick = tuned_fast_dllm(cells)
            picks.setdefault(run["model"], {})[suite] = {
                "source": Path(path).name, "items": run["limit"], "block": cells[pick]["block"],
                "blocks": {str(c["block"]): {"accuracy": c["accuracy"], "nfe_mean": c["nfe_mean"]} for c in cells.values()},
            }  # fmt: skip
    return picks


def heldout_scorecard() -> list[dict[str, Any]]:
    """The scorecard against the baseline at the block picked on training items (:data:`HELDOUT`), read on the
    test split: neither the baseline's block nor the preset's is chosen on the items it is judged on. Empty
    when no held-out pick is recorded."""
    if not HELDOUT.is_file():
        return []
    picks = json.loads(HELDOUT.read_text())
    presets = _presets()
    out = []
    for folder in sorted((RESULTS / "paper_table").iterdir()):
        model, suite = folder.name.rsplit("-", 1)
        pick = picks.get(model, {}).get(suite)
        if pick is None:
            continue
        cells, _ = _folder_cells(folder)
        at_block = {k: c for k, c in cells.items() if in_tuned_pool(k, c) and c["block"] == pick["block"]}
        if not at_block:
            raise SystemExit(f"{folder.name}: no test run of Fast-dLLM with early stop at block {pick['block']}.")
        row = _score_row(folder, cells, tuned_fast_dllm(at_block), presets)
        row["heldout"] = pick
        out.append(row)
    return out


def _card_markdown(card: list[dict[str, Any]], tuned_header: str) -> list[str]:
    """A scorecard's table and its targets met, as Markdown lines."""
    timed = any(r.get("latency") for r in card)
    batches = " · ".join(map(str, LATENCY_BATCHES))
    lines = [f"| model / suite | {tuned_header} | shipped: Δ accuracy (points) | ≥ reference | NFE / tuned | NFE / paper | "
             "query tokens / tuned |" + (f" CPU time / tuned, batch {batches} [rounds] |" if timed else ""),
             "|---|---|---:|---|---:|---:|---:|" + ("---|" if timed else "")]  # fmt: skip

    def mark(value: str, met: bool) -> str:
        return f"**{value}**" if met else f"{value} ✗"

    for r in card:
        t = r["cells"][r["tuned"]]
        ref = {None: "—", True: "yes", False: "no ✗"}[r["above_reference"]]
        acc = mark(format(r["accuracy_points_vs_tuned"], "+.1f").replace("-", "−"), r["met"]["accuracy"])
        nfe = mark(format(r["nfe_vs_tuned"], ".3f"), r["met"]["nfe_vs_tuned"])
        paper = mark(format(r["nfe_vs_paper"], ".2f"), r["met"]["nfe_vs_paper"])
        qt = mark(format(r["query_tokens_vs_tuned"], ".2f"), r["met"]["query_tokens"])
        times = [r.get("latency", {}).get(str(bs)) for bs in LATENCY_BATCHES]
        cpu = " · ".join("—" if x is None else mark(f"{x['ratio']:.3f} [{min(x['round_ratios']):.2f}–{max(x['round_ratios']):.2f}]",
                                                       x["ratio"] <= TIME_TUNED) for x in times)  # fmt: skip
        lines.append(f"| {r['model']} {r['suite']} | {100 * t['accuracy']:.1f} % · {t['nfe_mean']:.2f} NFE · "
                     f"{t['query_tokens_mean']:.0f} qt (b{r['tuned_block']}) | {acc} | {ref} | {nfe} | {paper} | {qt} |"
                     + (f" {cpu} |" if timed else ""))  # fmt: skip
    lines.append("")
    names = {"accuracy": f"accuracy ≥ tuned − {ACC_POINTS:g} point and ≥ the reference's",
             "nfe_vs_tuned": f"NFE ≤ {NFE_TUNED}× tuned", "nfe_vs_paper": f"NFE ≤ {NFE_PAPER}× the paper's baseline",
             "query_tokens": f"query tokens ≤ {QUERY_TUNED}× tuned"}  # fmt: skip
    if all(r["met"].get("cpu_time") is not None for r in card):
        sample = card[0]["latency"][str(LATENCY_BATCHES[0])]
        every = [t for r in card for t in r["latency"].values()]
        paired = " interleaved batch by batch" if all(t.get("interleaved") for t in every) else ""
        names["cpu_time"] = (f"CPU time per item ≤ {TIME_TUNED:g}× tuned at batch {' and '.join(map(str, LATENCY_BATCHES))} "
                             f"(the ratio of the total times of {sample['rounds']} side-by-side rounds{paired} on the "
                             f"{sample['items']} test items, one thread; `{LATENCY.name}`)")  # fmt: skip
    for key, name in names.items():
        missed = [f"{r['model']} {r['suite']}" for r in card if not r["met"][key]]
        lines.append(f"* {name}: met on {len(card) - len(missed)} of {len(card)}" + (f" (missed: {', '.join(missed)})" if missed else ""))
    return lines


def targets_markdown(card: list[dict[str, Any]], heldout: list[dict[str, Any]] | None = None) -> str:
    """The scorecard as Markdown: a row per checkpoint and suite, then each target met on n of 6; with ``heldout``
    (:func:`heldout_scorecard`), the same against the block picked on training items."""
    lines = _card_markdown(card, "tuned (block)")
    if heldout:
        items = sorted({r["heldout"]["items"] for r in heldout})
        lines += ["", "## Against the block picked on training items", "",
                  "The issue picks the tuned block on the test split it reports on, which flatters the baseline (the "
                  "best of six blocks on the items it is judged on). Here the block is picked by the same rule on "
                  f"{', '.join(map(str, items))} training items per suite (`{HELDOUT.name}`), and both the baseline and "
                  "the shipped preset are read on the test split at that block.", "",
                  *_card_markdown(heldout, "baseline at the training pick (test split)")]  # fmt: skip
    return "\n".join(lines) + "\n"


def targets_plots(card: list[dict[str, Any]], out: Path) -> list[Path]:
    """Accuracy against NFE and against query tokens, a panel per checkpoint and suite: the fixed-block
    frontier, the tuned baseline starred, the presets with their Wilson intervals, the shipped one
    outlined, and the region the targets ask for shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = _presets()
    markers = dict(zip(presets, ("X", "v", "s", "D", "^", "o")))
    colors = dict(zip(presets, ("tab:gray", "tab:orange", "tab:red", "tab:purple", "tab:olive", "tab:green")))
    models = list(dict.fromkeys(r["model"] for r in card))
    suites = list(dict.fromkeys(r["suite"] for r in card))
    paths = []
    axes_ = (("nfe_mean", "mean NFE per request", "accuracy_vs_nfe.png",
              f"NFE ≤ {NFE_TUNED}× tuned and ≤ {NFE_PAPER}× the paper's baseline"),
             ("query_tokens_mean", "mean query tokens per request", "accuracy_vs_query_tokens.png",
              f"query tokens ≤ {QUERY_TUNED}× tuned"))  # fmt: skip
    for x_key, x_name, fname, x_target in axes_:
        fig, axes = plt.subplots(len(models), len(suites), figsize=(5.0 * len(suites), 4.0 * len(models) + 1.4), squeeze=False)
        for r in card:
            ax = axes[models.index(r["model"]), suites.index(r["suite"])]
            cells, tuned = r["cells"], r["cells"][r["tuned"]]
            paper = cells[r["methods"]["Fast-dLLM, the paper's baseline"]]
            bound = (min(NFE_TUNED * tuned["nfe_mean"], NFE_PAPER * paper["nfe_mean"]) if x_key == "nfe_mean"
                     else QUERY_TUNED * tuned["query_tokens_mean"])  # fmt: skip
            floor = 100 * tuned["accuracy"] - ACC_POINTS
            ax.axhline(floor, color="tab:green", lw=0.8, ls=":")
            ax.axvline(bound, color="tab:green", lw=0.8, ls=":")
            ax.fill_between([0, bound], floor, 100, color="tab:green", alpha=0.14, lw=0,
                            label=f"the targets: accuracy ≥ tuned − {ACC_POINTS:g} point, {x_target}")  # fmt: skip
            front = [cells[k] for k in r["frontier"]]
            ax.plot([c[x_key] for c in front], [100 * c["accuracy"] for c in front], "o--", color="tab:blue", alpha=0.6,
                    label="Fast-dLLM + early stop, by block (fixed-block frontier)")  # fmt: skip
            for c in front:
                ax.annotate(f"b{c['block']}", (c[x_key], 100 * c["accuracy"]), textcoords="offset points", xytext=(4, -10),
                            fontsize=7, color="tab:blue")  # fmt: skip
            ax.plot([tuned[x_key]], [100 * tuned["accuracy"]], "*", markersize=15, color="tab:blue", label="tuned Fast-dLLM")
            for label, name in r["methods"].items():
                if name is None:
                    continue
                c, shipped = cells[name], presets[label][1]
                acc, (lo, hi) = 100 * c["accuracy"], c["ci95"]
                ax.errorbar([c[x_key]], [acc], yerr=[[acc - 100 * lo], [100 * hi - acc]], fmt=markers[label], capsize=3,
                            color=colors[label], markersize=10 if shipped else 6, markeredgecolor="black" if shipped else None,
                            label=label + (" (shipped point)" if shipped else ""))  # fmt: skip
            ys = [100 * cells[k]["accuracy"] for k in cells]
            ax.set_ylim(min(min(ys), floor) - 6, max(ys) + 5)
            ax.set_xlim(0, 1.08 * max(max(cells[k][x_key] for k in cells), bound))
            ax.set_title(f"{r['model']} · {r['suite']}", fontsize=10)
            ax.set_xlabel(x_name, fontsize=9)
            ax.set_ylabel("accuracy (%)", fontsize=9)
            ax.grid(alpha=0.3)
        handles: dict[str, Any] = {}
        for ax in axes.flat:
            for h, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, h)
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=3, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 1.2 / (4.0 * len(models) + 1.4), 1, 1))
        out.mkdir(parents=True, exist_ok=True)
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        paths.append(out / fname)
    return paths


def write_targets(out: Path = TARGETS) -> list[Path]:
    """``targets.md``, ``targets.json`` and the two plots under ``out``. The two texts are written beside their
    places, then moved in (``runner._replace_files``): a write that failed (a full disk) left a new ``targets.md``
    beside the earlier ``targets.json``, or a cut one; now it leaves the earlier pair whole."""
    card, heldout = scorecard(), heldout_scorecard()

    def strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k != "cells"} for r in rows]

    _replace_files({out / "targets.md": targets_markdown(card, heldout),
                    out / "targets.json": json.dumps({"test_pick": strip(card), "training_pick": strip(heldout)}, indent=1)})  # fmt: skip
    return [out / "targets.md", out / "targets.json", *targets_plots(card, out)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plots", action="store_true", help="also draw every method on one plot pair per model")
    p.add_argument("--targets", action="store_true", help="write issue 16's scorecard (results/targets/) instead of the rows")
    p.add_argument("--latency", nargs="+", type=Path, metavar="JSON",
                   help="with --targets: first record the CPU latency target's times, from beyond_paper.py --split test "
                        "latency runs at batch 1 and 32 (RESULTS §47)")
    p.add_argument("--heldout-sweep", nargs="+", type=Path, metavar="JSON",
                   help="with --targets: first record the tuned block picked on training items, from beyond_paper.py runs "
                        "of the block sweep (RESULTS §36), for the scorecard's held-out table")  # fmt: skip
    args = p.parse_args(argv)
    # each records what the scorecard reads from runs of beyond_paper.py, before the scorecard is written
    for flag, files, out, record, section in (("--heldout-sweep", args.heldout_sweep, HELDOUT, heldout_blocks, 36),
                                              ("--latency", args.latency, LATENCY, latency_runs, 47)):  # fmt: skip
        if not files:
            continue
        if not args.targets:
            p.error(f"{flag} goes with --targets")
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            p.error(f"no such file: {', '.join(missing)} (run the beyond_paper.py commands of RESULTS §{section} first)")
        _replace_files({out: json.dumps(record(files), indent=1) + "\n"})  # a failed write keeps the earlier record whole
    if args.targets:
        print("\n".join(str(path) for path in write_targets()))
        return
    print("\n".join(rows()))
    if args.plots:
        print("\n".join(str(path) for path in plots()))


if __name__ == "__main__":
    raise SystemExit(run_main(main))
