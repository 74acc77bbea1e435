"""``hf-blockbatch``: the command line.

``hf-blockbatch generate`` answers one prompt with Fast-dLLM (dual cache, block 32, τ 0.9, the
paper's baseline) and BlockBatch (default settings) side by side, then with the baseline to beat,
Fast-dLLM with early stop, and with its lookahead drafts (``FastDLLMConfig.drafted()``, exact, and
``drafted(exact=False)``, contained), with NFE, query tokens, the K/V cache rows each keeps per request
(one per branch or draft row: what bounds the batch on a GPU) and wall time, on the embedded tiny
LLaDA by default or on any supported checkpoint (``--model``).

``hf-blockbatch bench`` runs vanilla, Fast-dLLM (with and without early stop) and BlockBatch on
task suites and benchmarks and writes per-sample JSONL, a Markdown table with the paper's columns
and plots (see :mod:`hf_blockbatch.eval.runner`). Under ``accelerate launch`` it shards the samples
over the processes and process 0 merges them.

``hf-blockbatch demo`` serves the Gradio app of ``demo/app.py`` (Fast-dLLM and BlockBatch side by
side, replayed forward by forward) on this machine.

``hf-blockbatch lm-eval ...`` is lm-evaluation-harness's own command line (the same arguments as
``lm_eval``) with ``--model hf_blockbatch`` registered, and NFE reported per task and per logged
sample (see :mod:`hf_blockbatch.eval.lm_eval_model`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hf_blockbatch.eval.script_args import (
    STOPPED,
    finite_float,
    nonnegative_int,
    positive_int,
    refused_status,
    stopped_status,
    tolerant_stdout,
)

__all__ = ["main"]

# an item of the arith suite's test split (never trained on) that the embedded tiny-llada answers
# right with both strategies at this command's defaults (a test checks it), as in the README's example
DEFAULT_PROMPT = (
    "A lamp costs 2 dollars and a toy costs 2 dollars. Sara buys 4 lamps and one toy. How many dollars does she spend?"
)


def _encode(tokenizer: Any, prompt: str, chat: bool) -> torch.Tensor:
    from hf_blockbatch.tasks.contract import apply_chat

    return tokenizer(apply_chat(prompt, tokenizer, chat), add_special_tokens=False, return_tensors="pt").input_ids


def _prompt(text: str) -> str:
    """A prompt with some text: an empty one would decode from the chat template alone (gibberish),
    which the API and the demo refuse too."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the prompt is empty: give some text, e.g. --prompt 'What is 3 + 4?'")
    return text


def port_number(text: str) -> int:
    """An argparse type for ``--port`` (``hf-blockbatch demo`` and ``demo/app.py``): 1-65535, else argparse's
    one-line usage error."""
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a port number (1-65535), got {text!r}") from err
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {value}")
    return value


#: the fewest new tokens a visitor of the demo can ask for: its slider starts (and steps) here (demo/app.py)
DEMO_MIN_NEW_TOKENS = 8


def demo_max_new_tokens(text: str) -> int:
    """The demo's ``--max-new-tokens``: the slider's upper end, at least where it starts. Below it every request was
    refused ("Max new tokens must be between 8 and 5"), on a page that looked fine. ``hf-blockbatch demo`` refuses
    it here, before importing the app (Gradio) and loading the model; ``python demo/app.py`` with the same type."""
    value = positive_int(text)
    if value < DEMO_MIN_NEW_TOKENS:
        raise argparse.ArgumentTypeError(f"the slider starts at {DEMO_MIN_NEW_TOKENS} new tokens, got {value}")
    return value


def cmd_generate(args: argparse.Namespace) -> int:
    """``hf-blockbatch generate``: the prompt's answers and their costs (see the module docstring) on stdout."""
    from hf_blockbatch import BlockBatchConfig, FastDLLMConfig, answer_texts, end_token_ids
    from hf_blockbatch.hub import load_model

    common = {"max_new_tokens": args.max_new_tokens, "threshold": args.threshold}
    # the paper's baseline, BlockBatch, and (beyond the paper, RESULTS §8, §13) the baseline to beat:
    # Fast-dLLM with early stop, and the same with exact lookahead drafts
    configs = {
        "Fast-dLLM (dual, block 32, τ 0.9)": FastDLLMConfig(**common, block_length=32, cache="dual"),
        "BlockBatch (blocks 4…128)": BlockBatchConfig(**common),
        "Fast-dLLM + early stop (block 32)": FastDLLMConfig(**common, block_length=32, early_stop=True),
        "Fast-dLLM drafted() (early stop, sparse queries, 3 exact drafts)": FastDLLMConfig.drafted(**common),
        "Fast-dLLM drafted(exact=False) (drafts also adopted when the step committed more)":
            FastDLLMConfig.drafted(exact=False, **common),
    }
    # the configs first: a bad --threshold is said before the model loads
    model, tokenizer = load_model(args.model, device=args.device)
    ids = _encode(tokenizer, args.prompt, chat=not args.no_chat).to(model.device)
    print(f"model: {args.model}  device: {model.device}  prompt: {args.prompt!r}\n")
    rows = []
    for name, cfg in configs.items():
        start = time.perf_counter()
        out = model.generate(ids, generation_config=cfg, return_dict_in_generate=True)
        seconds = time.perf_counter() - start
        text = answer_texts(tokenizer, out.sequences[:, ids.shape[1] :], end_token_ids(tokenizer, model.config))[0].strip()
        nfe, stats = int(out.nfe[0]), out.stats[0]
        rows.append((nfe, seconds))
        extra = (f"drafts adopted {stats['lookahead_adopted']}" if "lookahead_adopted" in stats
                 else f"winner block {stats['winner_block_size']}")  # fmt: skip
        # every config here keeps a dual cache: one K/V row per branch (or draft row) of the request
        print(f"── {name}\n{text}\n   NFE {nfe}   query tokens {stats['query_tokens']}   K/V rows {len(stats['branches'])}   "
              f"{seconds:.2f} s   {extra}\n")
    (nfe_f, t_f), (nfe_b, t_b), (nfe_e, _), (nfe_d, _), (nfe_c, _) = rows
    print(f"BlockBatch / Fast-dLLM: NFE {nfe_b}/{nfe_f} = {nfe_b / nfe_f:.2f}, time {t_b / t_f:.2f}x")
    print(f"against Fast-dLLM + early stop (NFE {nfe_e}): BlockBatch {nfe_b / nfe_e:.2f}x, drafted() {nfe_d / nfe_e:.2f}x, "
          f"drafted(exact=False) {nfe_c / nfe_e:.2f}x")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def _sweep_blocks(text: str) -> list[int] | str:
    """Comma-separated block sizes, or ``auto`` / ``auto:S`` (``eval.runner.sweep_block_sizes``)."""
    from hf_blockbatch.eval.runner import sweep_block_sizes

    if text.startswith("auto"):
        try:
            sweep_block_sizes(text, 1)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err
        return text
    blocks = _int_list(text)
    if not blocks or any(b < 1 for b in blocks):
        raise argparse.ArgumentTypeError(f"expected positive block sizes, e.g. 16,32,64, or auto; got {text!r}")
    return blocks


def _task_path(text: str) -> tuple[str, str]:
    task, sep, path = text.partition("=")
    if not sep or not task or not path:
        raise argparse.ArgumentTypeError(f"expected TASK=PATH, e.g. gsm8k=gsm8k_test.jsonl, got {text!r}")
    return task, path


def _names(values: list[str]) -> list[str]:
    """``--task arith code`` and ``--task arith,code`` alike."""
    return [n for v in values for n in v.split(",") if n]


def cmd_bench(args: argparse.Namespace) -> int:
    """``hf-blockbatch bench``: the options as :mod:`hf_blockbatch.eval.runner` settings, then the run."""
    from hf_blockbatch.eval.runner import (
        BASE_METHODS,
        TINY_TASKS,
        BenchSettings,
        default_barrier,
        parse_overrides,
        run_bench,
        shard_info,
    )

    # several processes: accelerate sets its own thread count when it joins them (OMP_NUM_THREADS unset), so
    # they are joined first and --threads applied after
    shard = shard_info()
    barrier = default_barrier(shard)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = BenchSettings(
        model=args.model, tasks=_names(args.task or list(TINY_TASKS)), methods=_names(args.methods or list(BASE_METHODS)),
        overrides=parse_overrides(args.set, args.configs), sweep_blocks=args.sweep_blocks or [],
        at_tuned_block=_names(args.at_tuned_block or []),
        limit=args.limit, batch_size=args.batch_size, seed=args.seed, gen_length=args.gen_length,
        output_dir=args.output_dir, device=args.device, dtype=args.dtype, device_map=args.device_map,
        chat=False if args.no_chat else None, data_paths=dict(args.data),
        progress=not args.no_progress, plots=not args.no_plots, latency_batch_1=args.latency_batch_1,
    )  # fmt: skip
    summary = run_bench(settings, shard=shard, barrier=barrier)
    if summary is not None:  # process 0
        print((Path(settings.output_dir) / "summary.md").read_text(encoding="utf-8"))
        print(f"written to {settings.output_dir}/: samples.jsonl summary.md summary.json run.json"
              + ("" if args.no_plots else " accuracy_vs_nfe.png accuracy_vs_query_tokens.png nfe_distribution.png"))  # fmt: skip
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Serve ``demo/app.py`` (the Gradio Space) locally. The app lives beside the package, not in
    it (a Space deploys that folder), so it is loaded by file path from the checkout."""
    import importlib.util

    app_path = Path(args.app) if args.app else Path(__file__).resolve().parents[1] / "demo" / "app.py"
    if not app_path.is_file():
        raise FileNotFoundError(
            f"No demo app at {app_path}: the demo ships with the repository (demo/app.py), not with the wheel. "
            "Run this from an editable install of a checkout (pip install -e '.[demo]') or pass --app PATH."
        )
    spec = importlib.util.spec_from_file_location("hf_blockbatch_demo_app", app_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    argv = ["--model", args.model, "--concurrency", str(args.concurrency)]
    for flag, value in (("--device", args.device), ("--host", args.host), ("--port", args.port),
                        ("--max-new-tokens", args.max_new_tokens), ("--threads", args.threads)):  # fmt: skip
        if value is not None:
            argv += [flag, str(value)]
    if args.share:
        argv.append("--share")
    return module.main(argv)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's options; ``lm-eval`` only by name, since :func:`main` hands its arguments to the harness."""
    # the module docstring is reST; --help prints plain text
    parser = argparse.ArgumentParser(prog="hf-blockbatch", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt with Fast-dLLM and BlockBatch side by side "
                         "(and the early-stop baseline, and its drafts)")
    gen.add_argument("--model", default="tiny-llada", help="tiny-llada, tiny-dream, a Hub id or a local folder")
    gen.add_argument("--prompt", type=_prompt, default=DEFAULT_PROMPT,
                     help="the question (default: an arith test item; the tiny models answer the suites' kinds: "
                     "arith word problems, small Python functions, list questions)")  # fmt: skip
    gen.add_argument("--max-new-tokens", type=positive_int, default=96)
    gen.add_argument("--threshold", type=finite_float, default=0.9, help="confidence to commit a token, in (0, 1]")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template (base models)")
    gen.set_defaults(func=cmd_generate)

    from hf_blockbatch.eval.runner import ALL_TASKS, BASE_METHODS, DEFAULT_OUTPUT_DIR, METHODS

    bench = sub.add_parser(
        "bench",
        help="all methods on task suites / benchmarks: per-sample JSONL, a Markdown table, plots",
        description="Run vanilla, Fast-dLLM (dual, block 32, τ 0.9; with and without early stop) and "
        "BlockBatch on tasks. Several processes: torchrun --nproc_per_node N -m hf_blockbatch.cli bench ..., or on "
        "GPUs accelerate launch --num_processes N -m hf_blockbatch.cli bench ... (on a machine without a GPU accelerate "
        "starts one process).",
    )
    bench.add_argument("--model", default="tiny-llada", help="tiny-llada, tiny-dream, a Hub id or a local folder")
    bench.add_argument("--task", nargs="+", action="extend", default=None, metavar="TASK",
                       help=f"one or more of {', '.join(ALL_TASKS)} (default: the tiny suites)")  # fmt: skip
    bench.add_argument("--methods", nargs="+", action="extend", default=None, metavar="METHOD",
                       help=f"any of {', '.join(METHODS)} (default: {' '.join(BASE_METHODS)}), or a method defined in "
                            "--configs")  # fmt: skip
    bench.add_argument("--set", action="append", default=[], metavar="METHOD.FIELD=VALUE",
                       help="override a config field, e.g. blockbatch.block_sizes=4,8,16 or fast_dllm.block_length=64 "
                       "(fast_dllm overrides also apply to fast_dllm_early_stop and the sweep)")  # fmt: skip
    bench.add_argument("--configs", default=None, metavar="JSON",
                       help='a JSON file {"method": {"field": value}}; a new name with "strategy" adds a method')  # fmt: skip
    bench.add_argument("--limit", type=positive_int, default=None, help="first N items of each task")
    bench.add_argument("--batch-size", type=positive_int, default=1, help="requests per generate call (left padding)")
    bench.add_argument("--seed", type=int, default=0,
                       help="seed of the sampling noise (temperature > 0): keyed, so an item samples the same answer at any "
                            "batch size")  # fmt: skip
    bench.add_argument("--gen-length", type=positive_int, default=None, help="new tokens (default: the task's own)")
    bench.add_argument("--sweep-blocks", type=_sweep_blocks, default=None, metavar="B1,B2,...|auto[:S]",
                       help="also run Fast-dLLM with early stop at these block sizes (the fixed-block frontier the tuned "
                            "baseline is picked from), e.g. 16,32,64; auto: every multiple of 16 (auto:S: of S) up to "
                            "each task's generation length, and the generation length")  # fmt: skip
    bench.add_argument("--at-tuned-block", nargs="+", action="extend", default=None, metavar="METHOD",
                       help="decode these methods (of --methods, e.g. fast_dllm_drafted_contained) last, at each task's "
                            "tuned Fast-dLLM block: the most accurate of the sweep and fast_dllm_early_stop, over every process's items")  # fmt: skip
    bench.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                       help=f"folder for the results (default: {DEFAULT_OUTPUT_DIR}, under the working folder)")  # fmt: skip
    bench.add_argument("--device", default=None, help="cpu or cuda[:i] (default: this process's GPU when present)")
    bench.add_argument("--device-map", default=None,
                       help="accelerate device map, e.g. auto: one model over all visible GPUs (larger than one GPU)")  # fmt: skip
    bench.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    bench.add_argument("--no-chat", action="store_true", help="do not apply the chat template (base models)")
    bench.add_argument("--data", action="append", type=_task_path, default=[], metavar="TASK=PATH",
                       help="a local data file for a benchmark, e.g. gsm8k=gsm8k_test.jsonl")  # fmt: skip
    bench.add_argument("--threads", type=nonnegative_int, default=0, help="torch CPU threads (0, the default: torch's choice)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    bench.add_argument("--latency-batch-1", type=positive_int, default=0, metavar="N",
                       help="with --batch-size > 1, also time the first N items of each task and method alone, "
                       "for the batch-1 latency column")  # fmt: skip
    bench.set_defaults(func=cmd_bench)

    demo = sub.add_parser("demo", help="the Gradio app: Fast-dLLM and BlockBatch side by side, live in the browser")
    demo.add_argument("--model", default="tiny-llada", help="tiny-llada, tiny-dream, a Hub id or a local folder")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    demo.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1)")
    demo.add_argument("--port", type=port_number, default=None, help="port (default 7860 or the next free one)")
    demo.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    demo.add_argument("--concurrency", type=positive_int, default=1, help="decodes at once (the model is shared)")
    demo.add_argument("--max-new-tokens", type=demo_max_new_tokens, default=None,
                      help=f"upper limit of the slider (256; 512 on GPU; at least {DEMO_MIN_NEW_TOKENS}, where it starts)")
    demo.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    demo.add_argument("--app", default=None, help="path of the app (default: demo/app.py of this checkout)")
    demo.set_defaults(func=cmd_demo)

    sub.add_parser(
        "lm-eval", add_help=False,
        help="lm-evaluation-harness's own command line with --model hf_blockbatch registered (pip install 'hf-blockbatch[lmeval]')",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``hf-blockbatch`` console script (``argv``: the arguments, ``sys.argv[1:]`` when None); returns the
    exit status, 2 for bad input, which is printed as one ``error:`` line, as is an ``OSError`` (status 1)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # every further argument is the harness's, --help included
        from hf_blockbatch.eval.lm_eval_model import main as lm_eval_main

        lm_eval_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    tolerant_stdout()
    try:
        return args.func(args)
    except STOPPED as err:  # Ctrl-C, or | head
        return stopped_status(err)
    except (ValueError, FileNotFoundError, NotADirectoryError) as err:
        # bad input: one line that says what to change (-v keeps the traceback in the log)
        logging.getLogger(__name__).info("bad input", exc_info=True)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        # what the machine refused: a full disk or a file-size limit writing the results (the folder keeps the files
        # it held: runner._replace_files), stdout on a full disk. One line too; -v keeps the traceback in the log
        return refused_status(err)


if __name__ == "__main__":
    sys.exit(main())
