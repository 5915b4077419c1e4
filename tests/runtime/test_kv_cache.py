"""The KV cache's row bookkeeping for continuous batching: compaction and admission in place give what
``index_select`` and ``cat`` would, copy only the rows that move, and reserve their room once."""

import torch

from specdraft.runtime.kv_cache import KVCache


def _filled(rows: int, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(num_layers=2, batch_size=rows, num_kv_heads=2, max_len=6, head_dim=3, dtype=torch.float32,
                    device="cpu")
    for buf in (*cache.k, *cache.v):
        buf.copy_(torch.randn(buf.shape, generator=g))
    cache.lengths = torch.randint(0, 6, (rows,), generator=g)
    return cache


def test_compaction_and_admission_in_place_equal_select_and_cat():
    cache = _filled(5, seed=0)
    ref_k = [k.clone() for k in cache.k]
    ref_len = cache.lengths.clone()
    cache.reserve(6)
    base = cache._kb[0].data_ptr()
    assert cache.batch_size == 5 and cache.k[0].shape[0] == 5  # room reserved, not in the rows
    order = torch.tensor([0, 4, 2])  # rows 1 and 3 end; row 4 fills the hole at 1 (swap-remove)
    cache.select_rows(order)
    for k, r in zip(cache.k, ref_k):
        torch.testing.assert_close(k, r[order], rtol=0, atol=0)
    assert cache.lengths.tolist() == ref_len[order].tolist()
    new = _filled(3, seed=1)
    cache.cat_rows(new)  # three requests join: rows 3..5 of the reserved room
    assert cache.batch_size == 6 and cache._kb[0].data_ptr() == base  # no reallocation
    for k, r, n in zip(cache.k, ref_k, new.k):
        torch.testing.assert_close(k, torch.cat([r[order], n]), rtol=0, atol=0)
    assert cache.lengths.tolist() == ref_len[order].tolist() + new.lengths.tolist()
    cache.cat_rows(_filled(1, seed=2))  # past the reserved room: it grows
    assert cache.batch_size == 7 and cache.k[1].shape[0] == 7
    cache.select_rows(torch.tensor([], dtype=torch.long))
    assert cache.batch_size == 0 and cache.k[0].shape[0] == 0
