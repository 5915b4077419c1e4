"""How a decode job decodes, built from the config alone, once per process (the local job, or each Ray actor): the
target and drafter on the configured backend, the tree (D²SD's or one-pass), the engine (the eager one, or the
static/CUDA-graph path), the adaptive policy, sampling and batching. Every runner decodes every method through
:func:`build_decoding`."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from specdraft.pipeline.config import RunConfig
from specdraft.pipeline.exports import backend_models, check_engine_tokens
from specdraft.pipeline.policy import adaptive_policy, heldin_prompts, machine_costs
from specdraft.pipeline.tokenizer import stop_token_ids
from specdraft.pipeline.trees import merged_drafting, one_pass_drafting, tree_drafting
from specdraft.runtime.batch_job import Decoding
from specdraft.runtime.decode import GenerationConfig
from specdraft.runtime.drafter_io import load_drafter
from specdraft.runtime.load import load_target
from specdraft.runtime.merged import samples_drafts
from specdraft.runtime.sampling import SamplingParams
from specdraft.runtime.static_decode import StaticEngine


def default_drafter_dir(cfg: RunConfig) -> Path:
    """``decode.drafter``, else this config's training export (``train.export_name`` or the stage)."""
    return cfg.named_drafter_dir(cfg.decode.drafter) if cfg.decode.drafter else cfg.drafter_dir(cfg.train.export)


def build_decoding(cfg: RunConfig, world, drafter_dir: Path | None, tokenizer, device: str | None = None,
                   log=print) -> Decoding:
    """The :class:`Decoding` of ``cfg.decode`` with the drafter in ``drafter_dir`` (None: the target alone), the
    target on ``device`` (default ``target.device``)."""
    d = cfg.decode
    if d.backend == "torch":
        target = load_target(world.target_dir, dtype=cfg.target.dtype, device=device or cfg.target.device)
        drafter = load_drafter(drafter_dir, target) if drafter_dir else None
    else:  # the exports of the configured drafter hold the target too (for AR as well)
        target, drafter = backend_models(d.backend, drafter_dir or default_drafter_dir(cfg), world,
                                         with_drafter=drafter_dir is not None)

    def prices(tokens: tuple[int, ...]):  # a measured node budget's: the machine's costs, beside the policy's
        if d.backend == "trt":  # the engine's profile must hold the passes the costs time
            check_engine_tokens(drafter_dir or default_drafter_dir(cfg), max(tokens), "tree_nodes",
                                "the tree verifies")
        return machine_costs(cfg.work_path, target, drafter, drafter_dir, (d.batch_size,), tokens, log=log)

    tree = None
    one_pass = d.method == "ddtree" or d.method == "merged" and samples_drafts(
        SamplingParams(d.temperature, d.top_k, d.top_p), d.draft_sampling)
    if d.method in ("d2sd", "merged") and not one_pass:
        # on an engine backend the second drafter is read from its own export too
        load = None if d.backend == "torch" else lambda where: backend_models(d.backend, where, world,
                                                                               with_target=False)[1]
        tree = tree_drafting(cfg, target, drafter, load=load)
        if d.method == "merged":
            tree = merged_drafting(cfg, drafter, tree, prices=prices)
        if d.backend == "trt":  # the branches are one draft pass of tree_k blocks: the engine's profile must hold it
            check_engine_tokens(cfg.second_drafter_dir() or drafter_dir or default_drafter_dir(cfg),
                                tree.num_branches * tree.second.block_size, "tree_k", "the branches draft")
    if one_pass:
        tree = one_pass_drafting(cfg, drafter, prices=prices)
        if d.method == "merged":
            log(f"decode: merged at temperature {d.temperature:g} with sampled drafts verifies the one-pass tree of "
                f"{d.tree_nodes} nodes; its second drafter is not loaded (draft_sampling=greedy: the merged tree of "
                "ranked tokens)")
    if tree is not None and d.backend == "trt":  # so is the target's verify pass over the tree's nodes
        check_engine_tokens(drafter_dir or default_drafter_dir(cfg), tree.max_nodes(drafter.block_size),
                            "tree_nodes" if d.method != "d2sd" else "tree_k",
                            "the tree verifies")
    gen = GenerationConfig(max_new_tokens=d.max_new_tokens, stop_token_ids=stop_token_ids(tokenizer),
                           sampling=SamplingParams(d.temperature, d.top_k, d.top_p), draft_sampling=d.draft_sampling)
    generator = torch.Generator(device=target.lm_head.weight.device).manual_seed(d.seed)
    policy = None
    if d.policy == "adaptive":
        policy = adaptive_policy(cfg.work_path, target, drafter, drafter_dir,
                                 heldin_prompts(world, tokenizer, cfg.data.enable_thinking), stop_token_ids(tokenizer),
                                 (d.batch_size,), log, gen.sampling, d.draft_sampling)
        # a tree round is drafted whole, by every row; the static path drafts every row's whole block too
        policy.whole_rounds = tree is not None or d.cuda_graphs
    heads = d.temperature == 0 and d.method != "retrace"  # greedy: the fused argmax (ReTrace's prior reads logits)
    engine = StaticEngine(target, drafter, d.batch_size, tree=tree, policy=policy, argmax_heads=heads) \
        if d.cuda_graphs else None
    return Decoding(target, gen, d.batch_size, drafter, generator, tree, engine, policy, d.batching,
                    d.prefill_chunk or None)


def worker_decoding(cfg: RunConfig, world, drafter_dir: str | None, device: str) -> Decoding:
    """:func:`build_decoding` in a worker process (a Ray actor): its own tokenizer, the worker's device."""
    tokenizer = AutoTokenizer.from_pretrained(str(world.target_dir), trust_remote_code=False)
    return build_decoding(cfg, world, Path(drafter_dir) if drafter_dir else None, tokenizer, device,
                          log=lambda m: None)
