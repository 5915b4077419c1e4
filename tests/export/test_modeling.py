"""Exports load through transformers' AutoModel with our own modeling file, and compute what the runtime computes."""

import json

import pytest
import torch
from transformers import AutoModel

from specdraft.export.hf import export_drafter
from specdraft.lit_modules.blocks import build_blocks
from specdraft.runtime.models.retrace import build_prior, verify_stats
from tests.helpers import make_drafter, make_target, retrace_from


def _inputs(d, target, S=12, N=2, seed=0):
    """A sequence's target features and two blocks at random anchors, as training lays them out."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.args.vocab_size - 1, (1, S), generator=g)
    feats = target(ids, feature_layers=d.target_layer_ids).features  # [1, S, F]
    anchors = torch.tensor([[3, 8]])
    blk = build_blocks(ids, torch.ones_like(ids), torch.tensor([S]), anchors, torch.ones(1, N, dtype=torch.bool),
                       d.block_size, d.config.mask_token_id)
    return feats, blk


@pytest.mark.parametrize("arch", ["dflash", "retrace"])
def test_automodel_loads_an_export_and_drafts_the_runtimes_logits(arch, tmp_path):
    target = make_target(seed=1)
    d = make_drafter(target, seed=2, block_size=5)
    if arch == "retrace":
        d = retrace_from(d, active=True)
    out = export_drafter(d, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"]["AutoModel"] == f"modeling_specdraft.{cfg['architectures'][0]}"
    hf = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert type(hf).__name__ == cfg["architectures"][0]

    feats, blk = _inputs(d, target)
    S = feats.shape[1]
    ctx_pos = torch.arange(S)[None]
    with torch.no_grad():
        embeds = d.embed(blk.tokens)  # [1, N * Bk, D]
        ours = d(embeds, blk.positions, d.context_kv(feats, ctx_pos), blk.mask)
        theirs = hf(noise_embedding=embeds, target_hidden=feats, position_ids=torch.cat([ctx_pos, blk.positions], 1),
                    attention_mask=blk.mask)
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(target.lm_head(theirs), d.logits(ours), atol=1e-4, rtol=1e-4)
        if arch == "retrace":  # the fusion a rejected suffix adds to the next block's inputs
            Bk = d.block_size
            hidden, drafts = torch.randn(2, Bk, d.config.hidden_size), torch.randint(0, 60, (2, Bk - 1))
            prior = build_prior(hidden, drafts, torch.tensor([1, 0]), verify_stats(torch.randn(2, Bk, 64), drafts),
                                torch.randn(2, Bk, d.config.hidden_size), d.embed)
            delta = d.fusion_delta(prior)
            assert delta.abs().max() > 1e-3  # the fusion is active
            torch.testing.assert_close(hf.fusion_delta(*prior), delta, atol=1e-5, rtol=1e-5)
