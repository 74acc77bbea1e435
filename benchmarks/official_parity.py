"""Logit parity between hf-blockbatch's models and the official LLaDA / Dream modeling code.

The official modeling code is never part of this repository (read it, never copy it). This
script imports it at run time **from a folder the user points to**, e.g. the Hub snapshot of
``GSAI-ML/LLaDA-8B-Instruct`` or ``Dream-org/Dream-v0-Instruct-7B`` (any folder holding
``modeling_llada.py`` + ``configuration_llada.py``, or ``modeling_dream.py`` +
``configuration_dream.py`` + ``generation_utils.py``), builds a *tiny random* official model,
copies its state dict into ours with ``load_state_dict(strict=True)`` (the parameter names are
the official ones, so nothing is renamed), and compares ``model(input_ids).logits``.

Usage::

    HF_BLOCKBATCH_OFFICIAL_LLADA_DIR=/path/to/llada-snapshot \\
    HF_BLOCKBATCH_OFFICIAL_DREAM_DIR=/path/to/dream-snapshot \\
    python benchmarks/official_parity.py            # or --llada-dir / --dream-dir

``tests/test_official_parity.py`` runs the same comparison under pytest (skipped when the
environment variables are unset).

The official files are loaded as a synthetic package (they use relative imports) without
writing anything into the user's folder, and a few *runtime* shims make them run on
transformers 5, none of which changes the math:

* transformers 5 dropped ``ROPE_INIT_FUNCTIONS['default']``, which the Dream code looks up; a
  function computing the standard ``1 / theta ** (2i / d)`` frequencies is registered for the
  duration of the import and construction.
* the official LLaDA files register their classes with ``AutoConfig`` / ``AutoModel`` on import,
  which would clash with (or override) ours; those calls are no-ops while they import.
* LLaDA's ``scaled_dot_product_attention`` wrapper is ``@torch.compile``d; it is swapped for the
  plain PyTorch function it wraps (compiling needs a C++ toolchain on CPU, and takes minutes).
* LLaDA's module imports ``einops.rearrange`` without using it in the forward; a stub stands in
  when einops is not installed.
* LLaDA's model constructor switches off PyTorch's memory-efficient SDPA globally; the flag is
  restored afterwards.

What is compared: the plain forward (no cache, no attention mask): the official LLaDA code
ignores the attention mask altogether (it calls SDPA with ``attn_mask=None``), so padded
batches are not a parity question (our models mask padding on purpose: ``docs/algorithm.md``,
"Vocabulary", and ``hf_blockbatch/models/base.py``).
In bf16 the official Dream code keeps its RoPE ``inv_freq`` in float32, as ``from_pretrained``
loading does (``model.to(bf16)`` alone would round it); the harness calls the official
``reset_rope_parameters()`` after the cast to reproduce that.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import hf_blockbatch as hb
from hf_blockbatch.eval.script_args import out_file, positive_int, run_main, torch_device

__all__ = [
    "ENV_DREAM",
    "ENV_LLADA",
    "VARIANTS",
    "ParityResult",
    "build_pair",
    "compare",
    "load_official",
    "official_shims",
]

ENV_LLADA = "HF_BLOCKBATCH_OFFICIAL_LLADA_DIR"
ENV_DREAM = "HF_BLOCKBATCH_OFFICIAL_DREAM_DIR"

_FILES = {
    "llada": ("configuration_llada", "modeling_llada"),
    "dream": ("configuration_dream", "modeling_dream"),
}

# Tiny geometries, in the official config field names. LLaDA: MHA like the released model, with
# every forward option the checkpoints use; Dream: GQA (4 query heads over 2 KV heads).
TINY_LLADA = dict(
    d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=96, mlp_ratio=4, vocab_size=128,
    embedding_size=128, max_sequence_length=128, rope_theta=500000.0, rms_norm_eps=1e-5,
    block_type="llama", activation_type="silu", layer_norm_type="rms", rope=True, alibi=False,
    rope_full_precision=True, include_bias=False, include_qkv_bias=False, bias_for_layer_norm=False,
    weight_tying=False, input_emb_norm=False, scale_logits=False, attention_layer_norm=False,
    block_group_size=1, flash_attention=False, mask_token_id=126, eos_token_id=125, pad_token_id=125,
)  # fmt: skip
TINY_DREAM = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, mask_token_id=126, pad_token_id=125, bos_token_id=124, eos_token_id=125,
)  # fmt: skip


# ------------------------------------------------------------------------------------ shims
def _default_rope_init(config=None, device=None, seq_len=None, **rope_kwargs) -> tuple[torch.Tensor, float]:
    """transformers 4's ``_compute_default_rope_parameters``: plain RoPE frequencies, scaling 1."""
    if config is not None:
        base = config.rope_theta
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    else:
        base, dim = rope_kwargs["base"], rope_kwargs["dim"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (base**exponents), 1.0


@contextlib.contextmanager
def official_shims() -> Iterator[None]:
    """Runtime shims under which the official files import and build on transformers 5.

    Every change is undone on exit (the official objects keep what they captured).
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    added_rope = "default" not in ROPE_INIT_FUNCTIONS
    if added_rope:
        ROPE_INIT_FUNCTIONS["default"] = _default_rope_init
    # the official files register their classes on import: make that a no-op, keep ours
    saved_register = {cls: cls.__dict__.get("register") for cls in (AutoConfig, AutoModel, AutoModelForCausalLM)}
    for cls in saved_register:
        cls.register = staticmethod(lambda *args, **kwargs: None)
    added_einops = False
    if importlib.util.find_spec("einops") is None:
        stub = types.ModuleType("einops")

        def rearrange(*args, **kwargs):
            raise RuntimeError("einops is not installed (stub from benchmarks/official_parity.py)")

        stub.rearrange = rearrange
        sys.modules["einops"] = stub
        added_einops = True
    mem_efficient = torch.backends.cuda.mem_efficient_sdp_enabled()
    flash = torch.backends.cuda.flash_sdp_enabled()
    dont_write = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # never write __pycache__ into the user's folder
    try:
        yield
    finally:
        sys.dont_write_bytecode = dont_write
        torch.backends.cuda.enable_mem_efficient_sdp(mem_efficient)
        torch.backends.cuda.enable_flash_sdp(flash)
        if added_einops:
            sys.modules.pop("einops", None)
        for cls, register in saved_register.items():
            if register is None:
                del cls.register  # inherited again
            else:
                cls.register = register
        if added_rope:
            ROPE_INIT_FUNCTIONS.pop("default", None)


def load_official(kind: str, directory: str | os.PathLike) -> tuple[types.ModuleType, types.ModuleType]:
    """Import the official ``(configuration, modeling)`` modules of ``kind`` from ``directory``.

    They are imported as submodules of a synthetic package whose ``__path__`` is the folder, so
    their relative imports resolve there; call this inside :func:`official_shims`.
    """
    if kind not in _FILES:
        raise ValueError(f"kind must be one of {sorted(_FILES)}, got {kind!r}.")
    folder = Path(directory).expanduser().resolve()
    missing = [f"{name}.py" for name in _FILES[kind] if not (folder / f"{name}.py").is_file()]
    if missing:
        raise FileNotFoundError(
            f"{folder} lacks {missing}: point to a folder holding the official {kind} remote code "
            "(e.g. a Hub snapshot of the model)."
        )
    package = f"_hf_blockbatch_official_{kind}_{hashlib.sha1(str(folder).encode()).hexdigest()[:10]}"
    if package not in sys.modules:
        spec = importlib.util.spec_from_loader(package, loader=None, is_package=True)
        module = importlib.util.module_from_spec(spec)
        module.__path__ = [str(folder)]
        sys.modules[package] = module
    config_mod = importlib.import_module(f"{package}.{_FILES[kind][0]}")
    modeling_mod = importlib.import_module(f"{package}.{_FILES[kind][1]}")
    if kind == "llada":
        sdpa = modeling_mod.scaled_dot_product_attention
        if not getattr(sdpa, "_hf_blockbatch_plain", False):

            def plain_sdpa(q, k, v, mask=None, attn_mask=None, dropout_p=0.0, is_causal=False):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
                )

            plain_sdpa._hf_blockbatch_plain = True
            modeling_mod.scaled_dot_product_attention = plain_sdpa
    return config_mod, modeling_mod


# ------------------------------------------------------------------------------------ models
@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale random weights, so the comparison is sensitive to every part of the forward.

    With the usual 0.02 init, attention scores are ~0 and attention is uniform, so RoPE (and any
    mistake in it) would hardly reach the logits. Here projections have std ``1/sqrt(fan_in)``
    (attention logits of order ``sqrt(head_dim)``), norm gains vary around 1, and biases are random.
    """
    g = torch.Generator().manual_seed(10_000 + seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
            new = torch.rand(p.shape, generator=g) + 0.5
        elif name.endswith("bias"):
            new = torch.randn(p.shape, generator=g) * 0.2
        elif p.dim() == 2 and ("wte" in name or "embed_tokens" in name):
            new = torch.randn(p.shape, generator=g)
        else:
            new = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
        p.copy_(new.to(p.dtype))


def build_pair(
    kind: str, directory: str | os.PathLike, seed: int = 0, overrides: dict | None = None
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny random official model and ours with the same weights (float32, eval mode).

    ``overrides`` changes official config fields (see :data:`VARIANTS`). The official state dict
    is loaded into ours with ``strict=True``: same names, same shapes, nothing renamed.
    """
    with official_shims():
        config_mod, modeling_mod = load_official(kind, directory)
        torch.manual_seed(seed)
        if kind == "llada":
            fields = {**TINY_LLADA, **(overrides or {})}
            official = modeling_mod.LLaDAModelLM(config_mod.LLaDAConfig(**fields), init_params=True)
            ours = hb.LLaDAModelLM(hb.LLaDAConfig(**fields))
        else:
            fields = {**TINY_DREAM, **(overrides or {})}
            official = modeling_mod.DreamModel(config_mod.DreamConfig(**fields))
            ours = hb.DreamModel(hb.DreamConfig(**fields))
    official = official.float().eval()
    randomize_(official, seed)
    state = {k: v for k, v in official.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    ours.load_state_dict(state, strict=True)
    ours = ours.float().eval()
    return official, ours


#: configurations compared per family: the released geometry's options, then the other options
#: our classes accept (LLaDA: GQA, biases, weight tying, embedding and logit scaling; Dream: MHA)
VARIANTS: dict[str, dict[str, dict]] = {
    "llada": {
        "default": {},
        "options": dict(
            n_kv_heads=2, include_bias=True, bias_for_layer_norm=False, weight_tying=True, input_emb_norm=True,
            scale_logits=True, rope_full_precision=True,
        ),
        "rope_low_precision": dict(rope_full_precision=False),
    },
    "dream": {"default": {}, "mha": dict(num_key_value_heads=4)},
}


@dataclass
class ParityResult:
    kind: str
    variant: str
    dtype: str
    max_abs_diff: float
    max_abs_logit: float
    argmax_agreement: float
    shape: tuple[int, ...]


def _to_dtype(official: torch.nn.Module, ours: torch.nn.Module, dtype: torch.dtype) -> None:
    official.to(dtype)
    ours.to(dtype)
    if hasattr(official, "reset_rope_parameters"):  # Dream: float32 inv_freq, as from_pretrained keeps it
        with official_shims():
            official.reset_rope_parameters()


@torch.no_grad()
def compare(
    kind: str,
    directory: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    variant: str = "default",
    seed: int = 0,
    batch: int = 2,
    length: int = 48,
    device: str | torch.device = "cpu",
) -> ParityResult:
    """Max abs difference between official and our logits on random tokens (no mask, no cache)."""
    official, ours = build_pair(kind, directory, seed, VARIANTS[kind][variant])
    official.to(device)
    ours.to(device)
    _to_dtype(official, ours, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    vocab = TINY_LLADA["vocab_size"] if kind == "llada" else TINY_DREAM["vocab_size"]
    input_ids = torch.randint(0, vocab, (batch, length), generator=g).to(device)
    # explicit use_cache / return_dict: transformers 5 configs no longer carry the old defaults
    ref = official(input_ids=input_ids, use_cache=False, return_dict=True).logits.float()
    got = ours(input_ids).logits.float()
    if ref.shape != got.shape:
        raise AssertionError(f"{kind}: official logits {tuple(ref.shape)} vs ours {tuple(got.shape)}")
    return ParityResult(
        kind=kind,
        variant=variant,
        dtype=str(dtype).removeprefix("torch."),
        max_abs_diff=float((ref - got).abs().max()),
        max_abs_logit=float(ref.abs().max()),
        argmax_agreement=float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
        shape=tuple(ref.shape),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llada-dir", default=os.environ.get(ENV_LLADA), help=f"(default: ${ENV_LLADA})")
    parser.add_argument("--dream-dir", default=os.environ.get(ENV_DREAM), help=f"(default: ${ENV_DREAM})")
    parser.add_argument("--device", type=torch_device, default="cpu")
    parser.add_argument("--seeds", type=positive_int, default=3, help="random models per family and dtype")
    # checked when parsed: a path under a file failed only once every comparison had run
    parser.add_argument("--json", dest="json_path", type=out_file, help="also write the results here")
    args = parser.parse_args(argv)
    dirs = {"llada": args.llada_dir, "dream": args.dream_dir}
    if not any(dirs.values()):
        parser.error(f"give --llada-dir / --dream-dir (or set {ENV_LLADA} / {ENV_DREAM}).")
    for kind, directory in dirs.items():
        if directory and not Path(directory).is_dir():
            parser.error(f"--{kind}-dir {directory}: no such folder (a folder holding the official modeling code, e.g. a Hub snapshot)")
    dtypes = [torch.float32, torch.bfloat16]
    results = []
    for kind, directory in dirs.items():
        if not directory:
            print(f"{kind}: skipped (no folder given)")
            continue
        for variant in VARIANTS[kind]:
            for dtype in dtypes:
                for seed in range(args.seeds):
                    r = compare(kind, directory, dtype, variant, seed=seed, device=args.device)
                    results.append(r)
                    print(
                        f"{kind:6s} {variant:18s} {r.dtype:9s} seed {seed}: max |official - ours| = "
                        f"{r.max_abs_diff:.3e} (max |logit| {r.max_abs_logit:.2f}, argmax agreement "
                        f"{r.argmax_agreement:.4f})"
                    )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
