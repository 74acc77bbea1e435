"""Attention backends and window metadata, checked against explicit float32 attention."""

from __future__ import annotations

import pytest
import torch

import hf_blockbatch as hb
from hf_blockbatch.attention import BACKENDS, available_backends, build_window_batch, get_backend, metadata

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CASES = [(d, b) for d in DEVICES for b in available_backends(torch.device(d), torch.float32)]
IDS = [f"{d}-{b}" for d, b in CASES]
R, L, HQ, HKV, D = 4, 12, 4, 2, 8


def brute_force_window(q, k_cache, v_cache, rows, starts, lengths, key_mask, scale) -> torch.Tensor:
    """Per row, per query: softmax over the row's valid keys, in float64, no batching tricks."""
    out, t = torch.empty_like(q), 0
    groups = q.shape[1] // k_cache.shape[2]
    for r, n in zip(rows.tolist(), lengths.tolist()):
        k = k_cache[r].double().repeat_interleave(groups, dim=1)  # [L, H, D]
        v = v_cache[r].double().repeat_interleave(groups, dim=1)
        valid = key_mask[r]
        for _ in range(n):
            scores = torch.einsum("hd,lhd->hl", q[t].double(), k[valid]) * scale
            out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[valid]).to(q.dtype)
            t += 1
    return out


def setup(device: str, pads: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(R, L, dtype=torch.long)
    for r, p in enumerate(pads):
        mask[r, :p] = 0
    cache = hb.BranchCache(1, R, L, HKV, D, device=device, attention_mask=mask.to(device))
    cache.layers[0].keys.copy_(torch.randn(R, L, HKV, D, generator=g) * 2)
    cache.layers[0].values.copy_(torch.randn(R, L, HKV, D, generator=g))
    return cache, g


@pytest.mark.parametrize(("device", "backend"), CASES, ids=IDS)
@pytest.mark.parametrize("pads", [[0, 0, 0, 0], [0, 3, 1, 5]], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize(
    ("rows", "starts", "ends"),
    [
        (None, [0, 5, 11, 2], [12, 9, 12, 3]),  # whole canvas, block, last position, one token
        ([1, 3], [4, 6], [8, 12]),  # a subset of rows
        ([2], [7], [8]),
        ([0, 1, 3], [4, 4, 2], [8, 8, 6]),  # equal lengths on unevenly spaced rows: a gathered group
        ([0, 2], [3, 5], [7, 9]),  # equal lengths on evenly spaced rows: a strided view of the cache
    ],
    ids=["all-rows", "subset", "single", "uneven-group", "strided-group"],
)
def test_window_backend_matches_brute_force(device, backend, pads, rows, starts, ends) -> None:
    cache, g = setup(device, pads)
    wb = build_window_batch(cache, torch.tensor(starts), torch.tensor(ends), None if rows is None else torch.tensor(rows))
    q = (torch.randn(wb.num_tokens, HQ, D, generator=g) * 2).to(device)
    scale = D**-0.5
    got = get_backend(backend, device, torch.float32).window(
        q, cache.layers[0].keys, cache.layers[0].values, wb, scale
    )
    ref = brute_force_window(
        q, cache.layers[0].keys, cache.layers[0].values, wb.rows, wb.starts, wb.lengths, cache.key_mask, scale
    )
    assert got.shape == (wb.num_tokens, HQ, D)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("device", "backend"), CASES, ids=IDS)
@pytest.mark.parametrize("padded", [False, True])
def test_dense_backend_matches_brute_force(device, backend, padded) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(R, L, HQ, D, generator=g).to(device)
    k = torch.randn(R, L, HKV, D, generator=g).to(device)
    v = torch.randn(R, L, HKV, D, generator=g).to(device)
    key_mask = None
    if padded:
        key_mask = torch.ones(R, L, dtype=torch.bool, device=device)
        key_mask[1, :4] = False
        key_mask[3, :1] = False
    got = get_backend(backend, device, torch.float32).dense(q, k, v, key_mask, D**-0.5)
    mask = key_mask if key_mask is not None else torch.ones(R, L, dtype=torch.bool, device=device)
    rows, starts, lengths = torch.arange(R), torch.zeros(R, dtype=torch.long), torch.full((R,), L)
    ref = brute_force_window(q.reshape(R * L, HQ, D), k, v, rows, starts, lengths, mask, D**-0.5)
    # padded queries are computed too (their outputs are never used, but must not be NaN)
    torch.testing.assert_close(got.reshape(R * L, HQ, D), ref, atol=1e-5, rtol=0)


def test_window_batch_metadata() -> None:
    cache = hb.BranchCache(1, 3, 6, 1, 2, attention_mask=torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [1] * 6]))
    wb = build_window_batch(cache, torch.tensor([1, 4]), torch.tensor([4, 5]), torch.tensor([0, 1]))
    assert wb.rows.tolist() == [0, 1] and not wb.all_rows
    assert wb.token_rows.tolist() == [0, 0, 0, 1]
    assert wb.token_pos.tolist() == [1, 2, 3, 4]
    assert wb.flat_slots.tolist() == [1, 2, 3, 6 + 4]
    assert wb.rope_pos.tolist() == [1, 2, 3, 2]  # row 1 has 2 padding slots: position 4 is its 3rd token
    assert wb.cu_seqlens.tolist() == [0, 3, 4] and wb.cu_seqlens.dtype == torch.int32
    assert wb.max_len == 3
    assert wb.pad_valid.tolist() == [[True, True, True], [True, False, False]]
    assert wb.pad_index[wb.pad_valid].tolist() == [0, 1, 2, 3]
    assert wb.key_mask.tolist() == [[True] * 6, [False, False] + [True] * 4]
    assert wb.row_valid.tolist() == [6, 4, 6]
    wb.ensure_segments()  # two key segments per cache row: padding (no queries), then tokens
    assert wb.seg_cu_k.tolist() == [0, 0, 6, 8, 12, 12, 18]
    assert wb.seg_cu_q.tolist() == [0, 0, 3, 3, 4, 4, 4]
    # all rows, in order, given explicitly: recognised as all rows
    assert build_window_batch(cache, torch.tensor([0, 0, 0]), torch.tensor([1, 1, 1]), torch.arange(3)).all_rows
    # no padding anywhere: no mask to apply
    assert build_window_batch(hb.BranchCache(1, 2, 4, 1, 2), torch.tensor([0, 1]), torch.tensor([2, 4])).key_mask is None


@pytest.mark.parametrize("pads", [[0, 0, 0, 0], [0, 3, 1, 5]], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize(
    ("call_cost", "groups"),
    [
        (0.0, [(6, 1, False), (5, 1, False), (2, 1, False), (1, 1, False)]),  # one call per query count
        (1.5, [(6, 2, True), (2, 2, True)]),  # a call is worth 1.5 padded slots: 6+5 and 2+1
        (None, [(6, 4, True)]),  # the shipped cost at this tiny width: one padded call
    ],
    ids=["exact", "two-padded", "shipped"],
)
def test_grouped_backend_pads_rows_only_where_a_call_costs_more(monkeypatch, pads, call_cost, groups) -> None:
    """``sdpa_grouped`` merges query counts while the padding costs less than an attention call
    (``GROUP_CALL_COST``, in padded slot x key x head-dimension units); a padded group writes back
    its real queries only, and every grouping attends as the brute force does."""
    if call_cost is not None:  # in padded slots: this test's slot over L keys, HQ heads of D is L * HQ * D units
        monkeypatch.setattr(metadata, "GROUP_CALL_COST", call_cost * L * HQ * D)
    cache, g = setup("cpu", pads)
    wb = build_window_batch(cache, torch.tensor([0, 4, 10, 11]), torch.tensor([6, 9, 12, 12]))  # counts 6, 5, 2, 1
    q = torch.randn(wb.num_tokens, HQ, D, generator=g) * 2
    got = get_backend("sdpa_grouped", "cpu", torch.float32).window(q, cache.layers[0].keys, cache.layers[0].values,
                                                                     wb, D**-0.5)  # fmt: skip
    assert [(grp.width, grp.count, grp.real is not None) for grp in wb.length_groups(HQ * D)] == groups
    ref = brute_force_window(q, cache.layers[0].keys, cache.layers[0].values, wb.rows, wb.starts, wb.lengths,
                             cache.key_mask, D**-0.5)  # fmt: skip
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", available_backends(torch.device("cpu"), torch.float32))
def test_random_window_and_query_batches_match_brute_force(monkeypatch, backend) -> None:
    """Random caches (1-9 rows, 1-20 positions, left padding, grouped-query heads), random row subsets and random
    windows or query sets (a sparse step's layout), and for ``sdpa_grouped`` a random call cost, so its groups come
    exact, merged and padded, gathered or strided: every backend attends as the brute force does."""
    import random

    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    shipped = metadata.GROUP_CALL_COST
    for _ in range(200):
        rows, length = rng.randint(1, 9), rng.randint(1, 20)
        kv_heads = rng.choice([1, 2])
        heads, dim = kv_heads * rng.choice([1, 2]), rng.choice([4, 8])
        mask = torch.ones(rows, length, dtype=torch.long)
        for r in range(rows):
            mask[r, : rng.randrange(length)] = 0
        cache = hb.BranchCache(1, rows, length, kv_heads, dim, attention_mask=mask)
        cache.layers[0].keys.copy_(torch.randn(rows, length, kv_heads, dim, generator=gen) * 2)
        cache.layers[0].values.copy_(torch.randn(rows, length, kv_heads, dim, generator=gen))
        active = torch.tensor(sorted(rng.sample(range(rows), rng.randint(1, rows))))
        if rng.random() < 0.5:
            starts = torch.tensor([rng.randrange(length) for _ in active])
            ends = torch.tensor([rng.randint(int(s) + 1, length) for s in starts])
            wb = build_window_batch(cache, starts, ends, active)
        else:
            queries = torch.rand(len(active), length, generator=gen) < rng.random()
            queries[torch.arange(len(active)), torch.randint(length, (len(active),), generator=gen)] = True
            wb = metadata.build_query_batch(cache, queries, active)
        # a call worth 0, 1, 3 or 8 padded slots (in slot x key x head-dimension units), the shipped cost, or any padding
        slots = rng.choice([0, 1, 3, 8, None, float("inf")])
        cost = shipped if slots is None else slots * length * heads * dim
        monkeypatch.setattr(metadata, "GROUP_CALL_COST", cost)
        q = torch.randn(wb.num_tokens, heads, dim, generator=gen) * 2
        got = get_backend(backend, "cpu", torch.float32).window(q, cache.layers[0].keys, cache.layers[0].values, wb,
                                                                dim**-0.5)  # fmt: skip
        ref = brute_force_window(q, cache.layers[0].keys, cache.layers[0].values, wb.rows, wb.starts, wb.lengths,
                                 cache.key_mask, dim**-0.5)  # fmt: skip
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_grouped_backend_keeps_a_call_per_query_count_at_a_realistic_width() -> None:
    """At an 8B model's width (32 heads of 128) over 600 keys one padded slot costs more than a call:
    the groups are the exact query counts, as before padding was considered. At the tiny models'
    width (4 heads of 32) a call is worth 5.2 padded slots over 600 keys: 11 and 8 pad to 12 (1 and 4
    slots), while 12 would take 9 to reach 21 and 4 would take 8, so each of those keeps its own call."""
    cache = hb.BranchCache(1, 6, 600, 1, 2)
    wb = build_window_batch(cache, torch.tensor([500] * 6), torch.tensor([521, 512, 511, 508, 521, 504]))
    assert sorted(grp.width for grp in wb.length_groups(32 * 128)) == [4, 8, 11, 12, 21]
    assert all(grp.real is None for grp in wb.length_groups(32 * 128))
    assert [(grp.width, grp.count) for grp in wb.length_groups(4 * 32)] == [(21, 2), (12, 3), (4, 1)]


def strict_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, scale=None, causal=False, enable_gqa=False):
    """A CPU stand-in for a CUDA varlen kernel that enforces its documented input rules (int32
    contiguous ``cu_seqlens``, Python-int maxima that bound every segment, packed ``[T, H, D]``
    inputs) and flash-attn's reshape of grouped queries when the longest query segment is 1."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.is_contiguous() and cu_k.is_contiguous()
    assert type(max_q) is int and type(max_k) is int and not causal
    segments, heads, kv_heads = cu_q.numel() - 1, q.shape[1], k.shape[1]
    assert q.shape[0] == int(cu_q[-1]) and k.shape[0] >= int(cu_k[-1])
    if max_q == 1 and heads > kv_heads:  # one query per segment is assumed on this path
        q.reshape(segments, kv_heads, heads // kv_heads, q.shape[-1])
    scale = softmax_scale if softmax_scale is not None else scale if scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    for i in range(segments):
        qs, qe, ks, ke = (int(x) for x in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
        assert qe - qs <= max_q and ke - ks <= max_k
        if qe > qs:
            kk, vv = (t[ks:ke].double().repeat_interleave(heads // kv_heads, 1) for t in (k, v))
            probs = (torch.einsum("qhd,khd->hqk", q[qs:qe].double(), kk) * scale).softmax(-1)
            out[qs:qe] = torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)
    return out


def torch_29_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """PyTorch 2.9's ``varlen_attn`` signature: no ``scale``, no ``enable_gqa``."""
    return strict_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal)


@pytest.mark.parametrize("kernel", ["flash_varlen", "torch_varlen", "torch_varlen_2.9"])
@pytest.mark.parametrize("pads", [[0, 0, 0, 0], [0, 3, 1, 5]], ids=["unpadded", "left-padded"])
def test_varlen_backends_call_the_kernel_by_its_rules(monkeypatch, kernel, pads) -> None:
    """The CUDA backends' calls, on CPU through a strict stand-in: every window layout (one-token
    windows with grouped-query heads included) matches brute force; a kernel without ``scale`` is
    called without it, and refuses a scale it cannot apply."""
    cls = BACKENDS[kernel.removesuffix("_2.9")]
    monkeypatch.setattr(cls, "_fn", torch_29_varlen if kernel.endswith("2.9") else strict_varlen)
    if cls.name == "torch_varlen":
        monkeypatch.setattr(cls, "_gqa", not kernel.endswith("2.9"), raising=False)
        monkeypatch.setattr(cls, "_scale", not kernel.endswith("2.9"), raising=False)
    cache, g = setup("cpu", pads)
    k_cache, v_cache = cache.layers[0].keys, cache.layers[0].values
    for rows, starts, ends in [(None, [0, 5, 11, 2], [12, 9, 12, 3]), ([1, 3], [4, 6], [8, 12]), ([2], [7], [8]),
                               (None, [3, 11, 11, 6], [4, 12, 12, 7])]:  # fmt: skip
        rows = None if rows is None else torch.tensor(rows)
        wb = build_window_batch(cache, torch.tensor(starts), torch.tensor(ends), rows)
        q = torch.randn(wb.num_tokens, HQ, D, generator=g) * 2
        want = brute_force_window(q, k_cache, v_cache, wb.rows, wb.starts, wb.lengths, cache.key_mask, D**-0.5)
        torch.testing.assert_close(cls().window(q, k_cache, v_cache, wb, D**-0.5), want, atol=1e-5, rtol=1e-5)
    if kernel.endswith("2.9"):
        with pytest.raises(ValueError, match="no `scale` argument"):
            cls().window(q, k_cache, v_cache, wb, 0.5)


def test_window_batch_errors() -> None:
    cache = hb.BranchCache(1, 3, 6, 1, 2)
    t = torch.tensor
    with pytest.raises(ValueError, match=r"0 <= start < end <= 6"):
        build_window_batch(cache, t([0, 1, 2]), t([1, 2, 7]))
    with pytest.raises(ValueError, match=r"0 <= start < end <= 6"):
        build_window_batch(cache, t([0, 2, 2]), t([1, 2, 3]))
    with pytest.raises(ValueError, match="one \\[start, end\\) window per row"):
        build_window_batch(cache, t([0, 1]), t([1, 2, 3]))
    with pytest.raises(ValueError, match="strictly increasing"):
        build_window_batch(cache, t([0, 1]), t([1, 2]), t([2, 0]))
    with pytest.raises(ValueError, match="at least one row"):
        build_window_batch(cache, t([], dtype=torch.long), t([], dtype=torch.long), t([], dtype=torch.long))


def test_backend_registry() -> None:
    assert set(BACKENDS) == {"flash_varlen", "torch_varlen", "sdpa_grouped", "sdpa", "reference"}
    cpu = available_backends("cpu", torch.float32)
    assert {"sdpa", "reference"} <= set(cpu) and "flash_varlen" not in cpu
    assert get_backend("auto", "cpu", torch.float32).name == "sdpa_grouped"
    assert get_backend("reference", "cpu", torch.bfloat16).name == "reference"
    with pytest.raises(ValueError, match=r"Unknown attention backend 'xformers'; choose one of \['auto'"):
        get_backend("xformers", "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"'flash_varlen' cannot run on cpu with torch.float32; available here"):
        get_backend("flash_varlen", "cpu", torch.float32)


def test_model_backend_follows_config_and_device() -> None:
    from conftest import make_tiny_llada

    model = make_tiny_llada(window_attention="reference")
    assert model.attention_backend.name == "reference"
    model.set_attention_backend("auto")
    assert model.config.window_attention == "auto"
    assert model.attention_backend.name == get_backend("auto", "cpu", torch.float32).name
    model.to(torch.bfloat16)  # re-chosen for the new dtype, not cached from before
    assert model.attention_backend.name == get_backend("auto", "cpu", torch.bfloat16).name


def test_a_backend_name_that_is_not_a_string_is_refused_and_leaves_the_backend() -> None:
    """``set_attention_backend(["sdpa"])`` raised TypeError ("unhashable type: 'list'"), which the restore of the
    old name did not catch: the list stayed in the config and every later forward failed on it."""
    from conftest import make_tiny_llada

    model = make_tiny_llada(window_attention="reference")
    with pytest.raises(ValueError, match=r"Unknown attention backend \['sdpa'\]; choose one of \['auto'"):
        model.set_attention_backend(["sdpa"])
    assert model.config.window_attention == "reference" and model.attention_backend.name == "reference"


def test_attn_implementation_flash_attention_2_asks_for_flash_varlen() -> None:
    """transformers' spelling, ``attn_implementation="flash_attention_2"``, selects ``flash_varlen`` while
    ``window_attention`` is ``auto``; where it cannot run that is said, not replaced in silence by
    another backend. A backend named with ``set_attention_backend`` wins."""
    import importlib.util

    from conftest import make_tiny_llada

    if importlib.util.find_spec("flash_attn") is None:  # transformers refuses it at load time, clearly
        with pytest.raises(ImportError, match="FlashAttention2"):
            hb.load_model("tiny-llada", attn_implementation="flash_attention_2")
    model = make_tiny_llada()
    model.config._attn_implementation = "flash_attention_2"  # what from_pretrained sets when flash-attn is there
    with pytest.raises(ValueError, match=r"'flash_varlen' cannot run on cpu with torch.float32"):
        model.generate(torch.tensor([[1, 2, 3]]), generation_config=hb.FastDLLMConfig(max_new_tokens=8, block_length=4))
    model.set_attention_backend("sdpa")
    assert model.attention_backend.name == "sdpa"
    model.generate(torch.tensor([[1, 2, 3]]), generation_config=hb.FastDLLMConfig(max_new_tokens=8, block_length=4))


def test_a_varlen_kernel_that_cannot_be_imported_is_unavailable_and_a_bad_device_is_named(monkeypatch):
    """A CUDA kernel whose package is missing (flash-attn not installed, a torch without varlen) makes its backend
    unavailable rather than failing at the first forward; an unknown device name is refused in one line."""
    from hf_blockbatch.attention import backends

    class Missing(backends._VarlenBackend):
        _fn = None

        @classmethod
        def _import(cls):
            raise ImportError("no such kernel")

    assert Missing._load() is None and not Missing.is_available(torch.device("cuda"), torch.float16)
    assert repr(backends.get_backend("reference", "cpu", torch.float32)) == "ReferenceBackend()"
    with pytest.raises(ValueError) as err:
        backends.get_backend("sdpa", "gpu", torch.float32)
    assert str(err.value) == "device='gpu' is not a device PyTorch knows: use cpu or cuda (cuda:0, ...)."
