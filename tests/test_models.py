"""The forward contract of the model classes (see ``hf_blockbatch/models/base.py``).

Everything runs in float32 on tiny random models and is checked to 1e-5, on every attention
backend this machine offers: a window forward over a cache must give exactly what the full
forward gives, write its K/V where a full forward would, and a left-padded batch must give each
row what that row gives alone. Also: saving and loading under the official names and auto_map,
and clear errors for bad input.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import VOCAB, make_tiny_dream, make_tiny_llada
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, DynamicCache

import hf_blockbatch as hb
from hf_blockbatch import DreamConfig, DreamModel, LLaDAModelLM
from hf_blockbatch.attention import available_backends

ATOL = 1e-5
FAMILIES = ["llada", "dream"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BACKEND_CASES = [(d, b) for d in DEVICES for b in available_backends(torch.device(d), torch.float32)]
BACKEND_IDS = [f"{d}-{b}" for d, b in BACKEND_CASES]

LLADA_AUTO_MAP = {
    "AutoConfig": "configuration_llada.LLaDAConfig",
    "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
    "AutoModel": "modeling_llada.LLaDAModelLM",
}
DREAM_AUTO_MAP = {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}


def make(family: str, **overrides):
    return make_tiny_llada(**overrides) if family == "llada" else make_tiny_dream(**overrides)


def canvas(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, length), generator=g)


def predicting(full_logits: torch.Tensor, model, row: int, start: int, end: int) -> torch.Tensor:
    """The full forward's logits that predict positions [start, end) of a row (Dream: unshifted
    official logits, so token p is predicted at p - 1)."""
    s = model.logit_shift
    return full_logits[row, start - s : end - s]


def split(out: hb.models.WindowOutput) -> list[torch.Tensor]:
    cu = out.cu_seqlens.tolist()
    return [out.logits[a:b] for a, b in zip(cu[:-1], cu[1:])]


def snapshot(cache: hb.BranchCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


# ------------------------------------------------------------------------------ window = full
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("device", "backend"), BACKEND_CASES, ids=BACKEND_IDS)
@torch.no_grad()
def test_window_forward_matches_full_forward(family: str, device: str, backend: str) -> None:
    model = make(family).to(device)
    model.set_attention_backend(backend)
    L, prompt = 24, 8
    ids = canvas(4, L).to(device)
    full = model(ids, use_cache=True)
    logits, cache = full.logits, full.cache
    before = snapshot(cache)

    # every row: a block, a 1-token window, the whole generation, a window at the left edge
    starts, ends = [prompt, 13, prompt, 1], [prompt + 5, 14, L, 4]
    out = model.forward_windows(ids, starts, ends, cache)
    assert out.logits.shape == (sum(e - s for s, e in zip(starts, ends)), VOCAB)
    assert out.cu_seqlens.tolist() == [0, 5, 6, 6 + L - prompt, 6 + L - prompt + 3]
    for r, got in enumerate(split(out)):
        torch.testing.assert_close(got, predicting(logits, model, r, starts[r], ends[r]), atol=ATOL, rtol=0)

    # a subset of rows; a fresh canvas means the window's recomputed K/V equal the cached ones
    out = model.forward_windows(ids, [prompt + 2, L - 1], [prompt + 6, L], cache, rows=[1, 3])
    want = [predicting(logits, model, 1, prompt + 2, prompt + 6), predicting(logits, model, 3, L - 1, L)]
    for got, ref in zip(split(out), want):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    for (k0, v0), layer in zip(before, cache.layers):
        torch.testing.assert_close(layer.keys, k0, atol=ATOL, rtol=0)
        torch.testing.assert_close(layer.values, v0, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("device", "backend"), BACKEND_CASES, ids=BACKEND_IDS)
@torch.no_grad()
def test_window_forward_writes_kv_in_place(family: str, device: str, backend: str) -> None:
    """After new tokens inside a window, the window forward refreshes exactly the window's K/V.

    The tiny models have 2 layers: layer-0 K/V depend on a position's own token only, and layer-1
    K/V on layer-0 K/V of all positions, which the cache holds fresh (only the window's tokens
    changed). So every layer's K/V at the refreshed positions must equal a fresh full forward's
    on the new canvas, and every other position must keep its old K/V bit for bit.
    """
    model = make(family).to(device)
    assert model.config.num_hidden_layers == 2
    model.set_attention_backend(backend)
    L = 20
    ids = canvas(3, L).to(device)
    cache = model(ids, use_cache=True).cache
    before = snapshot(cache)

    new = ids.clone()
    rows, starts, ends = [0, 2], [6, 12], [10, 13]
    for r, s, e in zip(rows, starts, ends):
        new[r, s:e] = (new[r, s:e] + 1 + torch.arange(e - s, device=device)) % VOCAB
    model.forward_windows(new, starts, ends, cache, rows=rows)
    fresh = model(new, use_cache=True).cache

    refreshed = torch.zeros(3, L, dtype=torch.bool, device=device)
    for r, s, e in zip(rows, starts, ends):
        refreshed[r, s - model.logit_shift : e] = True  # Dream also refreshes the query at s - 1
    for (k0, v0), layer, ref in zip(before, cache.layers, fresh.layers):
        torch.testing.assert_close(layer.keys[refreshed], ref.keys[refreshed], atol=ATOL, rtol=0)
        torch.testing.assert_close(layer.values[refreshed], ref.values[refreshed], atol=ATOL, rtol=0)
        assert torch.equal(layer.keys[~refreshed], k0[~refreshed])
        assert torch.equal(layer.values[~refreshed], v0[~refreshed])
    # the changed tokens did change K/V (the check above is not vacuous)
    assert not torch.allclose(cache.layers[0].keys[refreshed], before[0][0][refreshed])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("device", "backend"), BACKEND_CASES, ids=BACKEND_IDS)
@torch.no_grad()
def test_whole_canvas_window_equals_fresh_full_forward(family: str, device: str, backend: str) -> None:
    """A window over every position of a changed canvas is a full forward: logits and cache."""
    model = make(family).to(device)
    model.set_attention_backend(backend)
    L, s = 16, model.logit_shift  # Dream cannot predict position 0, but still refreshes it
    ids = canvas(2, L).to(device)
    cache = model(ids, use_cache=True).cache
    new = canvas(2, L, seed=1).to(device)
    # each layer writes the window's K/V before attending, so a window over every position sees
    # only fresh K/V: one pass is a full forward
    out = model.forward_windows(new, [s, s], [L, L], cache)
    fresh = model(new, use_cache=True)
    for r, got in enumerate(split(out)):
        torch.testing.assert_close(got, predicting(fresh.logits, model, r, s, L), atol=ATOL, rtol=0)
    for layer, ref in zip(cache.layers, fresh.cache.layers):
        torch.testing.assert_close(layer.keys, ref.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(layer.values, ref.values, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_full_forward_fills_cache_rows_subset(family: str) -> None:
    model = make(family)
    ids = canvas(2, 12)
    cache = model.new_cache(4, 12)
    cache.storage.fill_(float("nan"))  # allocated uninitialized: mark every slot
    model(ids, cache=cache, cache_rows=[3, 1])
    alone = model(ids, use_cache=True).cache
    for layer, ref in zip(cache.layers, alone.layers):
        assert torch.equal(layer.keys[3], ref.keys[0]) and torch.equal(layer.keys[1], ref.keys[1])
        assert torch.equal(layer.values[3], ref.values[0]) and torch.equal(layer.values[1], ref.values[1])
        assert layer.keys[[0, 2]].isnan().all() and layer.values[[0, 2]].isnan().all()  # untouched rows untouched


# ------------------------------------------------------------------------------ left padding
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("device", "backend"), BACKEND_CASES, ids=BACKEND_IDS)
@torch.no_grad()
def test_left_padded_batch_matches_rows_alone(family: str, device: str, backend: str) -> None:
    model = make(family).to(device)
    model.set_attention_backend(backend)
    L, pads = 18, [0, 5, 2]
    ids = canvas(3, L).to(device)
    mask = torch.ones(3, L, dtype=torch.long, device=device)
    for r, p in enumerate(pads):
        ids[r, :p] = model.config.pad_token_id
        mask[r, :p] = 0
    alone = [model(ids[r : r + 1, p:]).logits[0] for r, p in enumerate(pads)]

    full = model(ids, attention_mask=mask, use_cache=True)
    assert full.cache.has_padding
    for r, p in enumerate(pads):
        torch.testing.assert_close(full.logits[r, p:], alone[r], atol=ATOL, rtol=0)

    # windows in canvas coordinates; each row's positions are its own (padding does not shift them)
    starts, ends = [10, 9, 12], [14, 10, 18]
    out = model.forward_windows(ids, starts, ends, full.cache)
    s = model.logit_shift
    for r, got in enumerate(split(out)):
        p = pads[r]
        torch.testing.assert_close(got, alone[r][starts[r] - p - s : ends[r] - p - s], atol=ATOL, rtol=0)
    out = model.forward_windows(ids, [8, 16], [12, 17], full.cache, rows=[1, 2])
    for (r, a, b), got in zip([(1, 8, 12), (2, 16, 17)], split(out)):
        p = pads[r]
        torch.testing.assert_close(got, alone[r][a - p - s : b - p - s], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_full_forward_into_padded_cache_uses_its_mask(family: str) -> None:
    """A cache carries its padding mask: a full forward into it without attention_mask uses it,
    and an attention_mask that disagrees with it is refused (the K/V, the RoPE positions and the
    later window forwards would otherwise follow different masks)."""
    model = make(family)
    ids = canvas(3, 14)
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[1, :4] = 0
    ref = model(ids, attention_mask=mask, use_cache=True)
    cache = model.new_cache(3, 14, attention_mask=mask)
    out = model(ids, cache=cache)
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    for layer, want in zip(cache.layers, ref.cache.layers):
        torch.testing.assert_close(layer.keys, want.keys, atol=ATOL, rtol=0)
    sub = model.new_cache(3, 14, attention_mask=mask)
    model(ids[1:], cache=sub, cache_rows=[1, 2])  # the mask of the named rows
    torch.testing.assert_close(sub.layers[1].values[1:], ref.cache.layers[1].values[1:], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match=r"differs from the padding mask of the cache.*new_cache"):
        model(ids, attention_mask=mask, cache=model.new_cache(3, 14))
    with pytest.raises(ValueError, match="differs from the padding mask of the cache"):
        model(ids[:2], attention_mask=mask[:2], cache=cache, cache_rows=[1, 2])
    model(ids[1:], attention_mask=mask[1:], cache=cache, cache_rows=[1, 2])  # consistent: accepted


# ------------------------------------------------------------------------------ save / load
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_save_pretrained_round_trip(family: str, tmp_path) -> None:
    model = make(family)
    model.set_attention_backend("reference")
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    ids = canvas(2, 16)
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.config.window_attention == "reference"
    assert loaded.attention_backend.name == "reference"
    for key, value in model.config.to_diff_dict().items():
        if key not in ("transformers_version", "dtype", "torch_dtype"):
            assert getattr(loaded.config, key) == value, key
    assert set(loaded.state_dict()) == set(model.state_dict())


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_auto_classes_with_official_auto_map(family: str, tmp_path) -> None:
    """A folder whose config.json names the official remote code (which is not there) still
    loads our classes through the Auto API, with trust_remote_code=True as users write it."""
    model = make(family)
    model.save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = LLADA_AUTO_MAP if family == "llada" else DREAM_AUTO_MAP
    config_path.write_text(json.dumps(config))
    assert not list(tmp_path.glob("*.py"))

    auto_config = AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(auto_config) is type(model.config)
    assert auto_config.model_type == ("llada" if family == "llada" else "Dream")
    ids = canvas(1, 12)
    auto_classes = [AutoModel] + ([AutoModelForCausalLM] if family == "llada" else [])
    for auto in auto_classes:
        loaded = auto.from_pretrained(tmp_path, trust_remote_code=True).eval()
        assert type(loaded) is type(model)
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_checkpoint_of_the_other_family_is_refused_by_the_class(tmp_path) -> None:
    """``LLaDAModelLM.from_pretrained(<a Dream folder>)`` failed inside transformers (``property 'hidden_size' of
    'LLaDAConfig' object has no setter``), and a Dream class given a LLaDA folder built its config from the official
    7B defaults, with transformers' warning only (``DreamModel.from_pretrained`` then ran out of memory; not called
    here for that reason). Both now say which class reads the folder; the Auto classes pick it as before."""
    make("llada").save_pretrained(tmp_path / "llada")
    make("dream").save_pretrained(tmp_path / "dream")
    message = "This config is of model_type {!r}, and {} reads {!r} ones: load the checkpoint with AutoModel.from_pretrained"
    with pytest.raises(ValueError, match=re.escape(message.format("Dream", "LLaDAConfig", "llada"))):
        LLaDAModelLM.from_pretrained(tmp_path / "dream")
    with pytest.raises(ValueError, match=re.escape(message.format("llada", "DreamConfig", "Dream"))):
        DreamConfig.from_pretrained(tmp_path / "llada")
    for family, cls in (("llada", LLaDAModelLM), ("dream", DreamModel)):
        assert type(AutoModel.from_pretrained(tmp_path / family)) is cls
        assert type(cls.from_pretrained(tmp_path / family)) is cls
    assert DreamConfig.from_dict({"hidden_size": 64}).hidden_size == 64  # a dict without model_type: nothing to tell


def llada_official_keys(n_layers: int) -> set[str]:
    keys = {"model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"}
    for i in range(n_layers):
        for name in ("attn_norm", "ff_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"):
            keys.add(f"model.transformer.blocks.{i}.{name}.weight")
    return keys


def dream_official_keys(n_layers: int) -> set[str]:
    keys = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(n_layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            keys |= {f"{p}.self_attn.{proj}.weight", f"{p}.self_attn.{proj}.bias"}
        keys.add(f"{p}.self_attn.o_proj.weight")
        keys |= {f"{p}.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
        keys |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
    return keys


def test_state_dict_keys_are_the_official_names() -> None:
    # spelled out for one layer, so a renamed module cannot hide behind a shared helper
    assert set(make_tiny_llada(n_layers=1).state_dict()) == {
        "model.transformer.wte.weight",
        "model.transformer.blocks.0.attn_norm.weight",
        "model.transformer.blocks.0.ff_norm.weight",
        "model.transformer.blocks.0.q_proj.weight",
        "model.transformer.blocks.0.k_proj.weight",
        "model.transformer.blocks.0.v_proj.weight",
        "model.transformer.blocks.0.attn_out.weight",
        "model.transformer.blocks.0.ff_proj.weight",
        "model.transformer.blocks.0.up_proj.weight",
        "model.transformer.blocks.0.ff_out.weight",
        "model.transformer.ln_f.weight",
        "model.transformer.ff_out.weight",
    }
    assert set(make_tiny_dream(num_hidden_layers=1).state_dict()) == {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.v_proj.bias",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    }
    assert set(make_tiny_llada().state_dict()) == llada_official_keys(2)
    assert set(make_tiny_dream().state_dict()) == dream_official_keys(2)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_official_format_checkpoint_loads(family: str, tmp_path) -> None:
    """A folder as the Hub ships it (official config.json with auto_map, safetensors under the
    official names, no save_pretrained involved) loads with no missing or unexpected keys."""
    model = make(family)
    expected = llada_official_keys(2) if family == "llada" else dream_official_keys(2)
    g = torch.Generator().manual_seed(7)
    weights = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in model.state_dict().items()}
    assert set(weights) == expected
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("window_attention")  # ours, absent from the official configs
    config["auto_map"] = LLADA_AUTO_MAP if family == "llada" else DREAM_AUTO_MAP
    config["transformers_version"] = "4.46.3"
    (tmp_path / "config.json").write_text(json.dumps(config))

    loaded, info = AutoModel.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert type(loaded) is type(model)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert loaded.config.window_attention == "auto"
    state = loaded.state_dict()
    for k, v in weights.items():
        assert torch.equal(state[k], v), k


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_logits_mask_returns_exactly_the_masked_logits(family: str) -> None:
    """Both forwards: only the masked positions go through the head, packed in row-major order;
    the K/V written are the same as without a mask."""
    model = make(family)
    ids = canvas(3, 16)
    g = torch.Generator().manual_seed(1)
    full = model(ids, use_cache=True)
    mask = torch.rand(3, 16, generator=g) < 0.4
    masked = model(ids, use_cache=True, logits_mask=mask)
    assert masked.logits.shape == (int(mask.sum()), VOCAB)
    torch.testing.assert_close(masked.logits, full.logits[mask], atol=ATOL, rtol=0)
    for a, b in zip(masked.cache.layers, full.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)

    starts, ends = [6, 3, 9], [11, 4, 16]
    dense = model.forward_windows(ids, starts, ends, full.cache)
    pick = torch.rand(dense.logits.shape[0], generator=g) < 0.5
    out = model.forward_windows(ids, starts, ends, full.cache, logits_mask=pick)
    torch.testing.assert_close(out.logits, dense.logits[pick], atol=ATOL, rtol=0)
    assert torch.equal(out.cu_seqlens, dense.cu_seqlens)
    with pytest.raises(ValueError, match=r"logits_mask has shape \(3,\), expected \(13,\)"):
        model.forward_windows(ids, starts, ends, full.cache, logits_mask=pick[:3])


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_the_last_layer_computes_past_its_attention_only_the_rows_the_head_reads(family: str) -> None:
    """Every layer projects q, k and v for every query (the K/V go to the cache); past its attention the last
    layer projects, adds and runs its MLP for the head's rows alone, in each forward that picks them."""
    model = make(family)
    ids = canvas(3, 16)
    mask = torch.rand(3, 16, generator=torch.Generator().manual_seed(2)) < 0.4
    rows: dict[int, list[int]] = {}
    hooks = [lin.register_forward_pre_hook(lambda m, a, i=i: rows.setdefault(i, []).append(a[0].reshape(-1, a[0].shape[-1]).shape[0]))
             for i, layer in enumerate(model._decoder_layers()) for lin in layer.modules() if isinstance(lin, torch.nn.Linear)]  # fmt: skip
    try:
        out = model(ids, use_cache=True, logits_mask=mask)
        n = int(mask.sum())
        assert sorted(rows[0]) == [48] * 7 and sorted(rows[len(rows) - 1]) == [n] * 4 + [48] * 3
        rows.clear()
        predict = torch.zeros(3, 16, dtype=torch.bool)
        predict[:, 9:12] = True
        refresh = torch.zeros_like(predict)
        refresh[:, 2:5] = True
        model.forward_positions(ids, predict, refresh, out.cache)
        assert sorted(rows[len(rows) - 1]) == [9] * 4 + [18] * 3
    finally:
        for h in hooks:
            h.remove()
    with pytest.raises(ValueError, match=r"logits_mask has shape \(3, 15\), expected \(3, 16\)"):
        model(ids, logits_mask=mask[:, :15])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("device", "backend"), BACKEND_CASES, ids=BACKEND_IDS)
@torch.no_grad()
def test_per_query_mask_packs_sequences_exactly(family: str, device: str, backend: str) -> None:
    """A bool per-query mask (transformers' custom 4D mask): two canvases packed into one row with a
    block-diagonal mask and their own positions give each canvas's logits alone; a query that may not
    see one key (a leave-one-out query) gives what a canvas without that key gives; an all-True mask is
    the plain forward; ``[B, L, L]`` and ``[B, 1, L, L]`` are the same mask; ``logits_mask`` still packs."""
    model = make(family).to(device)
    model.set_attention_backend(backend)
    a, b = canvas(1, 9, seed=1).to(device), canvas(1, 6, seed=2).to(device)
    alone = [model(a).logits[0], model(b).logits[0]]
    ids = torch.cat([a, b], 1)
    mask = torch.zeros(1, 15, 15, dtype=torch.bool, device=device)
    mask[0, :9, :9] = mask[0, 9:, 9:] = True
    pos = torch.cat([torch.arange(9), torch.arange(6)]).to(device)[None]
    packed = model(ids, attention_mask=mask, position_ids=pos).logits[0]
    torch.testing.assert_close(packed[:9], alone[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(packed[9:], alone[1], atol=ATOL, rtol=0)
    four = model(ids, attention_mask=mask[:, None], position_ids=pos).logits
    torch.testing.assert_close(four[0], packed, atol=0, rtol=0)
    pick = torch.zeros(1, 15, dtype=torch.bool, device=device)
    pick[0, [2, 11]] = True
    out = model(ids, attention_mask=mask, position_ids=pos, logits_mask=pick).logits
    torch.testing.assert_close(out, packed[[2, 11]], atol=ATOL, rtol=0)
    # a shadow query beside the canvas: a copy of token 7 at position 7, which the canvas does not see,
    # seeing the canvas but for key 7 (it has its own) is position 7's query exactly; hiding key 4 from
    # it as well (a leave-one-out query) changes what it predicts, and nothing of the canvas's
    c = canvas(1, 10, seed=3).to(device)
    plain = model(c).logits[0]
    ids2 = torch.cat([c, c[:, 7:8]], 1)
    pos2 = torch.cat([torch.arange(10), torch.tensor([7])]).to(device)[None]
    twin = torch.ones(1, 11, 11, dtype=torch.bool, device=device)
    twin[0, :10, 10] = False
    twin[0, 10, 7] = False
    got = model(ids2, attention_mask=twin, position_ids=pos2).logits[0]
    torch.testing.assert_close(got[:10], plain, atol=ATOL, rtol=0)
    torch.testing.assert_close(got[10], plain[7], atol=ATOL, rtol=0)
    loo = twin.clone()
    loo[0, 10, 4] = False
    got = model(ids2, attention_mask=loo, position_ids=pos2).logits[0]
    torch.testing.assert_close(got[:10], plain, atol=ATOL, rtol=0)
    assert (got[10] - plain[7]).abs().max() > 1e-3
    full = model(ids).logits
    torch.testing.assert_close(model(ids, attention_mask=torch.ones(1, 15, 15, dtype=torch.bool, device=device)).logits,
                               full, atol=ATOL, rtol=0)  # fmt: skip
    # two rows, each with its own mask (row 0 packed as above, row 1 a plain canvas); a batch-1 mask is every row's
    both = torch.cat([ids, canvas(1, 15, seed=4).to(device)])
    masks = torch.stack([mask[0], torch.ones(15, 15, dtype=torch.bool, device=device)])
    pos2 = torch.cat([pos, torch.arange(15, device=device)[None]])
    got = model(both, attention_mask=masks, position_ids=pos2).logits
    torch.testing.assert_close(got[0], packed, atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], model(both[1:]).logits[0], atol=ATOL, rtol=0)
    shared = model(both, attention_mask=mask, position_ids=pos).logits  # [1, L, L] and [1, L]: for both rows
    torch.testing.assert_close(shared[0], packed, atol=ATOL, rtol=0)
    torch.testing.assert_close(shared[1], model(both[1:], attention_mask=mask, position_ids=pos).logits[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_per_query_mask_errors(family: str) -> None:
    model = make(family)
    ids = canvas(2, 8)
    ok = torch.ones(2, 8, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="works without a cache"):
        model(ids, attention_mask=ok, use_cache=True)
    with pytest.raises(ValueError, match="works without a cache"):
        model(ids, attention_mask=ok, cache=model.new_cache(2, 8))
    with pytest.raises(ValueError, match=r"must be bool.*`m.bool\(\)`.*`m == 0`"):
        model(ids, attention_mask=ok.float())
    with pytest.raises(ValueError, match=r"expected \(2, 8\) \(padding\), or \(2, 8, 8\) / \(2, 1, 8, 8\)"):
        model(ids, attention_mask=ok[0, 0])
    with pytest.raises(ValueError, match=r"expected \(2, 8, 8\) or \(2, 1, 8, 8\)"):
        model(ids, attention_mask=ok[:, :7])
    with pytest.raises(ValueError, match=r"\[batch, 1, length, length\]"):
        model(ids, attention_mask=ok[:, None].expand(2, 4, 8, 8))
    empty = ok.clone()
    empty[1, 3] = False
    with pytest.raises(ValueError, match="leaves a query with no key"):
        model(ids, attention_mask=empty)
    with pytest.raises(ValueError, match=r"position_ids has shape \(2, 7\), expected \(2, 8\)"):
        model(ids, attention_mask=ok, position_ids=torch.zeros(2, 7, dtype=torch.long))
    # positions index RoPE's table: a negative one would read its far end in silence (either mask form)
    for mask in (ok, None):
        with pytest.raises(ValueError, match=r"position_ids must lie in \[0, 8\).*got -1\.\.6"):
            model(ids, attention_mask=mask, position_ids=torch.arange(-1, 7).expand(2, 8))
        with pytest.raises(ValueError, match=r"position_ids must lie in \[0, 8\).*got 0\.\.8"):
            model(ids, attention_mask=mask, position_ids=torch.tensor([list(range(8)), [0] * 7 + [8]]))
        with pytest.raises(ValueError, match="position_ids must be integers, got torch.float32"):
            model(ids, attention_mask=mask, position_ids=torch.arange(8.0).expand(2, 8))
    # with a cache, positions are the cache's (set by its padding mask): the same ones pass, others are refused
    model(ids, position_ids=torch.arange(8).expand(2, 8), use_cache=True)
    with pytest.raises(ValueError, match="position_ids differ from the cache's"):
        model(ids, position_ids=torch.arange(8).flip(0).expand(2, 8), use_cache=True)


@pytest.fixture(params=FAMILIES)
def filled(request):
    model = make(request.param)
    ids = canvas(3, 16)
    return model, ids, model(ids, use_cache=True).cache


@torch.no_grad()
def test_window_errors(filled) -> None:
    model, ids, cache = filled
    s = model.logit_shift
    with pytest.raises(ValueError, match=r"0 <= start < end <= 16"):
        model.forward_windows(ids, [2, 3, 4], [6, 7, 17], cache)  # past the canvas
    with pytest.raises(ValueError, match=r"0 <= start < end <= 16"):
        model.forward_windows(ids, [5, 3, 4], [5, 7, 8], cache)  # start == end
    with pytest.raises(ValueError, match=r"0 <= start < end <= 16"):
        model.forward_windows(ids, [6, 3, 4], [5, 7, 8], cache)  # start > end
    if s == 0:
        with pytest.raises(ValueError, match=r"0 <= start < end <= 16"):
            model.forward_windows(ids, [-1, 3, 4], [5, 7, 8], cache)
    else:
        with pytest.raises(ValueError, match=r"cannot predict position 0: windows must start at 1"):
            model.forward_windows(ids, [0, 3, 4], [5, 7, 8], cache)
    with pytest.raises(ValueError, match=r"one \[start, end\) window per row"):
        model.forward_windows(ids, [2, 3], [6, 7, 8], cache)
    with pytest.raises(ValueError, match=r"one \[start, end\) window per row"):
        model.forward_windows(ids, [2, 3], [6, 7], cache, rows=[0, 1, 2])
    with pytest.raises(ValueError, match="strictly increasing"):
        model.forward_windows(ids, [2, 3], [6, 7], cache, rows=[2, 1])
    with pytest.raises(ValueError, match="strictly increasing"):
        model.forward_windows(ids, [2, 3], [6, 7], cache, rows=[1, 1])
    with pytest.raises(ValueError, match="strictly increasing indices into the cache's 3 rows"):
        model.forward_windows(ids, [2, 3], [6, 7], cache, rows=[1, 3])
    with pytest.raises(ValueError, match="pass the canvas of every cache row"):
        model.forward_windows(ids[:2], [2, 3], [6, 7], cache, rows=[0, 1])


@torch.no_grad()
def test_cache_mismatch_errors(filled) -> None:
    model, ids, cache = filled
    other_family = make("dream" if model.logit_shift == 0 else "llada")
    with pytest.raises(ValueError, match=r"another model .*new_cache\(\)"):
        other_family.forward_windows(ids, [2, 3, 4], [6, 7, 8], cache)
    with pytest.raises(ValueError, match=r"another model .*new_cache\(\)"):
        other_family(ids, cache=cache)
    # same model type, other geometry: fewer layers, other KV heads
    if model.logit_shift == 0:
        deeper, narrower = make_tiny_llada(n_layers=3), make_tiny_llada(n_kv_heads=2)
    else:
        deeper, narrower = make_tiny_dream(num_hidden_layers=3), make_tiny_dream(num_key_value_heads=1)
    # the other family at this cache's very geometry: only the model type tells them apart
    twin = make_tiny_dream(num_key_value_heads=4) if model.logit_shift == 0 else make_tiny_llada(n_kv_heads=2)
    assert twin.config.kv_geometry() == model.config.kv_geometry()
    for other in (deeper, narrower, twin):
        with pytest.raises(ValueError, match="another model"):
            other.forward_windows(ids, [2, 3, 4], [6, 7, 8], cache)
    # another canvas length
    with pytest.raises(ValueError, match="holds canvases of length 16, but input_ids has length 20"):
        model.forward_windows(canvas(3, 20), [2, 3, 4], [6, 7, 8], cache)
    with pytest.raises(ValueError, match="holds canvases of length 16"):
        model(canvas(3, 20), cache=cache)
    # full forward into a cache with another row count
    with pytest.raises(ValueError, match="pass cache_rows"):
        model(ids[:2], cache=cache)
    with pytest.raises(ValueError, match="cache_rows names 1 rows but input_ids has 2"):
        model(ids[:2], cache=cache, cache_rows=[0])
    # the model's geometry, another dtype: refused before a full forward casts K/V into it or a window forward's
    # attention kernel fails on the mixed dtypes
    float64 = hb.BranchCache.for_model(model.config, 3, 16, dtype=torch.float64)
    for forward in (lambda: model(ids, cache=float64), lambda: model.forward_windows(ids, [2, 3, 4], [6, 7, 8], float64)):
        with pytest.raises(ValueError, match=r"holds torch.float64 K/V on cpu, and the model computes in torch.float32"):
            forward()
    # not a BranchCache at all
    with pytest.raises(TypeError, match="BranchCache"):
        model.forward_windows(ids, [2, 3, 4], [6, 7, 8], DynamicCache())


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_input_errors(family: str) -> None:
    model = make(family)  # context: 256 positions
    with pytest.raises(ValueError, match=r"canvas has 257 positions but the model's context is 256.*shorten"):
        model(canvas(1, 257))
    with pytest.raises(ValueError, match="length=300 exceeds the model's context of 256"):  # before any forward
        model.new_cache(1, 300)
    with pytest.raises(ValueError, match=r"input_ids must be \[rows, length\]"):
        model(canvas(1, 8)[0])
    ids = canvas(2, 8)
    right_padded = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    with pytest.raises(ValueError, match="left-padded.*padding_side='left'"):
        model(ids, attention_mask=right_padded, use_cache=True)
    with pytest.raises(ValueError, match="left-padded"):
        model.new_cache(2, 8, attention_mask=right_padded)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 7\), expected \(2, 8\)"):
        model(ids, attention_mask=torch.ones(2, 7))


@pytest.mark.parametrize("family", FAMILIES)
def test_unknown_backend_name(family: str) -> None:
    model = make(family)
    with pytest.raises(ValueError, match=r"Unknown attention backend 'flash'.*choose one of.*'sdpa'"):
        model.set_attention_backend("flash")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"cannot run on cpu.*available here"):
            model.set_attention_backend("torch_varlen")


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("llada", {"block_type": "sequential"}),
        ("llada", {"alibi": True, "rope": False}),
        ("llada", {"alibi": True}),
        ("llada", {"attention_layer_norm": True}),
        ("llada", {"layer_norm_type": "default"}),
        ("llada", {"layer_norm_with_affine": False}),  # its checkpoints hold no norm weights: ones would stand in
        ("llada", {"activation_type": "gelu"}),
        ("llada", {"block_group_size": 2}),
        ("llada", {"include_bias": True, "bias_for_layer_norm": None}),
        ("llada", {"bias_for_layer_norm": True}),
        ("llada", {"activation_type": "swiglu"}),  # the official llama block cannot run it
        ("llada", {"n_kv_heads": 2, "multi_query_attention": True}),  # the official config refuses both
        ("llada", {"n_kv_heads": 2, "multi_query_attention": False}),
        ("llada", {"embedding_size": VOCAB - 8}),  # a table smaller than the vocabulary
        ("llada", {"d_model": 60}),  # head dim 15: RoPE rotates pairs
        ("dream", {"hidden_size": 60}),
        ("dream", {"use_sliding_window": True}),
        ("dream", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("dream", {"hidden_act": "gelu"}),
        ("dream", {"num_key_value_heads": 3}),  # 4 query heads do not share 3 KV heads
    ],
)
def test_unsupported_options_refused(family: str, options: dict) -> None:
    with pytest.raises(NotImplementedError, match="unsupported options"):
        make(family, **options)


@pytest.mark.parametrize("options", [{"d_model": 66}, {"n_kv_heads": 3}])
def test_llada_heads_that_do_not_divide_are_refused_saying_so(options: dict) -> None:
    with pytest.raises(NotImplementedError) as err:
        make_tiny_llada(**options)
    assert str(err.value) == "This LLaDA config uses unsupported options: d_model must divide by n_heads, n_heads by n_kv_heads"


def test_llada_config_answers_to_transformers_names_of_its_sizes() -> None:
    config = make_tiny_llada(d_model=96, n_heads=6, n_kv_heads=2, n_layers=3).config
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (96, 6, 3)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_full_forward_with_return_dict_false_returns_logits_and_cache(family: str) -> None:
    """transformers' convention: ``return_dict=False`` gives a tuple, here ``(logits, cache)``."""
    model, ids = make(family), torch.tensor([[5, 6, 7, 8]])
    logits, cache = model(ids, return_dict=False)
    assert cache is None and torch.equal(logits, model(ids).logits)
    cache = model.new_cache(1, 4)
    out = model(ids, cache=cache, return_dict=False)
    assert len(out) == 2 and out[1] is cache and torch.equal(out[0], logits)


def test_dream_rope_scaling_is_read_without_transformers_deprecation_warning(tmp_path) -> None:
    """DreamConfig stored the official configs' ``rope_scaling`` through transformers 5's deprecated setter, which
    warned "`rope_scaling` is deprecated ... Set `rope_parameters` instead" for every config that sets it, a
    user's or a checkpoint's. It now stores ``rope_parameters`` itself: no warning, the same config, and a
    scaled RoPE is still refused."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails here
        cfg = DreamConfig(rope_scaling={"rope_type": "default"})
        cfg.save_pretrained(tmp_path)
        assert DreamConfig.from_pretrained(tmp_path).rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
        cfg.validate_supported()
        with pytest.raises(NotImplementedError, match="rope_scaling type 'linear'"):
            DreamConfig(rope_scaling={"type": "linear", "factor": 2.0}).validate_supported()
        with pytest.raises(NotImplementedError, match="rope_scaling type 'linear'"):
            DreamConfig(rope_parameters={"rope_type": "linear", "factor": 2.0}).validate_supported()


def test_supported_llada_options_build() -> None:
    # options the released checkpoints might use, all computed: GQA, biases without norm biases,
    # weight tying (no ff_out head), input embedding scaling, logit scaling
    model = make_tiny_llada(
        n_kv_heads=2, include_bias=True, bias_for_layer_norm=False, weight_tying=True, input_emb_norm=True,
        scale_logits=True,
    )  # fmt: skip
    assert "model.transformer.ff_out.weight" not in model.state_dict()
    assert "model.transformer.blocks.0.q_proj.bias" in model.state_dict()
    assert model(canvas(1, 8)).logits.shape == (1, 8, VOCAB)


@pytest.mark.parametrize(("family", "tied"), [("llada", False), ("llada", True), ("dream", False), ("dream", True)])
@torch.no_grad()
def test_resize_token_embeddings_resizes_the_head_and_saves(family: str, tied: bool, tmp_path) -> None:
    """transformers' resize grows the embedding and the head together (an untied LLaDA head used to keep
    the old vocabulary), keeps the old tokens' logits, and the resized model loads back."""
    tie = {"weight_tying": tied} if family == "llada" else {"tie_word_embeddings": tied}
    model = make(family, **tie)
    ids = canvas(2, 12)
    before = model(ids).logits
    model.resize_token_embeddings(VOCAB + 32, mean_resizing=False)
    assert model.get_input_embeddings().weight.shape[0] == VOCAB + 32
    assert model.get_output_embeddings().weight.shape[0] == VOCAB + 32
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    assert torch.allclose(model(ids).logits[..., :VOCAB], before, atol=ATOL)
    new_ids = torch.tensor([[1, 2, VOCAB + 31]])
    assert model(new_ids).logits.shape == (1, 3, VOCAB + 32)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert torch.equal(loaded(new_ids).logits, model(new_ids).logits)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_forward_says_what_it_does_not_return(family: str) -> None:
    """transformers' other forward arguments pass through unused, except those whose answer this forward
    does not give: hidden states and attention weights are refused rather than silently missing, and
    ``labels`` get the official LLaDA code's warning (no loss here) with the logits unchanged."""
    import warnings

    model = make_tiny_llada() if family == "llada" else make_tiny_dream()
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = model(ids).logits
    with pytest.raises(NotImplementedError, match="output_hidden_states.*forward hook"):
        model(ids, output_hidden_states=True)
    with pytest.raises(NotImplementedError, match="output_attentions.*no weights"):
        model(ids, output_attentions=True)
    with pytest.warns(UserWarning, match="labels are not used.*sft_loss"):
        out = model(ids, labels=ids)
    assert torch.equal(out.logits, expected) and "loss" not in out
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # False / None ask for nothing: no warning, no error
        assert torch.equal(model(ids, output_hidden_states=False, output_attentions=None, labels=None).logits, expected)


@pytest.mark.parametrize("family", ["llada", "llada-emb-norm", "dream"])
def test_inputs_embeds_stand_for_the_embedding_lookup(family: str) -> None:
    """``inputs_embeds`` give the logits of the ids they embed, with a
    padding mask, a per-query mask and a cache, as both official forwards take them (they failed with an
    ``AttributeError`` on ``None``); LLaDA's ``input_emb_norm`` scales them as it scales the lookup."""
    model = make_tiny_dream() if family == "dream" else make_tiny_llada(input_emb_norm=family == "llada-emb-norm")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    embeds = model.get_input_embeddings()(ids)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    per_query = torch.ones(2, 4, 4, dtype=torch.bool).tril()
    for kwargs in ({}, {"attention_mask": mask}, {"attention_mask": per_query}, {"attention_mask": mask, "use_cache": True}):
        expected = model(ids, **kwargs).logits
        assert torch.allclose(model(inputs_embeds=embeds, **kwargs).logits, expected, atol=1e-6), kwargs
    assert torch.allclose(model(inputs_embeds=embeds.double()).logits, model(ids).logits, atol=1e-6)  # cast
    for kwargs, message in (({}, "Pass input_ids .* or inputs_embeds"), ({"input_ids": ids, "inputs_embeds": embeds}, "one of them"),
                            ({"inputs_embeds": embeds[0]}, r"must be \[batch, length, \d+\]"),
                            ({"inputs_embeds": ids[..., None].expand(2, 4, embeds.shape[-1])}, "floating point")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            model(**kwargs)


def test_a_padding_mask_holds_zeros_and_ones() -> None:
    """The forward and the cache read a ``[B, L]`` mask as padding: 0.5 or 2 were read as 1 (``.bool()``), where the
    official codes add ``(1 - mask) * min`` to the scores (0.5 masks the key, 2 overflows). A bool mask is as its 0/1."""
    model = make_tiny_llada()
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.tensor([[0, 1, 1, 1]])
    for odd in (mask * 0.5, mask * 2, mask - 1):
        with pytest.raises(ValueError, match=r"attention_mask must hold 0 \(padding\) and 1 \(a token\) only"):
            model(ids, attention_mask=odd)
        with pytest.raises(ValueError, match=r"attention_mask must hold 0 \(padding\) and 1 \(a token\) only"):
            model.new_cache(1, 4, attention_mask=odd)
    assert torch.equal(model(ids, attention_mask=mask.bool()).logits, model(ids, attention_mask=mask).logits)
    assert torch.equal(model(ids, attention_mask=mask.float()).logits, model(ids, attention_mask=mask).logits)


def test_the_forwards_and_new_cache_refuse_ids_sizes_and_masks_they_cannot_use() -> None:
    """Each of these failed inside torch (an IndexError in the embedding, "negative dimension", an ``AttributeError``
    on a list) or gave other rows' logits (Dream's windows read a 0/1 integer ``logits_mask`` as row numbers)."""
    model = make_tiny_llada()
    size = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=f"input_ids holds token id {size + 5}, outside this model's vocabulary"):
        model(torch.tensor([[5, size + 5, 7]]))
    with pytest.raises(ValueError, match="input_ids must be an integer tensor of token ids, got torch.float32"):
        model(torch.tensor([[5.0, 6.0, 7.0]]))
    for bad in (size, -1):  # the first id past the table, and a negative one (the embedding's IndexError before)
        with pytest.raises(ValueError, match=f"input_ids holds token id {bad}, outside this model's vocabulary"):
            model(torch.tensor([[5, bad, 7]]))
    assert model(torch.tensor([[0, size - 1]])).logits.shape[1] == 2  # both ends of the table embed
    for args, message in (((-1, 12), "num_rows must be a positive integer"), ((2.0, 12), "num_rows must be a positive"),
                          ((2, 0), "length must be a positive integer"), ((1, 10**5), "exceeds the model's context"),
                          ((1, 4, [[0, 1, 1, 1]]), "attention_mask must be a .num_rows, length. tensor")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            model.new_cache(*args)
    dream = make_tiny_dream()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    cache = dream.new_cache(1, 6)
    dream(ids, cache=cache)
    window = dict(starts=torch.tensor([2]), ends=torch.tensor([6]), cache=cache)
    with pytest.raises(ValueError, match="logits_mask must be a bool tensor"):
        dream.forward_windows(ids, logits_mask=torch.tensor([1, 0, 1, 0]), **window)
    assert dream.forward_windows(ids, logits_mask=torch.tensor([True, False, True, False]), **window).logits.shape[0] == 2
    with pytest.raises(ValueError, match="logits_mask must be a bool tensor"):
        model(torch.tensor([[5, 6, 7]]), logits_mask=torch.ones(1, 3, dtype=torch.long))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_a_longer_canvas_after_a_short_one_gets_its_own_rope_angles(family: str) -> None:
    """The RoPE table is built for the first canvas (at least 256 positions) and must grow for a longer one:
    a model that has served a short canvas forwards a 300-position one exactly as a fresh model does."""
    context = {"max_sequence_length": 512} if family == "llada" else {"max_position_embeddings": 512}
    used = make(family, **context)
    used(canvas(1, 16))
    long = canvas(1, 300, seed=1)
    assert torch.equal(used(long).logits, make(family, **context)(long).logits)


def test_rope_rounds_in_the_activation_dtype_unless_the_config_says_float32() -> None:
    """Dream rotates bf16 activations in bf16 (its official ``q * cos + rotate_half(q) * sin`` on bf16 tables);
    LLaDA rotates in float32 and rounds once (``rope_full_precision``). The two round differently, so each path
    must be the one its flag names."""
    from hf_blockbatch.models.layers import apply_rope, rope_cos_sin

    x = torch.randn(64, 4, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    cos, sin = rope_cos_sin(torch.arange(64) * 3, 32, 10000.0)
    rotated = torch.cat([-x[..., 16:], x[..., :16]], -1)  # the official rotate_half
    plain_sin = torch.cat([-sin[..., :16], sin[..., 16:]], -1)  # (rope_cos_sin signs the sine's first half)
    low = x * cos.to(torch.bfloat16) + rotated * plain_sin.to(torch.bfloat16)
    full = (x.float() * cos + rotated.float() * plain_sin).to(torch.bfloat16)
    assert not torch.equal(low, full)  # the two roundings differ here
    assert torch.equal(apply_rope(x, cos, sin, full_precision=False), low)
    assert torch.equal(apply_rope(x, cos, sin, full_precision=True), full)


# ------------------------------------------------------------------------------ the official math, written out
def _official_logits(model, ids: torch.Tensor, theta: float | None = None) -> torch.Tensor:
    """The official forward (no cache, no mask, positions 0..L-1) written out from the official modeling
    code, on our model's parameters: embedding (LLaDA: times sqrt(d_model) with ``input_emb_norm``), pre-norm
    blocks of RoPE attention (``x * cos + rotate_half(x) * sin``, theta from the config, KV heads repeated
    in place), SwiGLU (silu of ``ff_proj`` / ``gate_proj`` times ``up_proj``), final norm, head (LLaDA: the
    embedding when ``weight_tying``, times 1/sqrt(d_model) with ``scale_logits``). Without the official code
    (tests/test_official_parity.py skips) this is what pins each line of the families' forwards. ``theta``: another
    RoPE base than the config's."""
    cfg, dream = model.config, model.logit_shift == 1
    theta = cfg.rope_theta if theta is None else theta

    def norm(x, module):
        return module.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps))

    def attention(x, q_proj, k_proj, v_proj, o_proj, heads, kv_heads):
        B, L, _ = x.shape
        q, k, v = (p(x).view(B, L, -1, cfg.head_dim_).transpose(1, 2) for p in (q_proj, k_proj, v_proj))
        dim = cfg.head_dim_
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.arange(L).float()[:, None] * inv_freq
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

        def rotate_half(t):
            return torch.cat([-t[..., dim // 2 :], t[..., : dim // 2]], -1)

        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) / dim**0.5
        return o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, -1))

    if dream:
        x = model.model.embed_tokens(ids)
        for layer in model.model.layers:
            a = layer.self_attn
            x = x + attention(norm(x, layer.input_layernorm), a.q_proj, a.k_proj, a.v_proj,
                              a.o_proj, cfg.num_attention_heads, cfg.num_key_value_heads)  # fmt: skip
            h = norm(x, layer.post_attention_layernorm)
            x = x + layer.mlp.down_proj(torch.nn.functional.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
        return model.lm_head(norm(x, model.model.norm))
    t = model.model.transformer
    x = t.wte(ids) * (cfg.d_model**0.5 if cfg.input_emb_norm else 1.0)
    for block in t.blocks:
        x = x + attention(norm(x, block.attn_norm), block.q_proj, block.k_proj, block.v_proj, block.attn_out,
                          cfg.n_heads, cfg.effective_n_kv_heads)  # fmt: skip
        h = norm(x, block.ff_norm)
        x = x + block.ff_out(torch.nn.functional.silu(block.ff_proj(h)) * block.up_proj(h))
    x = norm(x, t.ln_f)
    logits = x @ t.wte.weight.T if cfg.weight_tying else t.ff_out(x)
    return logits / cfg.d_model**0.5 if cfg.scale_logits else logits


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("llada", {}),
        ("llada", {"n_kv_heads": 2, "include_bias": True, "input_emb_norm": True, "scale_logits": True}),
        ("llada", {"weight_tying": True, "rope_theta": 500000.0}),
        ("dream", {}),
        ("dream", {"num_key_value_heads": 1, "rope_theta": 1000000.0}),
    ],
)
@torch.no_grad()
def test_logits_equal_the_official_math_written_out(family: str, options: dict) -> None:
    """Every option the forwards compute, against :func:`_official_logits`: ``input_emb_norm`` scaled the
    embeddings and ``scale_logits`` the logits with nothing to catch a wrong factor (the trained checkpoints use
    neither, and the window/full tests compare the model with itself)."""
    model = make(family, **options)
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from their 1 / 0 initialisation
            p.add_(torch.randn_like(p) * 0.05)
    ids = canvas(2, 12, seed=3)
    expected = _official_logits(model, ids)
    torch.testing.assert_close(model(ids).logits, expected, atol=ATOL, rtol=0)
    assert (_official_logits(model, ids, theta=77.0) - expected).abs().max() > 100 * ATOL  # it sees a wrong RoPE base


def test_config_fields_read_as_the_official_formats() -> None:
    """The fields the official configs leave to defaults, and the sizes they give the modules: the end-of-turn
    token of each official vocabulary, LLaDA's ``n_kv_heads: null`` (``multi_query_attention`` decides),
    Dream's ``num_key_value_heads: null`` (every head its own), LLaDA's MLP width (``mlp_hidden_size``, else
    ``mlp_ratio * d_model``) and its tables of ``embedding_size`` rows (padded past ``vocab_size``)."""
    assert hb.LLaDAConfig().eot_token_id == 126348 and hb.LLaDAConfig(vocab_size=1000).eot_token_id is None
    assert DreamConfig().eot_token_id == 151645 and DreamConfig(vocab_size=1000).eot_token_id is None
    for mqa, kv_heads in ((True, 1), (False, 4), (None, 4)):
        block = make_tiny_llada(n_kv_heads=None, multi_query_attention=mqa).model.transformer.blocks[0]
        assert block.k_proj.out_features == block.v_proj.out_features == kv_heads * 16, mqa
    assert DreamConfig(num_attention_heads=6, num_key_value_heads=None).num_key_value_heads == 6
    assert make_tiny_llada().model.transformer.blocks[0].ff_proj.out_features == 128  # mlp_hidden_size
    assert make_tiny_llada(mlp_hidden_size=None, mlp_ratio=3).model.transformer.blocks[0].up_proj.out_features == 192
    padded = make_tiny_llada(embedding_size=VOCAB + 32)
    assert padded.get_input_embeddings().num_embeddings == VOCAB + 32
    assert padded(canvas(1, 4)).logits.shape == (1, 4, VOCAB + 32)


@pytest.mark.parametrize(("family", "options", "full_precision"),
                         [("llada", {}, True), ("llada", {"rope_full_precision": False}, False), ("dream", {}, False)])  # fmt: skip
@torch.no_grad()
def test_rope_rounds_where_each_config_says(family: str, options: dict, full_precision: bool, monkeypatch) -> None:
    """Which rounding each forward's RoPE takes (test_rope_rounds_in_the_activation_dtype_unless_the_config_says_float32
    checks the two roundings): LLaDA's ``rope_full_precision``, Dream always in the activation dtype."""
    from hf_blockbatch.models import layers

    seen, rope = [], layers.apply_rope

    def recorded(x, cos, sin, full_precision):
        seen.append(full_precision)
        return rope(x, cos, sin, full_precision)

    monkeypatch.setattr(layers, "apply_rope", recorded)
    model = make(family, **options)
    model(canvas(1, 6))
    model.forward_windows(canvas(1, 6), [2], [5], model(canvas(1, 6), use_cache=True).cache)
    assert seen and set(seen) == {full_precision}


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_a_new_rope_theta_takes_effect_after_a_forward(family: str) -> None:
    """The RoPE table is kept between forwards: a changed ``config.rope_theta`` (as the official-parity test's
    sensitivity check sets it) must rebuild it, not rotate by the old base."""
    used = make(family)
    ids = canvas(1, 10)
    before = used(ids).logits
    used.config.rope_theta = 77.0
    after = used(ids).logits
    assert not torch.allclose(before, after)
    assert torch.equal(after, make(family, rope_theta=77.0)(ids).logits)


def test_the_backend_is_chosen_again_for_a_new_dtype(monkeypatch) -> None:
    """``model.to(dtype)`` after a forward: the backend must be the one chosen for the new dtype (flash-attn runs
    in 16-bit only, so a float32 model cast to bfloat16 gets it, and one cast back to float32 must not keep it)."""
    from hf_blockbatch.models import base

    asked, get = [], base.get_backend
    monkeypatch.setattr(base, "get_backend", lambda name, device, dtype: asked.append(dtype) or get(name, device, dtype))
    model = make_tiny_llada()
    model(canvas(1, 4))
    model.to(torch.float64)(canvas(1, 4))
    assert asked == [torch.float32, torch.float64]


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_a_canvas_of_exactly_the_context_length_is_served(family: str) -> None:
    """The context is a limit the canvas may reach: ``max_sequence_length`` / ``max_position_embeddings``
    positions are served (a cache of them too), one more is refused."""
    context = {"max_sequence_length": 12} if family == "llada" else {"max_position_embeddings": 12}
    model = make(family, **context)
    ids = canvas(1, 12)
    cache = model.new_cache(1, 12)
    assert model(ids, cache=cache).logits.shape == (1, 12, VOCAB)
    assert model.forward_windows(ids, [4], [12], cache).logits.shape == (8, VOCAB)
    with pytest.raises(ValueError, match="the model's context is 12"):
        model(canvas(1, 13))
    with pytest.raises(ValueError, match="exceeds the model's context of 12"):
        model.new_cache(1, 13)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize(("refresh", "got"), [(torch.zeros(2, 4), "torch.float32 (2, 4)"),
                                             (torch.zeros(2, 4, dtype=torch.long), "torch.int64 (2, 4)"),
                                             (torch.zeros(1, 4, dtype=torch.bool), "torch.bool (1, 4)")])  # fmt: skip
def test_forward_positions_refuses_a_refresh_mask_that_is_not_predicts_bool_shape(family: str, refresh, got: str) -> None:
    """A float refresh mask failed in torch's bitwise_or (NotImplementedError); an integer one was refused as
    "query_mask must be a bool", a name the caller never passed; a [1, L] one was broadcast over every row."""
    model, ids = make(family), torch.tensor([[5, 6, 7, 8]] * 2)
    cache = model(ids, cache=model.new_cache(2, 4)).cache
    predict = torch.zeros(2, 4, dtype=torch.bool)
    predict[:, 3] = True
    with pytest.raises(ValueError) as err:
        model.forward_positions(ids, predict, refresh, cache)
    assert str(err.value) == f"refresh must be None or a bool of predict's shape (2, 4), got {got}."


# ------------------------------------------------------------------------------ dropout
#: each dropout option of the official configs, on its family (the official codes apply them in training mode only)
DROPOUT_CASES = [("llada", "embedding_dropout"), ("llada", "attention_dropout"), ("llada", "residual_dropout"),
                 ("dream", "attention_dropout")]  # fmt: skip
CPU_BACKENDS = available_backends(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("family", "field"), DROPOUT_CASES)
def test_each_dropout_acts_in_training_mode_and_repeats_under_a_seed(family: str, field: str, backend: str) -> None:
    """The configs took the dropouts, and the models applied none of them: training (``hf-blockbatch sft`` or one's
    own loop) ran without dropout, in silence. In training mode each one now changes the logits, differently under
    another seed, identically under the same one; in eval mode it is off (logits of p = 0.3 equal those of p = 0)."""
    model, plain = make(family, **{field: 0.3}), make(family)
    model.set_attention_backend(backend)
    plain.set_attention_backend(backend)
    ids = canvas(2, 16)
    with torch.no_grad():
        inference = model(ids).logits
        assert torch.equal(inference, plain(ids).logits)
    model.train()
    torch.manual_seed(1)
    first = model(ids).logits
    torch.manual_seed(1)
    again = model(ids).logits
    torch.manual_seed(2)
    other = model(ids).logits
    assert torch.equal(first, again)
    assert (first - other).abs().max() > 1e-2
    assert (first - inference).abs().max() > 1e-2
    first.sum().backward()  # a training step's gradient flows through each dropout
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_training_mode_without_dropout_computes_what_eval_mode_does(family: str) -> None:
    model = make(family)
    ids = canvas(2, 16)
    with torch.no_grad():
        inference = model(ids).logits
        assert torch.equal(model.train()(ids).logits, inference)


@pytest.mark.parametrize("family", FAMILIES)
def test_dropout_settings_save_and_load_back(family: str, tmp_path) -> None:
    fields = {f: p for (fam, f), p in zip(DROPOUT_CASES, (0.1, 0.2, 0.3, 0.4)) if fam == family}
    model = make(family, **fields)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert {f: getattr(loaded.config, f) for f in fields} == fields
    ids = canvas(2, 16)
    model.train()
    loaded.train()
    torch.manual_seed(3)
    want = model(ids).logits
    torch.manual_seed(3)
    assert torch.equal(loaded(ids).logits, want)
    with torch.no_grad():
        assert (want - loaded.eval()(ids).logits).abs().max() > 1e-2  # the loaded one drops out too


@pytest.mark.parametrize(("family", "field"), [("dream", "residual_dropout"), ("dream", "embedding_dropout"),
                                               ("llada", "attn_dropout"), ("dream", "resid_pdrop")])  # fmt: skip
def test_a_dropout_the_family_has_not_is_kept_unused_with_a_warning_once(family: str, field: str, monkeypatch,
                                                                         caplog, tmp_path) -> None:  # fmt: skip
    """``DreamConfig(residual_dropout=0.1)`` (LLaDA's name on Dream) or a typo (``attn_dropout``) was kept, as
    transformers keeps every unknown key, and applied by nothing: training ran without the dropout the user set, in
    silence. It is still kept (a checkpoint with extra keys must load), and a warning names it and the family's own
    dropout fields, once per process; 0.0 (nothing asked for) and the family's own fields are not warned of."""
    from hf_blockbatch.models import base

    monkeypatch.setattr(base, "_warned_dropouts", set())
    caplog.set_level("WARNING", logger=base.__name__)
    model = make(family, **{field: 0.1})
    own = ", ".join(type(model.config).dropout_fields)
    assert [r.getMessage() for r in caplog.records] == [
        f"{type(model.config).__name__} has no {field} (0.1 given): it is kept in the config, unused, and no dropout "
        f"applies it. This family's dropout fields: {own}."
    ]
    assert getattr(model.config, field) == 0.1
    ids = canvas(2, 16)
    with torch.no_grad():
        assert torch.equal(model.train()(ids).logits, model.eval()(ids).logits)  # no dropout acts: hence the warning
    model.save_pretrained(tmp_path)
    caplog.clear()
    assert getattr(type(model).from_pretrained(tmp_path).config, field) == 0.1  # loads, kept; warned once only
    make(family, **{field: 0.0}, **dict.fromkeys(type(model.config).dropout_fields, 0.1))
    assert not caplog.records
    monkeypatch.setattr(base, "_warned_dropouts", set())
    type(model).from_pretrained(tmp_path)  # a config.json with the key warns on loading
    assert len(caplog.records) == 1 and field in caplog.records[0].getMessage()


@pytest.mark.parametrize(("family", "field"), DROPOUT_CASES)
@pytest.mark.parametrize("value", [1.0, 1.5, -0.1, float("nan"), "0.1"])
def test_a_dropout_that_is_no_probability_is_refused(family: str, field: str, value) -> None:
    """Refused when the model is built (it failed inside torch's dropout at the first training forward, or at 1
    dropped everything), and when a config changed since then reaches a training forward."""
    with pytest.raises(ValueError, match=rf"^{field} must be (a dropout probability in \[0, 1\)|a number|a finite)"):
        make(family, **{field: value})
    model = make(family)
    setattr(model.config, field, value)
    with torch.no_grad():
        model(canvas(1, 8))  # eval mode reads no dropout
        with pytest.raises(ValueError, match=rf"^config\.{field} must be"):
            model.train()(canvas(1, 8))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_window_forward_in_training_mode_with_attention_dropout_is_refused(family: str) -> None:
    """The window forwards (cached decoding) take no attention dropout (their varlen kernels have none): in training
    mode with attention dropout on, a cached decode is refused with what to do, rather than decoding without it."""
    model = make(family, attention_dropout=0.1)
    ids = canvas(2, 16)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
        model.forward_windows(ids, [8, 8], [12, 12], cache)  # eval mode: served
        model.train()
        message = r"^This model is in training mode with config.attention_dropout=0.1.*call model.eval\(\) before decoding"
        with pytest.raises(ValueError, match=message):
            model.forward_windows(ids, [8, 8], [12, 12], cache)
        predict = torch.zeros(2, 16, dtype=torch.bool)
        predict[:, 9] = True
        with pytest.raises(ValueError, match=message):
            model.forward_positions(ids, predict, None, cache)
        with pytest.raises(ValueError, match=message):
            model.generate(ids[:, :8], generation_config=hb.FastDLLMConfig(max_new_tokens=8, block_length=8))
