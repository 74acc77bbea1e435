"""Runner-up drafts (``lookahead_runner_up``) in both drafted presets, on the suites' training items.

Why (RESULTS §49): with three drafts, the chained ``(0, 1)`` draft needs three masks, so once a window has two left its
row is parked, while the step it could stand for is often a single commit of a token the drafts do not hold: the
runner-up of a mask (code: ``return x + 3`` against ``return 3 + x``). The option drafts that token in the spare row.
This grid decodes each cell's tuned Fast-dLLM and both presets (``drafted()``, exact: the tokens are sparse
Fast-dLLM's with or without the option; ``drafted(exact=False)``) without and with the option, on items drawn from the
suites' training generators (never a test question): accuracy, mean NFE and query tokens against the tuned
Fast-dLLM, the paired accuracy difference against it and against the same preset without the option, and the share
of answers the option left unchanged.

    PYTHONPATH=$PWD python benchmarks/runner_up_grid.py --model tiny-llada --cells arith:96 code:96 lists:64 --limit 1000

Writes ``benchmarks/results/runner_up/<model>_<limit>.json`` and ``.md`` (``--out``: another folder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from beyond_paper import _FD, option_grid, option_grid_main, option_markdown

from hf_blockbatch.eval.script_args import run_main
from hf_blockbatch.generation.configs import DRAFTED, DRAFTED_CONTAINED

OUT = Path(__file__).resolve().parent / "results" / "runner_up"
#: the presets the option is measured in, by the names of the table's rows
PRESETS = {"drafted()": DRAFTED, "drafted(exact=False)": DRAFTED_CONTAINED}


def configs(block: int) -> dict[str, dict[str, Any]]:
    """The cell's decoders as bench configs: the tuned Fast-dLLM, then each preset without and with the option."""
    out = {"tuned": {**_FD, "block_length": block}}
    for name, preset in PRESETS.items():
        for on in (False, True):
            out[f"{name}{' + runner-up' if on else ''}"] = {**_FD, **preset, "block_length": block,
                                                            "lookahead_runner_up": on}  # fmt: skip
    return out


def grid(model: Any, tokenizer: Any, cells: list[tuple[str, int]], limit: int, batch_size: int) -> dict[str, Any]:
    """Every cell's decoders: summaries, paired accuracy differences against the tuned Fast-dLLM and against the same
    preset without the option, and the share of answers equal to that preset's."""
    return option_grid(model, tokenizer, cells, limit, batch_size, configs, lambda name: name.removesuffix(" + runner-up"))


def markdown(model: str, limit: int, res: dict[str, Any]) -> str:
    return "\n".join(option_markdown(res, f"Runner-up drafts on {model}'s training items ({limit} per suite)",
                                     "Accuracy Δ in points against the tuned Fast-dLLM (paired 95 % interval) and "
                                     "against the same preset without the option; NFE and query tokens × the tuned "
                                     "Fast-dLLM's; answers equal to that preset's.", same_answers=True)) + "\n"  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    option_grid_main(argv, __doc__, OUT, lambda p: None,
                     lambda model, tok, cells, a: grid(model, tok, cells, a.limit, a.batch_size), markdown)


if __name__ == "__main__":
    raise SystemExit(run_main(main))
