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
        packed = drafter.ingest_packed
        drafter.ingest_packed = lambda *a: calls.append(1) or packed(*a)
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


def test_a_growing_drafter_cache_drafts_as_one_allocated_at_full_length():
    """A drafter cache of one slot that grows on demand (a deferred ingest sizes it when the drafter first catches
    up) holds the same context and drafts the same blocks as one allocated for the whole job, through a prompt's
    catch-up, rounds, an admission and a compaction; past ``grow_to`` it refuses in one
    line."""
    drafter = make_drafter(make_target())
    g = torch.Generator().manual_seed(0)
    F = drafter.fc.in_features
    with torch.no_grad():
        full, grown = drafter.new_cache(3, 64), drafter.new_cache(3, 1)
        grown.grow_to = 64
        blk = torch.full((3, drafter.block_size), drafter.config.mask_token_id)
        blk[:, 0] = torch.tensor([1, 2, 3])

        def same(rows: int) -> None:
            assert full.lengths.tolist() == grown.lengths.tolist()
            for a, b in zip(full.k + full.v, grown.k + grown.v):
                for r, n in enumerate(full.lengths.tolist()):
                    torch.testing.assert_close(a[r, :, :n], b[r, :, :n], rtol=0, atol=0)
            x = drafter.block_embeds(blk[:rows], None)
            torch.testing.assert_close(drafter.draft_hidden(full, x), drafter.draft_hidden(grown, x), rtol=0, atol=0)

        prompt = torch.randn(3, 11, F, generator=g)
        for c in (full, grown):
            drafter.ingest(c, prompt, torch.tensor([11, 4, 7]))  # a prompt's catch-up: 1 -> 11 slots
        assert grown.max_len == 11
        same(3)
        for t in range(3):  # rounds: the block's scratch and each commit grow it, at least doubling
            step = torch.randn(3, drafter.block_size, F, generator=g)
            for c in (full, grown):
                drafter.ingest(c, step, torch.tensor([t + 1, 1, drafter.block_size]))
            same(3)
        assert grown.max_len == 44 and grown.grow_to == 64  # 11 -> 22 (the first block's scratch) -> 44
        keep = torch.tensor([2, 0])
        for c in (full, grown):
            c.select_rows(keep)
        joining = drafter.new_cache(1, 50)
        drafter.ingest(joining, torch.randn(1, 50, F, generator=g), torch.tensor([50]))
        for c in (full, grown):
            c.cat_rows(joining)  # longer than the growing cache's room: it grows first (doubling, capped at grow_to)
        assert grown.max_len == 64
        blk = blk[[2, 0, 1]]
        same(3)
        try:
            drafter.ingest(grown, torch.randn(3, 40, F, generator=g), torch.full((3,), 40))
        except ValueError as e:
            assert "need 90 slots, have 64" in str(e)
        else:
            raise AssertionError("grew past grow_to")


def test_a_pass_under_autocast_writes_the_cache_in_its_own_dtype():
    """A frozen fp32 target run inside a bf16 training step (ReTrace's replayed verify passes) writes bf16 K/V; the
    cache keeps its dtype, padded and packed writes alike."""
    cache = KVCache(num_layers=1, batch_size=2, num_kv_heads=2, max_len=4, head_dim=3, dtype=torch.float32,
                    device="cpu")
    k = torch.randn(2, 2, 2, 3).bfloat16()  # [B, H_kv, T, D]
    cache.write(0, k, -k, torch.tensor([[0, 1], [1, 2]]))
    assert cache.k[0].dtype == torch.float32
    torch.testing.assert_close(cache.k[0][1, :, 1:3], k[1].float(), rtol=0, atol=0)
    torch.testing.assert_close(cache.v[0][0, :, 0:2], -k[0].float(), rtol=0, atol=0)
    packed = torch.randn(2, 3, 3).bfloat16()  # [H_kv, N, D]
    cache.write_packed(0, packed, packed, torch.tensor([0, 0, 1]), torch.tensor([2, 3, 3]))
    torch.testing.assert_close(cache.k[0][1, :, 3], packed[:, 2].float(), rtol=0, atol=0)
