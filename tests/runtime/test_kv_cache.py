"""The KV cache's row bookkeeping for continuous batching: compaction and admission in place give what
``index_select`` and ``cat`` would, copy only the rows that move, and reserve their room once; packed writes of
uneven ingests land where padded ones would."""

import torch

from specdraft.runtime.kv_cache import KVCache
from tests.helpers import make_drafter, make_target


def _filled(rows: int, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(num_layers=2, batch_size=rows, num_kv_heads=2, max_len=6, head_dim=3, dtype=torch.float32,
                    device="cpu")
    for buf in (*cache.k, *cache.v):
        buf.copy_(torch.randn(buf.shape, generator=g))
    cache.lengths = torch.randint(0, 6, (rows,), generator=g)
    return cache


def _assert_committed_equal(cache, want_k: list[torch.Tensor], lengths: list[int]) -> None:
    """Each row's committed entries equal ``want_k``'s (entries past a row's length are scratch, never copied)."""
    assert cache.lengths.tolist() == lengths
    for k, want in zip(cache.k, want_k):
        assert k.shape == want.shape
        for row, n in enumerate(lengths):
            torch.testing.assert_close(k[row, :, :n], want[row, :, :n], rtol=0, atol=0)


def test_compaction_and_admission_in_place_equal_select_and_cat():
    cache = _filled(5, seed=0)
    ref_k = [k.clone() for k in cache.k]
    ref_len = cache.lengths.clone()
    cache.reserve(6)
    base = cache._kb[0].data_ptr()
    assert cache.batch_size == 5 and cache.k[0].shape[0] == 5  # room reserved, not in the rows
    order = torch.tensor([0, 4, 2])  # rows 1 and 3 end; row 4 fills the hole at 1 (swap-remove)
    cache.select_rows(order)
    _assert_committed_equal(cache, [r[order] for r in ref_k], ref_len[order].tolist())
    new = _filled(3, seed=1)
    cache.cat_rows(new)  # three requests join: rows 3..5 of the reserved room
    assert cache.batch_size == 6 and cache._kb[0].data_ptr() == base  # no reallocation
    _assert_committed_equal(cache, [torch.cat([r[order], n]) for r, n in zip(ref_k, new.k)],
                            ref_len[order].tolist() + new.lengths.tolist())
    before_k, before_len = [k.clone() for k in cache.k], cache.lengths.tolist()
    last = _filled(1, seed=2)
    cache.cat_rows(last)  # past the reserved room: it grows, copying the committed entries into new buffers
    assert cache.batch_size == 7 and cache.k[1].shape[0] == 7
    _assert_committed_equal(cache, [torch.cat([b, n]) for b, n in zip(before_k, last.k)],
                            before_len + last.lengths.tolist())
    placeholder = KVCache(num_layers=2, batch_size=2, num_kv_heads=2, max_len=1, head_dim=3, dtype=torch.float32,
                          device="cpu")  # rows joining with nothing committed (a deferred drafter ingest)
    cache.cat_rows(placeholder)
    assert cache.lengths.tolist() == before_len + last.lengths.tolist() + [0, 0] and cache.k[0].shape[2] == 6
    cache.select_rows(torch.tensor([], dtype=torch.long))
    assert cache.batch_size == 0 and cache.k[0].shape[0] == 0


def test_uneven_ingest_projects_only_real_tokens_and_equals_ingesting_each_row_alone():
    """A backlog flush feeds one row a whole prompt and another a token or none: the drafter packs the real tokens
    (padding would be most of the work), and every row's context K/V, length and next draft are what ingesting that
    row alone gives."""
    drafter = make_drafter(make_target())
    counts = torch.tensor([9, 1, 0, 2])  # 12 real of 36 padded: the packed path
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(4, 9, drafter.fc.in_features, generator=g)  # [B, T, F]
    lens = torch.tensor([3, 0, 5, 1])
    start = torch.randn(4, 5, drafter.fc.in_features, generator=g)
    with torch.no_grad():
        batch = drafter.new_cache(4, 24)
        drafter.ingest(batch, start, lens)  # uneven history first: rows start at different slots
        calls = []
        packed = drafter.ingest_rows
        drafter.ingest_rows = lambda *a: calls.append(1) or packed(*a)
        fused = drafter.ingest(batch, feats, counts)
        assert calls and fused.shape == (4, 9, drafter.config.hidden_size)
        blk = torch.full((4, drafter.block_size), drafter.config.mask_token_id)
        blk[:, 0] = torch.tensor([1, 2, 3, 4])
        hidden = drafter.draft_hidden(batch, drafter.block_embeds(blk, None))  # [B, Bk, D]
        for r in range(4):
            alone = drafter.new_cache(1, 24)
            drafter.ingest(alone, start[r:r + 1], lens[r:r + 1])
            drafter.ingest(alone, feats[r:r + 1], counts[r:r + 1])
            n = int(alone.lengths[0])
            assert int(batch.lengths[r]) == n == int(lens[r] + counts[r])
            for kb, ka in zip(batch.k + batch.v, alone.k + alone.v):
                torch.testing.assert_close(kb[r, :, :n], ka[0, :, :n], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(fused[r, : counts[r]], drafter.fuse_context(feats[r:r + 1, : counts[r]])[0],
                                       rtol=1e-5, atol=1e-6)
            one = drafter.draft_hidden(alone, drafter.block_embeds(blk[r:r + 1], None))
            torch.testing.assert_close(hidden[r], one[0], rtol=1e-4, atol=1e-5)
