"""DFlash drafter directories: z-lab weight names and config keys, round trips, and refusals before compute."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from specdraft.errors import SpecdraftError
from specdraft.pipeline.drafter_init import init_drafter
from specdraft.runtime.drafter_io import (
    check_compatible,
    drafter_config_for_target,
    load_drafter,
    read_drafter_config,
    save_drafter,
)
from specdraft.runtime.models.dflash import DFlashConfig, build_target_layer_ids
from specdraft.runtime.models.layers import rope_inv_freq
from tests.helpers import make_drafter, make_target, tiny_target_args


def test_layer_ids_follow_zlab():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert build_target_layer_ids(36, 1) == [18]


def test_weight_names_and_config_keys_are_zlabs(tmp_path):
    target = make_target()
    d = make_drafter(target, layers=2)
    save_drafter(d, tmp_path)

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                     *(p + f"self_attn.{n}_proj.weight" for n in "qkvo"),
                     p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight",
                     *(p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down"))}
    assert keys == expected  # no embedding, no LM head: the drafter borrows the target's
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 6
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    assert cfg["num_target_layers"] == 4


def test_round_trip_gives_identical_drafts(tmp_path):
    target = make_target()
    d = make_drafter(target)
    save_drafter(d, tmp_path)
    d2 = load_drafter(tmp_path, target)
    for a, b in zip(d.state_dict().values(), d2.state_dict().values()):
        assert torch.equal(a, b)


def test_loads_a_zlab_style_config_without_our_extra_keys(tmp_path):
    target = make_target()
    d = make_drafter(target)
    save_drafter(d, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for k in ("target_hidden_size", "rope_parameters", "layer_types"):
        cfg.pop(k)
    cfg["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}  # z-lab ships remote code; we never run it
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch, dcfg = read_drafter_config(tmp_path)
    assert arch == "dflash" and dcfg.target_hidden_size == target.args.hidden_size
    assert dcfg.extra == {"auto_map": {"AutoModel": "dflash.DFlashDraftModel"}}
    load_drafter(tmp_path, target)


@pytest.mark.parametrize("field,value,msg", [
    ("vocab_size", 65, "vocab size"), ("hidden_size", 48, "hidden size"),
    ("target_layer_ids", [1, 9], "do not exist"), ("mask_token_id", 999, "mask_token_id"),
])
def test_mismatch_is_refused_with_a_clear_message(field, value, msg):
    target = make_target()
    cfg = make_drafter(target).config
    setattr(cfg, field, value)
    with pytest.raises(SpecdraftError, match=msg):
        check_compatible(cfg, target.args)


def test_init_drafter_refuses_a_tokenizer_larger_than_the_target(tiny_world, tmp_path):
    t = tmp_path / "target"
    shutil.copytree(tiny_world.target_dir, t)
    cfg = json.loads((t / "config.json").read_text())
    cfg["vocab_size"] = 100  # the tokenizer has more tokens than this
    (t / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdraftError, match="tokenizer has .* tokens but the target vocabulary has 100"):
        init_drafter(t, tmp_path / "d")


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_rope_scaling_survives_export_for_both_transformers_spellings(scaling):
    """transformers 5 reads ``rope_parameters``; 4.x (the reference DFlash code, vLLM, SGLang) reads ``rope_scaling``.
    Each spelling alone must bring back the same RoPE."""
    args = dataclasses.replace(tiny_target_args(), rope_theta=5e5, rope_scaling=scaling)
    cfg = drafter_config_for_target(args, 63, num_layers=1, block_size=4, num_features=2)
    hf = cfg.to_hf_config()
    assert hf["rope_scaling"] == scaling
    v4 = {k: v for k, v in hf.items() if k != "rope_parameters"}
    v5 = {k: v for k, v in hf.items() if k != "rope_scaling"}
    for seen in (v4, v5):
        back = DFlashConfig.from_hf_config(json.loads(json.dumps(seen)))
        assert back.rope_scaling == scaling and back.rope_theta == 5e5
        torch.testing.assert_close(rope_inv_freq(8, back.rope_theta, back.rope_scaling),
                                   rope_inv_freq(8, 5e5, scaling))


def test_a_corrupt_or_unsupported_drafter_config_is_one_clear_error(tmp_path):
    target = make_target()
    d = save_drafter(make_drafter(target), tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg)[:50])  # truncated JSON
    with pytest.raises(SpecdraftError, match="config.json"):
        read_drafter_config(d)
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdraftError, match="yarn"):
        read_drafter_config(d)


def test_a_drafter_for_a_llama_target_names_it_and_takes_its_context():
    args = dataclasses.replace(tiny_target_args(model_type="llama"), max_position_embeddings=512)
    cfg = drafter_config_for_target(args, mask_token_id=3, num_layers=1, block_size=4)
    hf = cfg.to_hf_config()
    assert hf["target_model_type"] == "llama" and hf["max_position_embeddings"] == 512
    assert DFlashConfig.from_hf_config(hf) == cfg  # the round trip keeps both
    assert drafter_config_for_target(tiny_target_args(), 3).max_position_embeddings == 40960  # unknown: Qwen3's
