"""Exports load through transformers' AutoModel with our own modeling file, and compute what the runtime computes."""

import dataclasses
import json

import pytest
import torch
from transformers import AutoModel

from specdraft.export.hf import export_drafter
from specdraft.lit_modules.blocks import build_blocks
from specdraft.runtime.models.retrace import build_prior, verify_stats
from specdraft.runtime.models.target import TargetLM
from tests.helpers import make_drafter, make_target, retrace_from, tiny_target_args


def _inputs(d, target, S=12, N=2, seed=0):
    """A sequence's target features and two blocks at random anchors, as training lays them out."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.args.vocab_size - 1, (1, S), generator=g)
    feats = target(ids, feature_layers=d.target_layer_ids).features  # [1, S, F]
    anchors = torch.tensor([[3, 8]])
    blk = build_blocks(ids, torch.ones_like(ids), torch.tensor([S]), anchors, torch.ones(1, N, dtype=torch.bool),
                       d.block_size, d.config.mask_token_id)
    return feats, blk


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}


def _target(rope: dict | None):
    if rope is None:
        return make_target(seed=1)
    torch.manual_seed(1)
    t = TargetLM(dataclasses.replace(tiny_target_args(), rope_theta=5e5, rope_scaling=rope))
    for p in t.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.3)
    return t.eval()


@pytest.mark.parametrize("arch,options,rope", [
    ("dflash", {}, None), ("dflash", {}, LLAMA3), ("retrace", {}, None), ("retrace", {"alignment": "soft"}, None),
    ("retrace", {"embed_drafted": False, "use_correction": False, "refiner_width": 16}, None),
    ("retrace", {"gate_anchor": True}, LLAMA3)], ids=str)
def test_automodel_loads_an_export_and_drafts_the_runtimes_logits(arch, options, rope, tmp_path):
    target = _target(rope)
    d = make_drafter(target, seed=2, block_size=5)
    if arch == "retrace":
        d = retrace_from(d, active=True, **options)
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
            with torch.no_grad():
                d.retrace_log_width.fill_(0.3)  # a trained soft-alignment width travels with the weights too
                hf.retrace_log_width.fill_(0.3)
            prior = build_prior(hidden, drafts, torch.tensor([1, 0]), verify_stats(torch.randn(2, Bk, 64), drafts),
                                torch.randn(2, Bk, d.config.hidden_size), d.embed, d.config.retrace.embed_drafted)
            delta = d.fusion_delta(prior)
            assert delta.abs().max() > 1e-3  # the fusion is active
            torch.testing.assert_close(hf.fusion_delta(*prior), delta, atol=1e-5, rtol=1e-5)
