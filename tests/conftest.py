"""Shared fixtures: tiny random LLaDA and Dream models with fixed seeds.

The special-token ids are small stand-ins placed where the tiny checkpoints put them, so the
same tests read naturally against both random and trained models.
"""

from __future__ import annotations

import sys

import pytest
import torch

import hf_blockbatch as hb

# Tiny matmuls: one thread is faster than two, and CI shares its two cores with the test processes.
torch.set_num_threads(1)

VOCAB = 96
MASK_ID, EOS_ID, BOS_ID, EOT_ID = 95, 94, 93, 92


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module: the benchmarks are scripts, not a package. Their folder
    goes on the import path, as it is when a script runs, so that one script can import another's parts."""
    import importlib.util
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def make_tiny_llada(seed: int = 0, **overrides) -> hb.LLaDAModelLM:
    """A 2-layer LLaDA (MHA, d=64) in float32, eval mode."""
    kwargs = dict(
        d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=VOCAB,
        embedding_size=VOCAB, max_sequence_length=256, mask_token_id=MASK_ID, eos_token_id=EOS_ID,
        pad_token_id=EOS_ID, rope_theta=10000.0,
    )  # fmt: skip
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return hb.LLaDAModelLM(hb.LLaDAConfig(**kwargs)).eval()


def make_tiny_dream(seed: int = 0, **overrides) -> hb.DreamModel:
    """A 2-layer Dream (GQA 4 query heads over 2 KV heads, biases, d=64) in float32, eval mode."""
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, mask_token_id=MASK_ID, pad_token_id=EOS_ID,
        eos_token_id=EOS_ID, bos_token_id=BOS_ID, rope_theta=10000.0,
    )  # fmt: skip
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = hb.DreamModel(hb.DreamConfig(**kwargs)).eval()
    # random q/k/v biases (zero-initialised otherwise) so the tests exercise them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.fixture(params=["llada", "dream"])
def tiny_model(request):
    return make_tiny_llada() if request.param == "llada" else make_tiny_dream()


@pytest.fixture
def tiny_llada():
    return make_tiny_llada()


@pytest.fixture
def tiny_dream():
    return make_tiny_dream()
