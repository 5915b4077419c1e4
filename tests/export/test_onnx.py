"""ONNX export and the ONNX Runtime backend, both flavours (decomposed, and fused with the custom ops run by their
references): each graph's ORT outputs equal the torch path's in fp32 (max abs diff <= 1e-4, times the output's
magnitude where that exceeds 1) over batch sizes, ragged context lengths, tree masks and cache crops; a whole greedy
decode through ORT (chains, D²SD trees, ReTrace) is the target's output and conforms to the torch backend's rounds
(the same drafts, acceptance and trees, round for round); a wrong export
is refused in one line."""

import copy
import json

import onnx
import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.export.onnx import export_onnx, weights_hash
from specdraft.runtime.backends.onnx import OnnxDrafter, OnnxTarget, load_manifest
from specdraft.runtime.calibration import Calibration
from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import convert_drafter
from specdraft.runtime.models.retrace import build_prior, verify_stats
from specdraft.runtime.policy import AdaptivePolicy
from tests.helpers import make_drafter, make_target
from tests.lossless import check_conformance
from tests.runtime.test_policy import costs

TOL = 1e-4


@pytest.mark.slow
def test_the_fused_flavour_has_one_custom_node_per_attention_and_no_softmax(exported):
    target, drafter, out = exported
    m = load_manifest(out)
    nodes = {kind: onnx.load(str(out / g["file"])).graph.node for kind, g in m["graphs"].items()}
    custom = {kind: [n for n in ns if n.domain == "specdraft"] for kind, ns in nodes.items()}
    layers = {"drafter_draft": len(drafter.layers), "target_verify": len(target.model.layers), "drafter_ingest": 0}
    if m["flavour"] == "fused":
        for kind, ns in custom.items():
            assert len(ns) == layers[kind] and all(n.op_type == "SpeculativeAttention" for n in ns)
            assert all([a.name for a in n.attribute] == ["scale"] for n in ns)
            assert not any(n.op_type == "Softmax" for n in nodes[kind])
    else:
        assert not any(custom.values())
        assert sum(n.op_type == "Softmax" for n in nodes["target_verify"]) == layers["target_verify"]


def _tree_mask(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            mask[b, t, t] = True
            if t:
                mask[b, t] |= mask[b, int(torch.randint(0, t, (1,), generator=g))]
    return mask


@pytest.mark.slow  # each flavour exports a model first (~25 s)
@pytest.mark.parametrize("B", [1, 3])
def test_graphs_equal_the_torch_path(exported, B):
    target, drafter, out = exported
    ot, od = OnnxTarget(out), OnnxDrafter(out)
    g = torch.Generator().manual_seed(B)
    lens = torch.tensor([7, 3, 11][:B])
    prompts = torch.randint(0, 6, (B, int(lens.max())), generator=g)
    caches = {"torch": (target.new_cache(B, 40), drafter.new_cache(B, 40)), "onnx": (ot.new_cache(B, 40),
                                                                                      od.new_cache(B, 40))}
    results = {}
    for name, (tm, dm) in {"torch": (target, drafter), "onnx": (ot, od)}.items():
        tc, dc = caches[name]
        with torch.no_grad():
            pre = tm(prompts, cache=tc, feature_layers=dm.target_layer_ids)  # prefill, ragged: crop to lens
            tc.crop(lens)
            fused = dm.ingest(dc, pre.features, lens)
            blk = torch.full((B, 4), 5)
            blk[:, 0] = prompts[:, 0]
            hidden = dm.draft_hidden(dc, dm.block_embeds(blk, None))
            dlogits = dm.logits(hidden[:, 1:])
            T = 6  # a tree pass over the target cache, then a crop below it and a causal pass
            tree = tm(torch.randint(0, 6, (B, T), generator=torch.Generator().manual_seed(9)), cache=tc,
                      positions=tc.lengths[:, None] + torch.tensor([0, 1, 1, 2, 2, 3]), new_mask=_tree_mask(B, T, 1),
                      feature_layers=dm.target_layer_ids)
            tc.crop(tc.lengths - 2)
            chain = tm(torch.tensor([[1, 2, 3]] * B), cache=tc)
        results[name] = [pre.logits, pre.features, fused, hidden, dlogits, tree.logits, tree.features, chain.logits]
    for i, (a, b) in enumerate(zip(results["torch"], results["onnx"])):
        assert a.shape == b.shape, i
        scale = max(1.0, float(a.float().abs().max()))  # fp32 rounding grows with the residual stream's size
        assert (a.float() - b.float()).abs().max() <= TOL * scale, i


PROMPTS = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5]]
CAPS = [10, 14, 7, 12, 9]


def test_greedy_decode_through_onnx_runtime_is_the_targets_and_drafts_like_torch(exported):
    target, drafter, out = exported
    ot, od = OnnxTarget(out), OnnxDrafter(out)
    gen = GenerationConfig(max_new_tokens=CAPS)
    want = generate(target, PROMPTS, gen)
    assert [r.tokens for r in generate(ot, PROMPTS, gen, drafter=od)] == [r.tokens for r in want]
    counts = check_conformance((ot, lambda p: od, None), (target, lambda p: drafter, None), PROMPTS, CAPS)
    assert counts["differing_rows"] == 0 and counts["accepted"] > 0, counts  # torch's drafts, round for round
    assert [r.tokens for r in generate(ot, PROMPTS, gen)] == [r.tokens for r in want]  # AR through ORT


def test_d2sd_tree_through_onnx_runtime(exported):
    target, drafter, out = exported
    ot, od = OnnxTarget(out), OnnxDrafter(out)
    second = convert_drafter(make_drafter(target, seed=5, block_size=4), "vp")
    gen = GenerationConfig(max_new_tokens=CAPS)
    got = generate(ot, PROMPTS, gen, drafter=od, tree=TreeDrafting(second, 2))
    assert [r.tokens for r in got] == [r.tokens for r in generate(target, PROMPTS, gen)]
    counts = check_conformance((ot, lambda p: (od, TreeDrafting(second, 2)), None),
                               (target, lambda p: (drafter, TreeDrafting(second, 2)), None), PROMPTS, CAPS)
    assert counts["differing_rows"] == 0 and counts["accepted"] > 0, counts  # the same trees and winners


def test_a_wrong_export_is_refused_in_one_line(exported, tmp_path):
    target, drafter, out = exported
    m = load_manifest(out, drafter_sha256=weights_hash(drafter), target_sha256=weights_hash(target))
    assert set(m["graphs"]) == {"drafter_ingest", "drafter_draft", "target_verify"}
    other = make_drafter(target, seed=9, block_size=4)
    with torch.no_grad():
        other.fc.weight.add_(1.0)
    with pytest.raises(SpecdraftError, match="another drafter"):
        load_manifest(out, drafter_sha256=weights_hash(other))
    with pytest.raises(SpecdraftError, match="another target"):
        load_manifest(out, target_sha256=weights_hash(make_target(seed=1, vocab=6)))
    with pytest.raises(SpecdraftError, match="not an ONNX export"):
        load_manifest(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in out.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    with (broken / "embed_tokens.safetensors").open("ab") as f:  # every file of the export is hashed
        f.write(b"\0")
    with pytest.raises(SpecdraftError, match="embed_tokens.safetensors does not match its manifest hash"):
        load_manifest(broken)
    (broken / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(SpecdraftError, match="format"):
        load_manifest(broken)


@pytest.mark.slow  # exports a ReTrace model per flavour first
def test_retrace_through_onnx_runtime_carries_its_prior_like_torch(exported_retrace):
    target, drafter, out = exported_retrace
    m = load_manifest(out)
    assert m["drafter"]["retrace"] is not None
    draft_inputs = [i.name for i in onnx.load(str(out / m["graphs"]["drafter_draft"]["file"])).graph.input]
    assert draft_inputs[-4:] == ["prior_hidden", "prior_signals", "prior_valid", "prior_shift"]
    if m["flavour"] == "fused":
        nodes = onnx.load(str(out / m["graphs"]["drafter_draft"]["file"])).graph.node
        assert sum(n.op_type == "RetraceFusion" and n.domain == "specdraft" for n in nodes) == 1
    ot, od = OnnxTarget(out), OnnxDrafter(out)
    gen = GenerationConfig(max_new_tokens=CAPS)
    got = generate(ot, PROMPTS, gen, drafter=od)
    assert [r.tokens for r in got] == [r.tokens for r in generate(target, PROMPTS, gen)]
    counts = check_conformance((ot, lambda p: od, None), (target, lambda p: drafter, None), PROMPTS, CAPS)
    assert counts["differing_rows"] == 0 and counts["accepted"] > 0, counts  # the prior changes drafts the same way
    widths = []

    def adaptive(*args, **kwargs):  # narrow and plain rounds: the prior covers what a round verified, or starts over
        results = generate(*args, **kwargs, policy=AdaptivePolicy(costs(0.3), Calibration(bins=1, table=[[0.5]] * 3),
                                                                  retry_every=2, measured=False))
        widths.extend(v for r in results for v in r.verified)
        return results

    counts = check_conformance((ot, lambda p: od, adaptive), (target, lambda p: drafter, adaptive), PROMPTS, CAPS)
    assert counts["differing_rows"] == 0 and counts["accepted"] > 0, counts
    assert set(widths) == {0, 1}, sorted(set(widths))  # one-draft rounds and plain ones
    # one draft pass with a prior: ORT's fused block equals torch's, and the prior changes it
    g = torch.Generator().manual_seed(0)
    B, Bk, D, V = 2, drafter.block_size, drafter.config.hidden_size, drafter.config.vocab_size
    drafts = torch.randint(0, V, (B, Bk - 1), generator=g)
    prior = build_prior(torch.randn(B, Bk, D, generator=g), drafts, torch.tensor([0, 1]),
                        verify_stats(torch.randn(B, Bk, V, generator=g), drafts), torch.randn(B, Bk, D, generator=g),
                        drafter.embed, drafter.config.retrace.embed_drafted)
    feats = torch.randn(B, 6, drafter.fc.in_features, generator=g)
    blk = torch.tensor([[1, 5, 5, 5], [2, 5, 5, 5]])
    hidden = {}
    for name, d in (("torch", drafter), ("onnx", od)):
        cache = d.new_cache(B, 16)
        with torch.no_grad():
            d.ingest(cache, feats, torch.tensor([6, 4]))
            hidden[name] = [d.draft_hidden(cache, d.block_embeds(blk, p)) for p in (prior, None)]
    assert (hidden["torch"][0] - hidden["onnx"][0]).abs().max() <= TOL
    assert (hidden["onnx"][0] - hidden["onnx"][1]).abs().max() > 1e-2  # the prior is not ignored


@pytest.mark.slow
def test_an_fp16_export_keeps_the_feature_path_in_fp32(tmp_path):
    """Target features of magnitude 3e4 (Qwen3-8B's spikes), summed by ``fc`` over the concatenated layers, overflow
    fp16; the fp16 export's ingest graph computes them in fp32 (ONNX Runtime runs fp16 graphs on the CPU), so its
    fused context is finite and matches the fp32 drafter's, while the same projection in fp16 is not."""
    target = make_target(seed=7, vocab=6, std=0.5)
    drafter = make_drafter(target, seed=2, block_size=4)
    with torch.no_grad():
        drafter.fc.weight.copy_(drafter.fc.weight.abs() + 0.05)  # each output sums 3e4 x F x >0.05, above 65504
    reference = copy.deepcopy(drafter)
    export_onnx(drafter.half(), target.half(), tmp_path, flavour="decomposed")
    assert load_manifest(tmp_path)["dtype"] == "float16"
    F = reference.fc.in_features
    features = torch.full((1, 3, F), 3e4) * torch.tensor([1.0, -1.0, 0.5])[None, :, None]  # [1, 3, F]
    assert not torch.isfinite(reference.fc.half()(features.half())).all()  # what an fp16 projection does
    reference.fc.float()
    ingest = OnnxDrafter(tmp_path).ingest_graph
    got = ingest(features=features, positions=torch.arange(3)[None])["fused"]
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    want = reference.float().fuse_context(features)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    verify = onnx.load(str(tmp_path / load_manifest(tmp_path)["graphs"]["target_verify"]["file"]))
    features_out = next(o for o in verify.graph.output if o.name == "features")
    assert features_out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
