"""Our logits equal the official modeling code's on the same weights.

The official code is not in this repository: point ``HF_BLOCKBATCH_OFFICIAL_LLADA_DIR`` /
``HF_BLOCKBATCH_OFFICIAL_DREAM_DIR`` at folders holding it (e.g. Hub snapshots of
GSAI-ML/LLaDA-8B-Instruct and Dream-org/Dream-v0-Instruct-7B); without them these tests skip.
The harness (loading, runtime shims for transformers 5, tiny configs) is
``benchmarks/official_parity.py``; run that script for a printed report.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "official_parity.py"
_spec = importlib.util.spec_from_file_location("_hf_blockbatch_official_parity", _PATH)
parity = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = parity  # dataclasses look their module up by name
_spec.loader.exec_module(parity)

DIRS = {"llada": os.environ.get(parity.ENV_LLADA), "dream": os.environ.get(parity.ENV_DREAM)}
FP32_ATOL = 1e-5
BF16_ATOL = 5e-2  # logits of order 5; bf16 keeps ~3 significant digits


def folder(kind: str) -> str:
    directory = DIRS[kind]
    if not directory:
        env = parity.ENV_LLADA if kind == "llada" else parity.ENV_DREAM
        pytest.skip(f"set {env} to a folder holding the official {kind} modeling code")
    return directory


CASES = [(kind, variant) for kind, variants in parity.VARIANTS.items() for variant in variants]


@pytest.mark.parametrize(("kind", "variant"), CASES, ids=[f"{k}-{v}" for k, v in CASES])
def test_float32_logits_match_official(kind: str, variant: str) -> None:
    r = parity.compare(kind, folder(kind), torch.float32, variant)
    print(f"{kind}/{variant} float32: max abs diff {r.max_abs_diff:.3e} (max |logit| {r.max_abs_logit:.2f})")
    assert r.max_abs_diff <= FP32_ATOL, r
    assert r.argmax_agreement == 1.0, r


@pytest.mark.parametrize(("kind", "variant"), CASES, ids=[f"{k}-{v}" for k, v in CASES])
def test_bfloat16_logits_match_official(kind: str, variant: str) -> None:
    r = parity.compare(kind, folder(kind), torch.bfloat16, variant)
    print(f"{kind}/{variant} bfloat16: max abs diff {r.max_abs_diff:.3e} (max |logit| {r.max_abs_logit:.2f})")
    assert r.max_abs_diff <= BF16_ATOL, r
    assert r.argmax_agreement >= 0.99, r


@pytest.mark.parametrize("kind", ["llada", "dream"])
@torch.no_grad()
def test_window_forward_matches_official(kind: str) -> None:
    """The decoders' path (full forward into a cache, then window forwards) against the official
    full forward: windows predict [s, e), which for Dream are official logits [s - 1, e - 1)."""
    official, ours = parity.build_pair(kind, folder(kind))
    ids = torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(5))
    ref = official(input_ids=ids, use_cache=False, return_dict=True).logits
    cache = ours(ids, use_cache=True).cache
    starts, ends = [8, 20, 1], [16, 21, 32]
    out = ours.forward_windows(ids, starts, ends, cache)
    cu, s = out.cu_seqlens.tolist(), ours.logit_shift
    for r in range(3):
        got = out.logits[cu[r] : cu[r + 1]]
        torch.testing.assert_close(got, ref[r, starts[r] - s : ends[r] - s], atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llada", "dream"])
@torch.no_grad()
def test_comparison_is_sensitive(kind: str) -> None:
    """Guard against a vacuous comparison: a wrong RoPE base must show up far above tolerance."""
    official, ours = parity.build_pair(kind, folder(kind))
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(6))
    ref = official(input_ids=ids, use_cache=False, return_dict=True).logits
    ours.config.rope_theta = ours.config.rope_theta / 50
    assert (ours(ids).logits - ref).abs().max() > 100 * FP32_ATOL


#: every dropout each official config has, on together
DROPOUTS = {"llada": dict(embedding_dropout=0.1, attention_dropout=0.3, residual_dropout=0.2), "dream": dict(attention_dropout=0.3)}


@pytest.mark.parametrize("kind", ["llada", "dream"])
@torch.no_grad()
def test_training_mode_dropout_matches_official(kind: str) -> None:
    """In training mode, under one seed, the official model and ours drop the same units (the same dropouts, at the
    same places, drawn in the same order), so their logits agree; in eval mode neither drops anything."""
    official, ours = parity.build_pair(kind, folder(kind), overrides=DROPOUTS[kind])
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(7))
    inference = official(input_ids=ids, use_cache=False, return_dict=True).logits
    torch.testing.assert_close(ours(ids).logits, inference, atol=FP32_ATOL, rtol=0)
    official.train()
    ours.train()
    torch.manual_seed(8)
    ref = official(input_ids=ids, use_cache=False, return_dict=True).logits
    torch.manual_seed(8)
    torch.testing.assert_close(ours(ids).logits, ref, atol=FP32_ATOL, rtol=0)
    assert (ref - inference).abs().max() > 100 * FP32_ATOL  # the dropouts acted
