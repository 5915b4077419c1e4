"""The lean target forward against transformers (Qwen3, Llama with llama3 RoPE), with crops, ragged rows,
sharded checkpoints and an explicit tree mask."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from specdraft.errors import SpecdraftError
from specdraft.runtime.load import load_target


def _hf(kind: str, tied: bool):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=tied)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    return LlamaForCausalLM(LlamaConfig(max_position_embeddings=512, rope_parameters=rope, **common)).eval()


@pytest.fixture(params=[("qwen3", True), ("qwen3", False), ("llama", False)], ids=["qwen3-tied", "qwen3", "llama3"])
def pair(request, tmp_path):
    hf = _hf(*request.param)
    hf.save_pretrained(str(tmp_path))
    return hf, load_target(tmp_path, dtype="float32", device="cpu")


def test_full_forward_logits_and_features_match_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (2, 90))  # long enough for llama3 scaling to matter (> original 64)
    ref = hf(ids, output_hidden_states=True)
    out = ours(ids, feature_layers=(1, 0))  # order is the caller's; layer l = hidden_states[l + 1]
    assert (out.logits - ref.logits).abs().max() <= 1e-4
    # (transformers 5 returns the final layer post-norm in hidden_states[-1]; DFlash never uses the last layer)
    torch.testing.assert_close(out.features[..., :64], ref.hidden_states[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.features[..., 64:], ref.hidden_states[1], atol=1e-5, rtol=1e-5)
    split = ours(ids, feature_layers=(1, 0), concat_features=False).features  # the layers' outputs, not concatenated
    assert isinstance(split, tuple) and [f.shape for f in split] == [(2, 90, 64)] * 2
    assert torch.equal(torch.cat(split, dim=-1), out.features)


def test_the_last_layers_feature_is_transformers_post_norm_hidden_state(pair):
    """The reference DFlash code reads ``hidden_states[N]`` for the last layer id, which transformers returns after
    the final norm; a drafter trained on either side must see the same features."""
    hf, ours = pair
    ids = torch.randint(0, 97, (1, 20))
    ref = hf(ids, output_hidden_states=True).hidden_states
    raw = []
    hook = ours.model.layers[2].register_forward_hook(lambda mod, args, out: raw.append(out))
    last = ours(ids, feature_layers=(2,)).features  # the 3-layer target's last layer
    hook.remove()
    torch.testing.assert_close(last, ref[3], atol=1e-5, rtol=1e-5)
    assert (last - raw[0]).abs().max() > 1e-2  # the final norm is what makes them agree


def test_sliding_window_layers_are_refused_not_run_as_full_attention(tmp_path):
    hf = _hf("qwen3", True)
    hf.save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "sliding_attention",
                                                                          "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((SpecdraftError, ValueError), match="sliding"):
        load_target(tmp_path, dtype="float32", device="cpu")


def test_cached_decode_with_crops_and_ragged_rows_matches_full_forward(pair):
    hf, ours = pair
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (2, 30))
    ref = hf(ids).logits  # [2, 30, V]
    cache = ours.new_cache(2, 64)
    lens = torch.tensor([10, 6])
    ours(ids[:, :10], cache=cache)  # prefill, then keep 10 and 6 tokens (ragged)
    cache.crop(lens)
    # row 0 verifies 8 tokens at 10..17, row 1 verifies 8 tokens at 6..13, in one call
    block = torch.stack([ids[0, 10:18], ids[1, 6:14]])
    out = ours(block, cache=cache)
    assert (out.logits[0] - ref[0, 10:18]).abs().max() <= 1e-4
    assert (out.logits[1] - ref[1, 6:14]).abs().max() <= 1e-4
    # reject: row 0 keeps 3 of them, row 1 keeps 5; the next call must see exactly the committed prefix
    cache.crop(lens + torch.tensor([3, 5]))
    nxt = torch.stack([ids[0, 13:17], ids[1, 11:15]])
    out = ours(nxt, cache=cache)
    assert (out.logits[0] - ref[0, 13:17]).abs().max() <= 1e-4
    assert (out.logits[1] - ref[1, 11:15]).abs().max() <= 1e-4


def test_tree_mask_verifies_two_branches_in_one_pass(pair):
    hf, ours = pair
    torch.manual_seed(2)
    ctx = torch.randint(0, 97, (1, 12))
    a, b = torch.randint(0, 97, (1, 3)), torch.randint(0, 97, (1, 2))
    # tree: root r (=ctx's next token), branch A = r a0 a1 a2, branch B = r b0 b1  -> nodes [r, a0, a1, a2, b0, b1]
    r = torch.randint(0, 97, (1, 1))
    nodes = torch.cat([r, a, b], dim=1)
    parent = [-1, 0, 1, 2, 0, 4]
    depth = [0, 1, 2, 3, 1, 2]
    T = len(parent)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    cache = ours.new_cache(1, 40)
    ours(ctx, cache=cache)
    cache.crop(torch.tensor([12]))
    out = ours(nodes, cache=cache, positions=12 + torch.tensor([depth]), new_mask=mask[None])
    ref_a = hf(torch.cat([ctx, r, a], 1)).logits[0, 12:]
    ref_b = hf(torch.cat([ctx, r, b], 1)).logits[0, 12:]
    assert (out.logits[0, [0, 1, 2, 3]] - ref_a).abs().max() <= 1e-4
    assert (out.logits[0, [0, 4, 5]] - ref_b).abs().max() <= 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    hf = _hf("qwen3", False)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, ks in shards.items():
        save_file({k: state[k] for k in ks}, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    hf.config.save_pretrained(str(tmp_path))
    ours = load_target(tmp_path, dtype="float32", device="cpu")
    ids = torch.randint(0, 97, (1, 16))
    assert (ours(ids).logits - hf(ids).logits).abs().max() <= 1e-4


def test_missing_target_path_is_a_user_error(tmp_path):
    with pytest.raises(SpecdraftError, match="does not exist"):
        load_target(tmp_path / "missing")
