"""Shared fixtures: tiny random targets/drafters built from configs (never downloaded), offline env, GPU skip."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any kernel-module import
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from specdraft.runtime.drafter_io import build_drafter, drafter_config_for_target
from specdraft.runtime.models.target import TargetArgs, TargetLM

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")


def tiny_target_args(vocab: int = 64, layers: int = 4, model_type: str = "qwen3", tied: bool = True) -> TargetArgs:
    return TargetArgs(model_type=model_type, vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      tie_word_embeddings=tied)


def make_target(seed: int = 0, vocab: int = 64, layers: int = 4, std: float = 0.3, **kw) -> TargetLM:
    """A random tiny target with peaked distributions (large init) so greedy paths are well separated."""
    torch.manual_seed(seed)
    t = TargetLM(tiny_target_args(vocab, layers, **kw))
    for p in t.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=std)
    return t.eval()


def make_drafter(target: TargetLM, seed: int = 1, block_size: int = 6, layers: int = 2, mask_token_id: int | None = None):
    torch.manual_seed(seed)
    mask = target.args.vocab_size - 1 if mask_token_id is None else mask_token_id
    d = build_drafter(drafter_config_for_target(target.args, mask, num_layers=layers, block_size=block_size,
                                                num_features=2))
    return d.bind_target(target.model.embed_tokens, target.lm_head).eval()


@pytest.fixture
def target():
    return make_target()


@pytest.fixture
def drafter(target):
    return make_drafter(target)
