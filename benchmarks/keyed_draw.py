"""What a keyed sampled draw costs, over the whole vocabulary and pruned to the ids that can win (RESULTS §42, §43).

Why: with a seed, each token id's Gumbel noise is a hash of its key (``generation/noise.py``), so a draw need not
hash and score every id: the noise lifts a logit by at least -3.1 T and at most 22.9 T, and an id more than 26.0 T
below its row's top logit can neither win nor tie (``sampling.gumbel_tokens``); where that bound keeps most ids,
every id is hashed and a screen on the hashes keeps the few whose noise can still win (``sampling.noise_screen``).
This replays the draws of real sampled decodes: it decodes training items (never a test question) with sparse
Fast-dLLM and a seed, records every draw's logits and keys, then times each draw both ways (the full draw,
``max_share=0``, and the default) and checks that they pick the same tokens. The last rows time synthetic draws at
LLaDA's vocabulary (a peaked head over a normal bulk: no weights of that size here) and flat rows, an untrained
model's, at 8,192 and 126,464 ids.

    PYTHONPATH=$PWD python benchmarks/keyed_draw.py --items 16 --repeats 10

Writes ``benchmarks/results/keyed_draw.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

import hf_blockbatch as hb
from hf_blockbatch.eval.script_args import nonnegative_int, out_file, positive_float, positive_int, run_main
from hf_blockbatch.generation import noise, sampling
from hf_blockbatch.tasks import SUITES, get_suite

logger = logging.getLogger("keyed_draw")


def capture(model, tokenizer, suite_name: str, items: int, temperature: float, batch_size: int) -> list[tuple]:
    """Every keyed draw of a seeded sparse Fast-dLLM decode of ``items`` training items: ``(logits, keys, mask_id)``."""
    suite = get_suite(suite_name)
    texts = [suite.prompt(item, tokenizer) for item in suite.train_items(items)]
    cfg = hb.FastDLLMConfig(max_new_tokens=suite.default_gen_length, block_length=32, temperature=temperature, seed=0,
                            window_queries="sparse")  # fmt: skip
    draws, draw = [], sampling.gumbel_tokens

    def recorded(logits, temperature, generator, noise_keys, mask_id, max_share=None):
        draws.append((logits.clone(), noise_keys.clone(), mask_id))
        return draw(logits, temperature, generator, noise_keys, mask_id, max_share)

    sampling.gumbel_tokens = recorded
    try:
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            model.generate(enc.input_ids, attention_mask=enc.attention_mask, generation_config=cfg)
    finally:
        sampling.gumbel_tokens = draw
    return draws


def _decided(draws: list[tuple], temperature: float) -> dict[str, int]:
    """How many of ``draws`` the default draw decided by the logit bound, by the noise screen, or over every id."""
    calls: dict[str, int] = {"screened": 0, "full": 0}
    screened, full = sampling._screened_draw, sampling._full_draw

    def screen(*args):
        tokens = screened(*args)
        calls["screened"] += tokens is not None
        return tokens

    def whole(*args):
        calls["full"] += 1
        return full(*args)

    sampling._screened_draw, sampling._full_draw = screen, whole
    try:
        for logits, keys, mask_id in draws:
            sampling.gumbel_tokens(logits, temperature, None, keys, mask_id)
    finally:
        sampling._screened_draw, sampling._full_draw = screened, full
    return {"by_bound": len(draws) - calls["screened"] - calls["full"], **calls}


def timed(draws: list[tuple], temperature: float, repeats: int) -> dict:
    """Milliseconds of all ``draws`` (the median of ``repeats`` passes), full and by default, the share of ids the
    logit bound keeps and the share the noise screen keeps, how many draws each way decided, and whether the full
    and the default draw picked the same tokens."""
    passes = {"full": [], "default": []}
    same, kept, screened, numel = True, 0, 0, 0
    for logits, keys, mask_id in draws:
        a = sampling.gumbel_tokens(logits, temperature, None, keys, mask_id, max_share=0.0)
        b = sampling.gumbel_tokens(logits, temperature, None, keys, mask_id)
        same &= torch.equal(a, b)
        kept += int((logits >= sampling.keyed_floor(logits, temperature)[:, None]).count_nonzero())
        screen = sampling.noise_screen(logits, temperature, noise.uniform_codes(keys, logits.shape[1]), mask_id)
        screened += logits.numel() if screen is None else int(screen.count_nonzero())
        numel += logits.numel()
    for _ in range(repeats):
        for name, share in (("full", 0.0), ("default", None)):
            t0 = time.perf_counter()
            for logits, keys, mask_id in draws:
                sampling.gumbel_tokens(logits, temperature, None, keys, mask_id, max_share=share)
            passes[name].append(1e3 * (time.perf_counter() - t0))
    full, default = statistics.median(passes["full"]), statistics.median(passes["default"])
    return {"draws": len(draws), "rows": sum(d[0].shape[0] for d in draws), "kept_share": kept / numel,
            "screened_share": screened / numel, "decided": _decided(draws, temperature), "full_ms": full,
            "default_ms": default, "speedup": full / default, "same_tokens": same}  # fmt: skip


def synthetic(rows: int, vocab: int, seed: int = 0) -> list[tuple]:
    """Draws at a real vocabulary: a head of five ids 12-22 nats above a normal bulk (sd 3), as a trained model's
    confident positions look; random keys."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3.0
    logits[:, :5] += torch.tensor([22.0, 20.0, 18.0, 15.0, 12.0])
    return [(logits, torch.randint(0, 2**32, (rows,), generator=g), None)]


def flat(rows: int, vocab: int, seed: int = 0) -> list[tuple]:
    """Draws of an untrained model: normal logits of sd 0.45, as the random d 512 model of ``policy_overhead.py
    --random`` gives (the realistic width's rows, where no logit bound prunes); random keys."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, vocab, generator=g) * 0.45, torch.randint(0, 2**32, (rows,), generator=g), None)]


def replay_parser(description: str, repeats: int, out: str) -> argparse.ArgumentParser:
    """The arguments of a replay of keyed draws (this script's, and ``noise_designs.py``'s): which decodes' draws,
    which synthetic rows, how many timed passes, where the results go."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--models", nargs="+", default=["tiny-llada", "tiny-dream"])
    p.add_argument("--suites", nargs="+", choices=SUITES, default=["arith", "code", "lists"], metavar="SUITE")
    p.add_argument("--items", type=positive_int, default=16, help="training items per suite")
    p.add_argument("--batch-size", type=positive_int, default=16)
    # a keyed draw samples: at temperature 0 the decodes are greedy and draw nothing to time
    p.add_argument("--temperatures", nargs="+", type=positive_float, default=[0.5, 1.0])
    p.add_argument("--repeats", type=positive_int, default=repeats)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--synthetic-vocab", type=nonnegative_int, default=126464, help="0: no synthetic row")
    p.add_argument("--synthetic-rows", type=positive_int, default=32)
    p.add_argument("--flat-vocabs", nargs="*", type=positive_int, default=[8192, 126464],
                   help="also flat rows (an untrained model's) at these vocabularies, --synthetic-rows each")
    p.add_argument("--out", type=out_file, default=str(Path(__file__).parent / "results" / out),
                   help="the results' stem: <out>.json and <out>.md")
    return p


def parse_replay(p: argparse.ArgumentParser, argv: list[str] | None = None, vocab_multiple: int = 1) -> argparse.Namespace:
    """:func:`replay_parser`'s arguments, with what one option cannot say alone refused as argparse's error: a
    synthetic vocabulary holds the five ids of its head (:func:`synthetic`), and a design that splits the ids into
    blocks of ``vocab_multiple`` needs vocabularies that are multiples of it."""
    args = p.parse_args(argv)
    if 0 < args.synthetic_vocab < 5:
        p.error(f"--synthetic-vocab must be 0 (no synthetic rows) or at least 5, its head's ids; got {args.synthetic_vocab}")
    uneven = [v for v in [args.synthetic_vocab, *args.flat_vocabs] if v % vocab_multiple]
    if uneven:
        p.error(f"vocabularies {uneven} are not multiples of {vocab_multiple} ids: this design draws blocks of that many")
    return args


def replay(args: argparse.Namespace, timed_draws) -> list[dict]:
    """One row per cell: ``timed_draws(draws, temperature, repeats)`` on the draws of each model, suite and
    temperature (:func:`capture`), then on the synthetic and the flat rows the arguments ask for."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    rows, loaded = [], {}
    cells = [(m, s, t) for m in args.models for s in args.suites for t in args.temperatures]
    for model_name, suite_name, temperature in tqdm(cells, desc="cells"):
        if model_name not in loaded:
            loaded[model_name] = hb.load_model(model_name, device="cpu")
        draws = capture(*loaded[model_name], suite_name, args.items, temperature, args.batch_size)
        rows.append({"model": model_name, "suite": suite_name, "temperature": temperature,
                     **timed_draws(draws, temperature, args.repeats)})  # fmt: skip
    n = args.synthetic_rows
    extra = [(f"synthetic V {args.synthetic_vocab}", synthetic(n, args.synthetic_vocab))] if args.synthetic_vocab else []
    extra += [(f"flat V {vocab}", flat(n, vocab)) for vocab in args.flat_vocabs]
    for name, draws in extra:
        for temperature in args.temperatures:
            rows.append({"model": name, "suite": f"{n} rows", "temperature": temperature,
                         **timed_draws(draws, temperature, args.repeats)})  # fmt: skip
    return rows


def write(args: argparse.Namespace, rows: list[dict], head: list[str], line) -> None:
    """``<out>.json`` (the settings and the rows) and ``<out>.md`` (``head``, then ``line(row)`` per row), logged."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("items", "batch_size", "repeats", "threads")}
    out.with_suffix(".json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    lines = head + [line(r) for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    logger.info("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    args = parse_replay(replay_parser(__doc__.split("\n\n")[0], repeats=10, out="keyed_draw"), argv)
    rows = replay(args, timed)
    head = ["# Keyed sampled draws: the whole vocabulary against the pruned draw", "",
            f"`benchmarks/keyed_draw.py`; the draws of seeded sparse Fast-dLLM decodes of {args.items} training items per "
            f"suite (block 32, batch {args.batch_size}), each timed over all of them, the median of {args.repeats} passes; "
            f"{args.threads} thread(s). *Kept*: the share of (row, id) pairs within the noise's spread of their row's top "
            "logit, which the default draw scores when it is at most `PRUNED_DRAW_MAX_SHARE`; else every id is hashed "
            "and the noise screen keeps *screened* (`sampling.noise_screen`); *decided*: how many draws the logit "
            "bound, the screen and the full draw decided.", "",
            "| model | suite | T | draws | rows | kept | screened | decided (bound · screen · full) | full ms | "
            "default ms | × faster | same tokens |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]  # fmt: skip

    def line(r: dict) -> str:
        d = r["decided"]
        return (f"| {r['model']} | {r['suite']} | {r['temperature']:g} | {r['draws']} | {r['rows']} | "
                f"{100 * r['kept_share']:.1f} % | {100 * r['screened_share']:.1f} % | "
                f"{d['by_bound']} · {d['screened']} · {d['full']} | {r['full_ms']:.1f} | {r['default_ms']:.1f} | "
                f"{r['speedup']:.2f} | {'yes' if r['same_tokens'] else '**no**'} |")  # fmt: skip

    write(args, rows, head, line)
    if not all(r["same_tokens"] for r in rows):
        raise SystemExit("a pruned draw picked other tokens than the full draw: see the table")


if __name__ == "__main__":
    raise SystemExit(run_main(main))
