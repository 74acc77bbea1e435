"""The embedded tiny checkpoints, and loading any supported checkpoint with its tokenizer.

``TINY_LLADA`` and ``TINY_DREAM`` are folders installed with the package (official LLaDA / Dream
formats, trained by ``hf_blockbatch.training``); real checkpoints load through the same
``from_pretrained`` path from the Hub or a local folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

logger = logging.getLogger(__name__)

__all__ = ["TINY_LLADA", "TINY_DREAM", "load_model", "resolve_model_path"]

_ASSETS = Path(__file__).resolve().parent / "assets"
TINY_LLADA = str(_ASSETS / "tiny-llada")
TINY_DREAM = str(_ASSETS / "tiny-dream")
_ALIASES = {"tiny-llada": TINY_LLADA, "tiny-dream": TINY_DREAM}


def resolve_model_path(name_or_path: str) -> str:
    """``tiny-llada``/``tiny-dream`` name the embedded checkpoints; anything else passes through."""
    path = _ALIASES.get(name_or_path, name_or_path)
    if path in _ALIASES.values() and not (Path(path) / "config.json").exists():
        raise FileNotFoundError(
            f"The embedded checkpoint {name_or_path!r} has no weights in {path}: this installation was built "
            "without them. Train it with `python -m hf_blockbatch.training.sft`, or pass --model with a "
            "LLaDA/Dream checkpoint."
        )
    return path


def load_model(
    name_or_path: str = "tiny-llada",
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    **kwargs,
):
    """Load a supported model and its tokenizer (``trust_remote_code`` is never needed: our own
    classes are registered for ``llada`` and ``Dream``). Defaults: the GPU when present, bf16 on
    GPU, float32 on CPU.

    ``device_map`` (e.g. ``"auto"``) is passed to ``from_pretrained`` so that accelerate spreads a
    model larger than one GPU over the visible GPUs; the model is then left where accelerate put
    it (``device`` is ignored), since moving a dispatched model would undo the placement.
    """
    import hf_blockbatch  # noqa: F401  (registers the Auto classes)

    path = resolve_model_path(name_or_path)
    if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but this PyTorch sees no CUDA GPU: use device='cpu'.")
    try:
        return _load(path, device, dtype, **kwargs)
    except OSError as err:
        if Path(path).exists():
            raise
        reason = (str(err).splitlines() or [""])[0]
        raise FileNotFoundError(
            f"Cannot load {name_or_path!r}: it is not an embedded model (tiny-llada, tiny-dream) nor a local folder, "
            f"and the Hub did not serve it ({type(err).__name__}: {reason})."
        ) from err


def _load(path: str, device, dtype, **kwargs):
    if kwargs.get("device_map") is not None:
        if dtype is None:
            dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        model = AutoModel.from_pretrained(path, dtype=dtype, **kwargs).eval()
        device = getattr(model, "device", None)
    else:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModel.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    logger.info("loaded %s (%s) on %s/%s", path, type(model).__name__, device, dtype)
    return model, tokenizer
