"""``hf-blockbatch``: the command line.

``hf-blockbatch generate`` answers one prompt with Fast-dLLM (dual cache, block 32, τ 0.9, the
paper's baseline) and BlockBatch (default settings) side by side, with NFE and wall time, on the
embedded tiny LLaDA by default or on any supported checkpoint (``--model``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

__all__ = ["main"]

DEFAULT_PROMPT = "Mia has 3 apples. She buys 4 more apples. Then she gives away 2 apples. How many apples does she have now?"


def _encode(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    else:
        text = prompt
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def cmd_generate(args: argparse.Namespace) -> int:
    from hf_blockbatch import BlockBatchConfig, FastDLLMConfig
    from hf_blockbatch.hub import load_model

    model, tokenizer = load_model(args.model, device=args.device)
    ids = _encode(tokenizer, args.prompt, chat=not args.no_chat).to(model.device)
    configs = {
        "Fast-dLLM (dual, block 32, τ 0.9)": FastDLLMConfig(
            max_new_tokens=args.max_new_tokens, block_length=32, threshold=args.threshold, cache="dual"
        ),
        "BlockBatch (blocks 4…128)": BlockBatchConfig(max_new_tokens=args.max_new_tokens, threshold=args.threshold),
    }
    print(f"model: {args.model}  device: {model.device}  prompt: {args.prompt!r}\n")
    rows = []
    for name, cfg in configs.items():
        start = time.perf_counter()
        out = model.generate(ids, generation_config=cfg, return_dict_in_generate=True)
        seconds = time.perf_counter() - start
        text = tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True).strip()
        nfe = int(out.nfe[0])
        rows.append((name, nfe, seconds))
        print(f"── {name}\n{text}\n   NFE {nfe}   {seconds:.2f} s   winner block {out.stats[0]['winner_block_size']}\n")
    (_, nfe_f, t_f), (_, nfe_b, t_b) = rows
    print(f"BlockBatch / Fast-dLLM: NFE {nfe_b}/{nfe_f} = {nfe_b / nfe_f:.2f}, time {t_b / t_f:.2f}x")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-blockbatch", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt with Fast-dLLM and BlockBatch side by side")
    gen.add_argument("--model", default="tiny-llada", help="tiny-llada, tiny-dream, a Hub id or a local folder")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--max-new-tokens", type=int, default=96)
    gen.add_argument("--threshold", type=float, default=0.9)
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template (base models)")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
