"""The embedded tiny checkpoints, and loading any supported checkpoint with its tokenizer.

``TINY_LLADA`` and ``TINY_DREAM`` are folders installed with the package (official LLaDA / Dream
formats, trained by ``hf_blockbatch.training``); real checkpoints load through the same
``from_pretrained`` path from the Hub or a local folder.
"""

from __future__ import annotations

import difflib
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import torch
from transformers import AutoModel, AutoTokenizer, PreTrainedConfig

from hf_blockbatch.checks import COMPUTE_DTYPES, check_device

if TYPE_CHECKING:  # for the hints only
    from transformers import PreTrainedTokenizerBase

    from hf_blockbatch.models import DreamModel, LLaDAModelLM

logger = logging.getLogger(__name__)

__all__ = ["TINY_LLADA", "TINY_DREAM", "checked_dtype", "hub_unreachable", "load_model", "resolve_model_path"]

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


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached now, or ``None`` when it may be.

    Why: without a network, ``from_pretrained`` / ``load_dataset`` of a name that is not cached
    retry for 23-28 s before failing; one TCP connection to the endpoint (or ``HF_HUB_OFFLINE``)
    answers in milliseconds. Behind a proxy the direct connection says nothing, so it is not tried.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host}:{port} cannot be reached ({err.strerror or type(err).__name__})"
    return None


def _cached_on_this_machine(repo_id: str) -> bool:
    """Whether the Hub cache holds ``repo_id``'s config (then it loads offline)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an id the cache cannot even name (e.g. "a/b/c") is not cached
        return False


def _not_found(name: str, why: str) -> FileNotFoundError:
    close = difflib.get_close_matches(name, list(_ALIASES), n=1, cutoff=0.75)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return FileNotFoundError(
        f"Cannot load {name!r}: it is not an embedded model (tiny-llada, tiny-dream) nor a local folder, and {why}."
        + hint
    )


def checked_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    """A floating torch dtype, given as one or by name (``"bfloat16"``, ``"torch.float16"``), ``None``, or ``"auto"``
    (the checkpoint's own), or a one-line error: transformers' is an ``AttributeError`` on the ``torch`` module."""
    # (float8 is floating point to torch, but weights cannot be loaded or computed in it)
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype) and dtype in COMPUTE_DTYPES:
        return dtype
    named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if isinstance(named, torch.dtype) and named in COMPUTE_DTYPES:
        return named
    raise ValueError(f"dtype={dtype!r} is not a dtype a model loads in: use float32, bfloat16 or float16 "
                     "(a torch.dtype or its name), or 'auto' for the checkpoint's own.")  # fmt: skip


def load_model(
    name_or_path: str | os.PathLike[str] = "tiny-llada",
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    **kwargs: Any,
) -> tuple[LLaDAModelLM | DreamModel, PreTrainedTokenizerBase]:
    """Load a supported model and its tokenizer (``trust_remote_code`` is never needed: our own
    classes are registered for ``llada`` and ``Dream``). Defaults: the GPU when present, bf16 on
    GPU, float32 on CPU.

    ``device_map`` (e.g. ``"auto"``) is passed to ``from_pretrained`` so that accelerate spreads a
    model larger than one GPU over the visible GPUs; the model is then left where accelerate put
    it (``device`` is ignored), since moving a dispatched model would undo the placement. Layers
    offloaded to ``"cpu"`` or ``"disk"`` (with ``offload_folder``) wait on ``meta`` between forwards;
    ``model.device`` is then where they compute, and every strategy decodes there.

    A name that is neither embedded nor a folder is a Hub id: when the Hub cannot be reached it
    loads from the local Hub cache, or fails at once (not after the Hub client's retries).
    """
    import hf_blockbatch  # noqa: F401  (registers the Auto classes)

    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ValueError(f"name_or_path must name a checkpoint (tiny-llada, tiny-dream, a Hub id or a folder), got "
                         f"{name_or_path!r}.")  # fmt: skip
    name_or_path = os.fspath(name_or_path)
    if "torch_dtype" in kwargs:  # transformers' older name: passed on beside dtype, the default dtype won silently
        if dtype is not None:
            raise ValueError("Pass dtype= only (torch_dtype is its older name), not both.")
        dtype = kwargs.pop("torch_dtype")
    path = resolve_model_path(name_or_path)
    check_device(device)
    dtype = checked_dtype(dtype)
    local = Path(path).exists()
    if not local:
        if path.startswith((".", "/", "~")) or path.count("/") > 1:  # a path, not a Hub id
            raise FileNotFoundError(f"Cannot load {name_or_path!r}: no such folder.")
        why = hub_unreachable()
        if why is not None:
            if not _cached_on_this_machine(path):
                raise _not_found(name_or_path, f"the Hub cannot be reached to look for it ({why})")
            kwargs.setdefault("local_files_only", True)
    if local and not Path(path).is_dir():
        raise NotADirectoryError(f"Cannot load {name_or_path!r}: it is a file; pass the checkpoint's folder.")
    try:
        return _load(path, device, dtype, **kwargs)
    except OSError as err:
        reason = (str(err).splitlines() or [""])[0]
        if local and isinstance(err, (FileNotFoundError, NotADirectoryError)):  # ours (no tokenizer): says what to do
            raise
        if local:  # transformers' OSError names the missing or unreadable file
            raise ValueError(f"Cannot load the folder {name_or_path!r}: {reason}") from err
        raise _not_found(name_or_path, f"the Hub did not serve it ({type(err).__name__}: {reason})") from err
    except Exception as err:
        # a damaged weights file (truncated download, disk full) fails inside safetensors without its name
        if type(err).__name__ == "SafetensorError" or "safetensors" in type(err).__module__:
            files = _unreadable_safetensors(Path(path)) if local else []
            raise ValueError(
                f"Cannot read the weights of {name_or_path!r} ({', '.join(files) or 'its .safetensors files'}): "
                f"{err}. The file is damaged or incomplete (an interrupted download or copy?): download it again."
            ) from err
        raise


def _unreadable_safetensors(folder: Path) -> list[str]:
    """The ``.safetensors`` files of ``folder`` whose header does not read (the damaged ones)."""
    from safetensors import safe_open

    bad = []
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception:
            bad.append(str(file))
    return bad


#: what a folder holds when it holds a tokenizer (any one, for the fast, slow and BPE formats)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


#: the ``load_model`` keywords that say where a checkpoint's files come from (model, config and tokenizer alike)
_HUB_ARGS = ("local_files_only", "revision", "token", "cache_dir")


def _from_pretrained_whole(path: str, dtype: torch.dtype | str, kwargs: dict[str, Any]) -> LLaDAModelLM | DreamModel:
    """``AutoModel.from_pretrained``, refusing a checkpoint whose weights do not fill the model its ``config.json``
    builds. Why: transformers loads a checkpoint that lacks a tensor with that tensor random (its load report is a
    warning), so the model decoded noise; a tensor of another shape failed with a RuntimeError that only pointed at
    the report. ``ignore_mismatched_sizes=True``, given, keeps transformers' meaning (re-initialise those). A
    checkpoint of another family is refused before its weights load (:func:`_check_model_type`)."""
    _check_model_type(path, {k: kwargs[k] for k in (*_HUB_ARGS, "subfolder") if k in kwargs})
    ignore_mismatched = kwargs.get("ignore_mismatched_sizes", False)
    model, info = AutoModel.from_pretrained(
        path, dtype=dtype, **{**kwargs, "ignore_mismatched_sizes": True, "output_loading_info": True}
    )
    mismatched = sorted(info.get("mismatched_keys") or ()) if not ignore_mismatched else []
    if mismatched:
        key, in_file, in_model = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ValueError(
            f"Cannot load {path!r}: its weight {key} has shape {tuple(in_file)}{more}, where the model its config.json "
            f"describes has {tuple(in_model)}: the weights and config.json are of different models. Use the config.json "
            "saved with these weights."
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(
            f"Cannot load {path!r}: its weights lack {len(missing)} tensor(s) of the model its config.json describes "
            f"({shown}), which would be left random. Download or save the checkpoint again, or load it with "
            "AutoModel.from_pretrained to accept random weights."
        )
    return model


def _check_model_type(path: str, hub: dict[str, Any]) -> None:
    """Refuse a checkpoint of another family before its weights load: ``AutoModel`` built whatever ``config.json``
    names (a Llama folder gave a bare ``LlamaModel``, with no head and no ``generate``), so the mistake only showed
    as an ``AttributeError`` at the first ``generate``. A config without ``model_type`` is left to transformers."""
    from hf_blockbatch.models import DreamConfig, LLaDAConfig

    given = PreTrainedConfig.get_config_dict(path, **hub)[0].get("model_type")
    ours = (LLaDAConfig.model_type, DreamConfig.model_type)
    if given is not None and given not in ours:
        raise ValueError(
            f"Cannot load {path!r}: its config.json is of model_type {given!r}, and hf-blockbatch decodes LLaDA "
            f"({ours[0]!r}) and Dream ({ours[1]!r}) checkpoints only."
        )


def _load(
    path: str, device: str | torch.device | None, dtype: torch.dtype | str | None, **kwargs: Any
) -> tuple[LLaDAModelLM | DreamModel, PreTrainedTokenizerBase]:
    """:func:`load_model` once its arguments are checked: the model on its device, in eval mode, and its tokenizer."""
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).exists() for name in _TOKENIZER_FILES):
        # model.save_pretrained(folder) alone saves no tokenizer; transformers would say it cannot convert
        # "a slow tokenizer" and ask for sentencepiece, after loading the weights
        raise FileNotFoundError(
            f"{path!r} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): save it beside the weights with "
            f"tokenizer.save_pretrained({path!r}), or load the model with AutoModel.from_pretrained({path!r})."
        )
    if kwargs.get("device_map") is not None:
        if dtype is None:
            dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        model = _from_pretrained_whole(path, dtype, kwargs).eval()
        device = getattr(model, "device", None)
    else:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = _from_pretrained_whole(path, dtype, kwargs).to(device).eval()
    hub = {k: kwargs[k] for k in _HUB_ARGS if k in kwargs}
    tokenizer = AutoTokenizer.from_pretrained(path, **hub)
    tokenizer.padding_side = "left"
    logger.info("loaded %s (%s) on %s/%s", path, type(model).__name__, device, dtype)
    return model, tokenizer
