"""BranchCache: geometry, masks, and row operations that must be exact (bitwise)."""

from __future__ import annotations

import pytest
import torch
from _generation_helpers import peaked, spy_caches
from conftest import VOCAB, make_tiny_dream, make_tiny_llada

import hf_blockbatch as hb

R, L, H, D, LAYERS = 5, 10, 2, 4, 3


def random_cache(mask: torch.Tensor | None = None, dtype: torch.dtype = torch.float32, rows: int = R) -> hb.BranchCache:
    cache = hb.BranchCache(LAYERS, rows, L, H, D, dtype=dtype, attention_mask=mask, model_type="llada")
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.keys.copy_(torch.randn(layer.keys.shape, generator=g))
        layer.values.copy_(torch.randn(layer.values.shape, generator=g))
    return cache


def left_padded_mask(pads: list[int]) -> torch.Tensor:
    mask = torch.ones(len(pads), L, dtype=torch.long)
    for r, p in enumerate(pads):
        mask[r, :p] = 0
    return mask


def state(cache: hb.BranchCache) -> dict[str, torch.Tensor]:
    out = {"mask": cache.key_mask.clone(), "pos": cache.position_ids.clone()}
    for i, layer in enumerate(cache.layers):
        out[f"k{i}"], out[f"v{i}"] = layer.keys.clone(), layer.values.clone()
    return out


def test_geometry_and_nbytes() -> None:
    cache = hb.BranchCache(LAYERS, R, L, H, D)
    assert (cache.num_rows, cache.length, cache.dtype) == (R, L, torch.float32)
    assert cache.layers[0].keys.shape == (R, L, H, D)
    assert cache.nbytes() == 2 * LAYERS * R * L * H * D * 4
    assert hb.BranchCache(LAYERS, R, L, H, D, dtype=torch.bfloat16).nbytes() == 2 * LAYERS * R * L * H * D * 2
    assert not cache.has_padding and cache.key_mask.all()
    assert torch.equal(cache.position_ids, torch.arange(L).expand(R, L))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_for_model_geometry(family: str) -> None:
    model = make_tiny_llada() if family == "llada" else make_tiny_dream()
    cache = model.new_cache(3, 12)
    geometry = model.config.kv_geometry()
    assert len(cache.layers) == geometry["num_layers"] == 2
    assert cache.layers[0].keys.shape == (3, 12, geometry["num_kv_heads"], geometry["head_dim"])
    assert cache.model_type == model.config.model_type
    assert cache.nbytes() == 2 * 2 * 3 * 12 * geometry["num_kv_heads"] * geometry["head_dim"] * 4


def test_left_padding_positions() -> None:
    cache = hb.BranchCache(1, 2, 6, 1, 2, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]))
    assert cache.has_padding
    assert cache.position_ids.tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]


def test_mask_validation() -> None:
    with pytest.raises(ValueError, match="left-padded.*padding_side='left'"):
        hb.BranchCache(1, 2, 4, 1, 2, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="left-padded"):
        hb.BranchCache(1, 1, 4, 1, 2, attention_mask=torch.tensor([[0, 1, 0, 1]]))
    with pytest.raises(ValueError, match="at least one real token"):
        hb.BranchCache(1, 2, 4, 1, 2, attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 3\) but the cache holds 2 rows of length 4"):
        hb.BranchCache(1, 2, 4, 1, 2, attention_mask=torch.ones(2, 3))
    cache = hb.BranchCache(1, 2, 4, 1, 2)
    with pytest.raises(ValueError, match="left-padded"):
        cache.set_attention_mask(torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))
    assert cache.key_mask.all()  # a refused mask leaves the old one


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dtype": "float16"}, "dtype must be a floating torch.dtype (torch.float32, torch.bfloat16, torch.float16, "
                               "torch.float64), got 'float16': pass e.g. torch.float16, or build the cache with "
                               "model.new_cache()."),
        ({"dtype": torch.int64}, "dtype must be a floating torch.dtype (torch.float32, torch.bfloat16, torch.float16, "
                                 "torch.float64), got torch.int64: pass e.g. torch.float16, or build the cache with "
                                 "model.new_cache()."),
        ({"device": "tpu"}, "device='tpu' is not a device PyTorch knows: use cpu, or cuda (cuda:0, ...)."),
        ({"device": "meta"}, "device='meta' holds no weights, so nothing could decode on it: use cpu, or cuda "
                             "(cuda:0, ...)."),
    ],
)
def test_a_dtype_or_device_the_cache_cannot_hold_is_refused_in_one_line(options, message) -> None:
    """A dtype's name, a non-floating dtype or an unknown device gave torch's error (``empty(): argument 'dtype'
    must be torch.dtype, not str``; a list of every device type torch knows; ``item()`` on a meta tensor), or built
    an int64 cache no forward can fill. transformers' caches take a torch.dtype, not a name: so does this one."""
    with pytest.raises(ValueError) as err:
        hb.BranchCache(1, 2, 4, 1, 2, **options)
    assert str(err.value) == message
    assert hb.BranchCache(1, 2, 4, 1, 2, dtype=torch.float16, device="cpu").dtype == torch.float16


def test_copy_rows_exact() -> None:
    cache = random_cache(left_padded_mask([0, 3, 0, 1, 0]))
    before = state(cache)
    src, dst = [1, 1, 3], [0, 2, 4]  # one source into two rows, another into a third
    cache.copy_rows(torch.tensor(src), torch.tensor(dst))
    after = state(cache)
    for name, old in before.items():
        for s, d in zip(src, dst):
            assert torch.equal(after[name][d], old[s]), (name, s, d)
        assert torch.equal(after[name][[1, 3]], old[[1, 3]]), name  # untouched rows
    assert cache.key_mask[[0, 2]].tolist() == [[False] * 3 + [True] * 7] * 2
    assert cache.position_ids[4].tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8]


def test_copy_positions_copies_only_those_positions() -> None:
    """``copy_positions``: each destination row takes its source's K/V of every layer at the positions
    its mask row names (one source into two rows included); nothing else changes."""
    cache = random_cache()
    before = state(cache)
    src, dst = torch.tensor([0, 0, 4]), torch.tensor([1, 2, 3])
    where = torch.zeros(3, L, dtype=torch.bool)
    where[0, [2, 3, 9]] = True
    where[1, 7:] = True  # row 2 takes 7..9; row 3 takes nothing
    cache.copy_positions(src, dst, where)
    after = state(cache)
    for i in range(LAYERS):
        for name in (f"k{i}", f"v{i}"):
            want = before[name].clone()
            for j, (s_, d_) in enumerate(zip(src.tolist(), dst.tolist())):
                want[d_, where[j]] = before[name][s_, where[j]]
            assert torch.equal(after[name], want), name
    assert torch.equal(after["mask"], before["mask"]) and torch.equal(after["pos"], before["pos"])


def test_copy_positions_with_nothing_to_take_writes_nothing_and_keeps_versions() -> None:
    """With nothing to take (a draft row's take-back in most batch-1 steps) ``copy_positions`` returns at once: the
    K/V and the rows' versions stay as they were, so a row that holds its source's copy still skips the next copy
    of it. A take of one position gives the destination a new version (its K/V are no longer the copy's)."""
    cache = random_cache()
    cache.copy_rows(torch.tensor([0]), torch.tensor([1]))
    versions, before = cache.row_version.clone(), state(cache)
    cache.copy_positions(torch.tensor([0, 4]), torch.tensor([1, 3]), torch.zeros(2, L, dtype=torch.bool))
    assert torch.equal(cache.row_version, versions)
    assert all(torch.equal(state(cache)[name], old) for name, old in before.items())
    where = torch.zeros(1, L, dtype=torch.bool)
    where[0, 2] = True
    cache.copy_positions(torch.tensor([2]), torch.tensor([1]), where)
    assert cache.row_version[1] != versions[1] and torch.equal(cache.row_version[[0, 2, 3, 4]], versions[[0, 2, 3, 4]])


def test_row_copies_after_dropping_rows() -> None:
    """After ``keep_rows`` drops the last rows (the storage becomes a prefix of its allocation), the
    copies across rows still move exactly the named rows and positions of the kept rows (they index
    the allocation, where a kept row sits at the same place)."""
    cache = random_cache(rows=6)
    cache.keep_rows(torch.tensor([0, 2, 3, 4]))  # ascending: moved down inside the same storage
    before = state(cache)
    where = torch.zeros(2, L, dtype=torch.bool)
    where[0, [1, 5]] = True
    where[1, 8:] = True
    cache.copy_positions(torch.tensor([3, 0]), torch.tensor([1, 2]), where)
    cache.copy_rows([0, 1], [1, 3])  # overlapping: the strided path, reading the old rows
    for name, old in before.items():
        want = old.clone()
        if name.startswith(("k", "v")):
            want[1, where[0]] = old[3, where[0]]
            want[2, where[1]] = old[0, where[1]]
        want[1], want[3] = old[0], want[1].clone()
        assert torch.equal(state(cache)[name], want), name


def test_copy_rows_overlapping_reads_old_rows() -> None:
    cache = random_cache()
    before = state(cache)
    cache.copy_rows([0, 1, 2], [1, 2, 3])  # a shift: each destination gets its source's *old* row
    for name, old in before.items():
        assert torch.equal(state(cache)[name][1:4], old[0:3]), name


def test_copy_rows_same_mask_copies_only_kv() -> None:
    cache = random_cache(left_padded_mask([0, 3, 0, 1, 0]))
    before = state(cache)
    mask = cache.key_mask.clone()
    cache.copy_rows([1], [0], same_mask=True)  # the caller's promise is false here: the mask stays
    assert torch.equal(state(cache)["k0"][0], before["k0"][1])
    assert torch.equal(cache.key_mask, mask)


def test_broadcast_rows_copies_each_groups_first_row() -> None:
    cache = random_cache(left_padded_mask([2, 2, 2, 0, 0, 0]), rows=6)
    before = state(cache)
    cache.broadcast_rows(3)
    for name, old in before.items():
        assert torch.equal(state(cache)[name], old[[0, 0, 0, 3, 3, 3]]), name


def test_copy_rows_errors() -> None:
    cache = random_cache()
    with pytest.raises(ValueError, match="src has 2 rows but dst has 1"):
        cache.copy_rows([0, 1], [2])
    before = state(cache)
    # a bool mask or floats were read as row numbers (True -> row 1, 0.9 -> row 0): a silent wrong copy
    with pytest.raises(TypeError, match="src must hold integer row numbers.*bool.*nonzero"):
        cache.copy_rows(torch.tensor([True, False]), torch.tensor([2, 3]))
    with pytest.raises(TypeError, match="dst must hold integer row numbers.*float"):
        cache.copy_rows([0], [0.9])
    with pytest.raises(TypeError, match="src must be row numbers"):
        cache.copy_rows(None, [1])
    with pytest.raises(ValueError, match="src must be a 1-d list of row numbers"):
        cache.copy_rows([[0, 1]], [[2, 3]])
    # rows out of range (an IndexError inside torch before; a device-side assert on a GPU) and repeated
    # destinations are refused before anything is written
    with pytest.raises(ValueError, match=r"dst holds rows \[9\] outside the cache's rows 0..4"):
        cache.copy_rows([0], [9])
    with pytest.raises(ValueError, match=r"src holds rows \[-1\]"):
        cache.copy_rows([-1], [0])
    with pytest.raises(ValueError, match="dst repeats a row"):
        cache.copy_rows([0, 1], [2, 2])
    for name, old in before.items():
        assert torch.equal(state(cache)[name], old), name
    cache.copy_rows(0, 1)  # single ints are one row each (torch.stack failed on them before)
    assert torch.equal(state(cache)["k0"][1], before["k0"][0])


def test_copy_positions_errors() -> None:
    """A ``where`` wider than the canvas addressed the next row's slots (flat ``row * L + position``): a silent write
    into another row. The shapes and dtypes are checked (free: no host sync on a step's hot path)."""
    cache = random_cache()
    before = state(cache)
    wide = torch.zeros(1, L + 5, dtype=torch.bool)
    wide[0, L + 2] = True
    with pytest.raises(ValueError, match=r"where must be a bool tensor of shape \[len\(src\), length\] = \[1, 10\]"):
        cache.copy_positions(torch.tensor([0]), torch.tensor([1]), wide)
    with pytest.raises(ValueError, match="where must be a bool tensor"):
        cache.copy_positions(torch.tensor([0]), torch.tensor([1]), torch.ones(1, L, dtype=torch.long))
    with pytest.raises(ValueError, match="src has 2 rows but dst has 1"):
        cache.copy_positions(torch.tensor([0, 2]), torch.tensor([1]), torch.ones(2, L, dtype=torch.bool))
    with pytest.raises(TypeError, match="dst must hold integer row numbers"):
        cache.copy_positions(torch.tensor([0]), torch.tensor([1.0]), torch.ones(1, L, dtype=torch.bool))
    for name, old in before.items():
        assert torch.equal(state(cache)[name], old), name
    where = torch.zeros(1, L, dtype=torch.bool)
    where[0, 3] = True
    cache.copy_positions([0], [1], where)  # lists of rows are row numbers too
    assert torch.equal(cache.layers[0].keys[1, 3], before["k0"][0, 3])


def test_copy_positions_refuses_rows_outside_the_cache() -> None:
    """Rows outside the cache failed inside torch with flat slot numbers (``index 93 is out of bounds``), and after
    ``keep_rows`` a row past the cache's last, still inside its allocation, was read (a dropped row's K/V) or written
    in silence. Each is refused naming the rows, and a refused read writes nothing."""
    cache = random_cache(rows=4)
    where = torch.zeros(1, L, dtype=torch.bool)
    where[0, 3] = True
    for src, dst, bad in (([0], [9], "dst holds rows \\[9\\]"), ([9], [0], "src holds rows \\[9\\]"),
                          ([-1], [0], "src holds rows \\[-1\\]"), ([0], [-1], "dst holds rows \\[-1\\]")):  # fmt: skip
        with pytest.raises(ValueError, match=f"{bad} outside the cache's rows 0..3"):
            cache.copy_positions(src, dst, where)
    cache.keep_rows(torch.tensor([0, 1]))
    before = state(cache)
    with pytest.raises(ValueError, match=r"src holds rows \[3\] outside the cache's rows 0..1"):
        cache.copy_positions(torch.tensor([3]), torch.tensor([0]), where)
    for name, old in before.items():
        assert torch.equal(state(cache)[name], old), name
    with pytest.raises(ValueError, match=r"dst holds rows \[2\] outside the cache's rows 0..1"):
        cache.copy_positions(torch.tensor([0]), torch.tensor([2]), where)


def test_broadcast_rows_errors() -> None:
    cache = random_cache(rows=4)
    with pytest.raises(ValueError, match="group=3 does not divide the cache's 4 rows"):
        cache.broadcast_rows(3)
    with pytest.raises(ValueError, match="group must be a positive integer, got 0"):
        cache.broadcast_rows(0)


def test_constructor_refuses_sizes_below_one() -> None:
    with pytest.raises(ValueError, match="num_layers must be a positive integer, got 0"):
        hb.BranchCache(0, 1, 4, 2, 8)
    with pytest.raises(ValueError, match="num_rows must be a positive integer, got -1"):
        hb.BranchCache(2, -1, 4, 2, 8)
    with pytest.raises(ValueError, match="length must be a positive integer"):
        hb.BranchCache(2, 1, 0, 2, 8)


def test_keep_rows_errors_leave_the_cache_as_it_was() -> None:
    """A bool mask was read as rows 1, 0, 1, 0 (and kept 4 rows); rows out of range failed only after row 0 had
    been overwritten and the storage cut. Both are refused before anything moves."""
    cache = random_cache()
    before = state(cache)
    with pytest.raises(TypeError, match="rows must hold integer row numbers.*bool"):
        cache.keep_rows(torch.tensor([True, False, True, False, True]))
    with pytest.raises(TypeError, match="rows must hold integer row numbers.*float"):
        cache.keep_rows([0.5, 2.7])
    for rows in ([-1], [0, 9], [2, 9, 0]):
        with pytest.raises(ValueError, match="outside the cache's rows 0..4"):
            cache.keep_rows(rows)
    assert cache.num_rows == R
    for name, old in before.items():
        assert torch.equal(state(cache)[name], old), name


def test_keep_rows_exact() -> None:
    cache = random_cache(left_padded_mask([2, 0, 0, 4, 0]))
    before = state(cache)
    cache.keep_rows(torch.tensor([3, 0, 4]))  # order as given
    after = state(cache)
    assert cache.num_rows == 3
    for name, old in before.items():
        assert torch.equal(after[name], old[[3, 0, 4]]), name
    assert cache.has_padding
    cache.keep_rows([2])
    assert not cache.has_padding and cache.num_rows == 1
    assert cache.nbytes() == 2 * LAYERS * 1 * L * H * D * 4


def test_dropping_rows_allocates_nothing(monkeypatch) -> None:
    """Ascending rows (finished requests dropped) move down inside the storage on every device: a new allocation of
    the kept rows beside the whole cache would need 1.5x its memory at the first drop. Only another order (a
    reorder) gathers into new storage."""
    cache = random_cache(rows=6)
    before, base = state(cache), cache.storage.data_ptr()
    made = []
    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: made.append(a) or new_empty(self, *a, **k))
    cache.keep_rows(torch.tensor([1, 2, 5]))
    assert made == [] and cache.storage.data_ptr() == base and cache.num_rows == 3
    for name, old in before.items():
        assert torch.equal(state(cache)[name], old[[1, 2, 5]]), name
    cache.keep_rows(torch.tensor([2, 0]))
    assert len(made) == 1 and cache.storage.data_ptr() != base

def test_copying_disjoint_rows_makes_no_temporary(monkeypatch) -> None:
    """Rows copied into other rows (a draft's after a refresh, a follower's from its leader) go one strided copy per
    row on every device, with no temporary of the copied rows: on a GPU, copies after refreshes of many requests at
    once would need as many cache rows again. Only a copy whose rows overlap gathers first."""
    cache = random_cache(rows=6)
    before = state(cache)
    gathered = []  # gathers of K/V (the rows' versions, one number a row, are gathered too)
    index_select = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, *a, **k: (self.dim() > 1 and gathered.append(self.shape))
                        or index_select(self, *a, **k))  # fmt: skip
    cache.copy_rows([0, 0, 3], [1, 2, 5], same_mask=True)
    assert gathered == []
    for name, old in before.items():
        if name.startswith(("k", "v")):
            assert torch.equal(state(cache)[name], old[[0, 0, 0, 3, 4, 3]]), name
    cache.copy_rows([1, 4], [4, 1], same_mask=True)  # a swap: each row is a source and a destination
    assert len(gathered) == 1

def test_reorder_cache_is_keep_rows() -> None:
    cache = random_cache()
    before = state(cache)
    cache.reorder_cache(torch.tensor([4, 4, 0]))
    assert torch.equal(cache.layers[1].values, before["v1"][[4, 4, 0]])


def test_write_tokens_and_rows() -> None:
    cache = hb.BranchCache(1, 3, 4, 1, 2)
    cache.storage.zero_()  # allocated uninitialized
    k = torch.arange(1, 7, dtype=torch.float32).view(3, 1, 2)
    cache.write_tokens(0, torch.tensor([1, 6, 11]), k, -k)  # (row 0, pos 1), (1, 2), (2, 3)
    keys = cache.layers[0].keys
    assert torch.equal(keys[0, 1], k[0]) and torch.equal(keys[1, 2], k[1]) and torch.equal(keys[2, 3], k[2])
    assert int((keys != 0).any(-1).sum()) == 3  # only those slots changed
    rows = torch.ones(2, 4, 1, 2)
    cache.write_rows(0, torch.tensor([2, 0]), rows, 2 * rows)
    assert keys[[0, 2]].eq(1).all() and cache.layers[0].values[[0, 2]].eq(2).all()
    assert torch.equal(keys[1, 2], k[1])


@pytest.mark.parametrize("family", ["llada", "dream"])
@torch.no_grad()
def test_copied_rows_behave_as_their_source(family: str) -> None:
    """The decoders' broadcast step: one padded prompt's K/V copied into branch rows. The branch
    rows must give the source's window logits, which needs the padding mask to travel along."""
    model = make_tiny_llada() if family == "llada" else make_tiny_dream()
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (1, 14), generator=g)
    mask = torch.ones(1, 14, dtype=torch.long)
    mask[0, :3] = 0
    ref = model.forward_windows(prompt, [8], [12], model(prompt, attention_mask=mask, use_cache=True).cache)

    cache = model.new_cache(3, 14, attention_mask=torch.cat([mask, torch.ones(2, 14, dtype=torch.long)]))
    model(prompt, attention_mask=mask, cache=cache, cache_rows=[0])
    cache.copy_rows([0, 0], [1, 2])
    assert torch.equal(cache.key_mask, mask.bool().expand(3, 14))
    out = model.forward_windows(prompt.expand(3, 14), [8, 8], [12, 12], cache, rows=[1, 2])
    torch.testing.assert_close(out.logits[:4], out.logits[4:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits[:4], ref.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_decoding_never_reads_unwritten_kv(family: str, monkeypatch) -> None:
    """The storage is allocated uninitialized. Filled with NaN instead, every cached decoder must
    decode the same tokens and NFE for a left-padded batch: no step reads K/V (padding included)
    before a full forward or a row copy wrote it."""
    model = make_tiny_llada() if family == "llada" else make_tiny_dream()
    with torch.no_grad():  # peaked confidences, so that steps commit several tokens
        (model.lm_head if hasattr(model, "lm_head") else model.model.transformer.ff_out).weight.mul_(20.0)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    configs = [
        hb.FastDLLMConfig(max_new_tokens=16, block_length=4, threshold=0.5, cache="dual"),
        hb.FastDLLMConfig(max_new_tokens=16, block_length=8, threshold=0.5, cache="prefix"),
        hb.BlockBatchConfig(max_new_tokens=16, block_sizes=[2, 4, 8], threshold=0.5, sync_threshold=2, refresh_interval=4),
        # draft rows take their main row's K/V only when they first carry a draft
        hb.FastDLLMConfig(max_new_tokens=16, block_length=8, threshold=0.5, lookahead=2),
        hb.FastDLLMConfig(max_new_tokens=16, block_length=8, threshold=0.5, lookahead=3, window_queries="sparse"),
        # a contained draft hands over its K/V where the main row committed more (those are stale, re-queried)
        hb.FastDLLMConfig(max_new_tokens=16, block_length=8, threshold=0.5, lookahead=3, window_queries="sparse",
                          lookahead_accept="contained"),
        # drafts that re-query no neighbours read their parent's fresh K/V (or their own cached ones)
        hb.FastDLLMConfig(max_new_tokens=16, block_length=8, threshold=0.5, lookahead=3, window_queries="sparse",
                          requery_radius=3, lookahead_accept="contained", lookahead_draft_radius=0),
    ]

    def run():
        return [model.generate(ids, attention_mask=mask, generation_config=c, return_dict_in_generate=True) for c in configs]

    want = run()
    assert all(sum(st.get("lookahead_adopted", 0) for st in w.stats) > 0 for w in want[3:])  # drafts were read
    built = spy_caches(monkeypatch, fill=float("nan"))
    for w, g in zip(want, run()):
        assert torch.equal(w.sequences, g.sequences)
        assert torch.equal(w.nfe, g.nfe)
    assert len(built) == len(configs)


# ----------------------------------------------------------------------------- storage pool


def test_generate_reuses_cpu_storage_and_user_caches_never_share_it(monkeypatch) -> None:
    from hf_blockbatch.cache import release_pooled_storage

    release_pooled_storage()
    model = make_tiny_llada()
    cfg = hb.BlockBatchConfig(max_new_tokens=16, block_sizes=[2, 4, 8], threshold=0.5)
    built = spy_caches(monkeypatch)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    first = model.generate(prompt, generation_config=cfg)
    second = model.generate(prompt, generation_config=cfg)
    assert torch.equal(first, second)
    assert built[0].storage.data_ptr() == built[1].storage.data_ptr()  # the second call reused the first's memory
    # a cache built outside generate is the caller's own: never pooled, never overwritten by a decode
    mine = model.new_cache(2, 8)
    mine.storage.fill_(7.0)
    assert mine.storage.data_ptr() != built[0].storage.data_ptr()
    model.generate(prompt, generation_config=cfg)
    assert bool((mine.storage == 7.0).all())
    release_pooled_storage()
    from hf_blockbatch.cache import _POOL

    assert not _POOL._free


def test_a_pooled_buffer_too_small_grows_with_headroom() -> None:
    """Batches of one run differ by a few prompt tokens: a buffer replaced at the exact size asked
    would be replaced again by the next, slightly longer batch, faulting in fresh pages each time."""
    from hf_blockbatch.cache import _POOL, release_pooled_storage, reuse_storage

    release_pooled_storage()
    with reuse_storage():
        first = _POOL.take(1000, torch.float32)
    with reuse_storage():
        grown = _POOL.take(1010, torch.float32)  # too small: replaced, with room to spare
        assert grown.numel() == 1010 and grown.untyped_storage().nbytes() == 1250 * 4
    with reuse_storage():
        again = _POOL.take(1200, torch.float32)  # a longer batch still fits: the same memory
        assert again.data_ptr() == grown.data_ptr()
    with reuse_storage():
        assert _POOL.take(4000, torch.float32).untyped_storage().nbytes() == 4000 * 4  # more than the growth: as asked
    assert first.data_ptr() != grown.data_ptr()
    release_pooled_storage()


def test_caches_of_one_block_and_of_concurrent_decodes_do_not_share_storage() -> None:
    import threading

    from hf_blockbatch.cache import reuse_storage

    with reuse_storage():
        a, b = hb.BranchCache(LAYERS, R, L, H, D), hb.BranchCache(LAYERS, R, L, H, D)
        assert a.storage.data_ptr() != b.storage.data_ptr()
    model = make_tiny_llada()
    cfg = hb.BlockBatchConfig(max_new_tokens=16, block_sizes=[2, 4, 8], threshold=0.5)
    prompts = [torch.tensor([[3, 1, 4, 1, 5]]), torch.tensor([[9, 2, 6, 5, 3, 5, 8, 9]])]
    want = [model.generate(p, generation_config=cfg) for p in prompts]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def decode(i: int) -> None:
        for _ in range(4):
            got[i].append(model.generate(prompts[i], generation_config=cfg))

    threads = [threading.Thread(target=decode, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        assert len(got[i]) == 4 and all(torch.equal(g, want[i]) for g in got[i])


def test_pooled_storage_serves_decodes_in_and_out_of_inference_mode() -> None:
    """The eval harness decodes under ``torch.inference_mode``; its pooled storage must then serve
    an ordinary decode (an inference tensor cannot be written outside inference mode)."""
    from hf_blockbatch.cache import release_pooled_storage

    release_pooled_storage()
    model = make_tiny_llada()
    cfg = hb.FastDLLMConfig(max_new_tokens=8, block_length=4, threshold=0.5)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        inside = model.generate(prompt, generation_config=cfg)
    assert torch.equal(model.generate(prompt, generation_config=cfg), inside)


def _row_copies(monkeypatch) -> list:
    """The single-row K/V copies ``copy_rows`` makes from now on (``(source, destination)`` row views' pointers)."""
    made = []
    rows = hb.BranchCache._rows

    def spy(self):
        views = rows(self)
        return [_Counted(v, made) for v in views]

    monkeypatch.setattr(hb.BranchCache, "_rows", spy)
    return made


class _Counted:
    """A row view whose ``copy_`` is recorded."""

    def __init__(self, view: torch.Tensor, made: list) -> None:
        self.view, self.made = view, made

    def copy_(self, other: _Counted) -> None:
        self.made.append((other.view.data_ptr(), self.view.data_ptr()))
        self.view.copy_(other.view)


def test_rows_of_one_version_are_not_copied(monkeypatch) -> None:
    """Rows a broadcast or a copy made equal share a version, and ``copy_rows`` between them moves nothing; a write
    through any of the cache's methods (a window forward's tokens, whole rows, positions, a layer's ``update``) gives
    the written rows their own versions again, and the next copy moves them. The K/V are the copies' in every case."""
    made = _row_copies(monkeypatch)
    cache = random_cache(rows=6)
    cache.broadcast_rows(3)  # rows 0-2 hold row 0's K/V, rows 3-5 row 3's
    cache.copy_rows([0, 3], [1, 4], same_mask=True)
    assert made == []
    cache.copy_rows([0], [3], same_mask=True)  # another version: copied, and row 3 is row 0's now
    assert len(made) == 1
    cache.copy_rows([3], [2], same_mask=True)
    assert len(made) == 1
    k = torch.ones(2, H, D)
    writes = [
        lambda: cache.write_tokens(0, torch.tensor([2 * L + 1, 2 * L + 4]), k, k),  # two tokens of row 2
        lambda: cache.write_rows(0, torch.tensor([2]), torch.ones(1, L, H, D), torch.ones(1, L, H, D)),
        lambda: cache.copy_positions(torch.tensor([5]), torch.tensor([2]), torch.ones(1, L, dtype=torch.bool)),
        lambda: cache.layers[0].update(torch.zeros(6, L, H, D), torch.zeros(6, L, H, D)),
    ]
    for write in writes:
        for layer in cache.layers[1:]:  # (a forward writes every layer; the versions change at the first)
            layer.keys[2] += 1.0
        write()
        before = len(made)
        cache.copy_rows([0], [2], same_mask=True)
        assert len(made) == before + 1
        assert all(torch.equal(layer.keys[2], layer.keys[0]) for layer in cache.layers)
        cache.copy_rows([0], [2], same_mask=True)
        assert len(made) == before + 1  # now one version again
    assert len(made) == 5
    cache.keep_rows(torch.tensor([2, 0, 5]))  # versions follow their rows (the old rows 2 and 0 are one)
    cache.copy_rows([0], [1], same_mask=True)
    assert len(made) == 5
    cache.copy_rows([0], [2], same_mask=True)
    assert len(made) == 6 and torch.equal(cache.layers[1].values[2], cache.layers[1].values[0])


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_skipped_row_copies_decode_the_same(family: str, monkeypatch) -> None:
    """BlockBatch's first leader syncs follow the broadcast of each request's first forward: their rows share a
    version and are not copied. A decode that copies every row (each destination made stale first) decodes the
    same tokens and forwards, in more copies."""
    model = peaked(family)
    prompts = torch.tensor([[5, 3, 8, 1, 9, 2], [7, 7, 1, 4, 2, 6]])
    cfg = hb.BlockBatchConfig(max_new_tokens=32, block_sizes=[2, 4, 8, 16], threshold=0.3, sync_threshold=1,
                              merge_threshold=0.3, refresh_interval=8, early_stop=False)  # fmt: skip
    made = _row_copies(monkeypatch)
    out = model.generate(prompts, generation_config=cfg, return_dict_in_generate=True)
    skipping, made[:] = len(made), []
    copy_rows = hb.BranchCache.copy_rows

    def every_row(self, src, dst, same_mask=False):
        self.rewritten(torch.as_tensor(dst, dtype=torch.long))
        copy_rows(self, src, dst, same_mask)

    monkeypatch.setattr(hb.BranchCache, "copy_rows", every_row)
    full = model.generate(prompts, generation_config=cfg, return_dict_in_generate=True)
    assert torch.equal(out.sequences, full.sequences) and torch.equal(out.nfe, full.nfe)
    assert int(out.stats[0]["syncs"]) > 0 and skipping < len(made)


def _write_rows(cache: hb.BranchCache, plain: torch.Tensor, rows: list[int], gen: torch.Generator) -> None:
    """Random K/V written over whole ``rows`` of every layer, in the cache and in ``plain`` alike."""
    kv = torch.randn(2, 2, len(rows), cache.length, H, D, generator=gen)
    for layer in range(2):
        cache.write_rows(layer, torch.tensor(rows), kv[layer, 0], kv[layer, 1])
    plain[:, :, rows] = kv


def test_random_row_operations_match_plain_tensors() -> None:
    """Random sequences of every row operation (whole-row and token writes, row copies with repeated sources and
    overlaps, position copies, broadcasts, drops, reorders with repeats) on caches of random shapes: after each, the K/V
    equal those of plain tensors put through the same operations. Copies between rows of one version move nothing
    (above), so a version that outlived a write would show here as a stale row."""
    import random

    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        rows, length = rng.randint(2, 6), rng.randint(1, 4)
        cache = hb.BranchCache(2, rows, length, H, D)
        plain = torch.empty(2, 2, rows, length, H, D)  # [layer, K/V, row, position, H, D]
        _write_rows(cache, plain, list(range(rows)), gen)
        for _ in range(20):
            n, op = cache.num_rows, rng.choice(["rows", "tokens", "copy", "copy", "copy", "positions", "positions",
                                                 "broadcast", "broadcast", "keep", "reorder"])  # fmt: skip
            if op == "rows":
                _write_rows(cache, plain, sorted(rng.sample(range(n), rng.randint(1, n))), gen)
            elif op == "tokens":
                slots = rng.sample(range(n * length), rng.randint(1, n * length))
                kv = torch.randn(2, 2, len(slots), H, D, generator=gen)
                for layer in range(2):
                    cache.write_tokens(layer, torch.tensor(slots), kv[layer, 0], kv[layer, 1])
                flat = plain.view(2, 2, n * length, H, D)
                flat[:, :, slots] = kv
            elif op == "copy":
                dst = rng.sample(range(n), rng.randint(1, n))
                src = [rng.randrange(n) for _ in dst]
                cache.copy_rows(src, dst, same_mask=True)
                plain[:, :, dst] = plain[:, :, src].clone()
            elif op == "positions" and n > 1:
                order = rng.sample(range(n), n)
                k = rng.randint(1, n // 2)
                src, dst = order[:k], order[k : 2 * k]
                where = torch.rand(k, length, generator=gen) < 0.5
                cache.copy_positions(torch.tensor(src), torch.tensor(dst), where)
                for i, (s, d) in enumerate(zip(src, dst)):
                    plain[:, :, d, where[i]] = plain[:, :, s, where[i]]
            elif op == "broadcast":
                group = rng.choice([g for g in range(1, n + 1) if n % g == 0])
                cache.broadcast_rows(group)
                plain = plain[:, :, [r - r % group for r in range(n)]].clone()
            elif op == "keep":
                kept = sorted(rng.sample(range(n), rng.randint(1, n)))
                cache.keep_rows(torch.tensor(kept))
                plain = plain[:, :, kept].clone()
            elif op == "reorder":
                order = [rng.randrange(n) for _ in range(rng.randint(1, n))]
                cache.reorder_cache(torch.tensor(order))
                plain = plain[:, :, order].clone()
            held = torch.stack([torch.stack([layer.keys, layer.values]) for layer in cache.layers])
            assert torch.equal(held, plain), op


def test_copy_rows_of_empty_lists_copies_nothing() -> None:
    """``as_tensor([])`` is float32, which the row check refuses: an empty list is read as no rows."""
    cache = random_cache()
    before = state(cache)
    cache.copy_rows([], [])
    for name, old in before.items():
        assert torch.equal(state(cache)[name], old), name


def test_nested_reuse_storage_blocks_are_one_block() -> None:
    """A buffer taken in an inner block goes back to the pool when the outer block ends, not the inner one."""
    from hf_blockbatch.cache import _POOL, release_pooled_storage, reuse_storage

    release_pooled_storage()
    with reuse_storage():
        with reuse_storage():
            taken = _POOL.take(100, torch.float32)
        assert not _POOL._free and [b.data_ptr() for b in _POOL.lending] == [taken.data_ptr()]
    assert _POOL.lending is None and _POOL._free[torch.float32].data_ptr() == taken.data_ptr()
    release_pooled_storage()
