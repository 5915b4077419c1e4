"""Engine costs on the embedded target (the runtime): ratios measured in one process, interleaved.

1. AR tokens/s of our engine vs ``transformers`` ``generate`` (same target weights, greedy, exactly N new tokens).
2. Cost of one speculative round (draft + verify a block of Bk) over one AR step (verify of 1 token).
3. ReTrace's per-round fusion overhead: a round with an active ReTrace fusion over the same DFlash backbone.
All at batch 1 and batch 8. Prefill is measured separately and subtracted. Each repeat is one interleaved cycle
(prefill, AR, speculative, HF); ratios are per cycle, reported as the median and range over cycles.

    python benchmarks/engine_costs.py configs/tiny.yaml [--drafter DIR] [--new-tokens 128] [--repeats 3] [key=value]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdraft.pipeline.config import load_config
from specdraft.pipeline.measure import fusion_overhead_ms, write_report
from specdraft.pipeline.stages import default_drafter_dir, existing_world
from specdraft.runtime.batch_job import read_requests
from specdraft.runtime.chat import encode_chat
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import build_drafter, convert_drafter, drafter_config_for_target, load_drafter
from specdraft.runtime.load import load_target
from specdraft.runtime.phase_clock import wall_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--drafter", default="", help="drafter dir (default: the run's exported drafter, else fresh)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    args, overrides = ap.parse_known_args()  # plus dotted config overrides, e.g. drafter.num_layers=1
    if args.threads:
        torch.set_num_threads(args.threads)


    cfg = load_config(args.config, overrides)
    world = existing_world(cfg)
    target = load_target(world.target_dir, dtype="float32", device="cpu")
    tok = AutoTokenizer.from_pretrained(str(world.target_dir))
    ddir = args.drafter or default_drafter_dir(cfg)
    try:
        drafter = load_drafter(ddir, target)
        drafter_src = str(ddir)
    except Exception:  # cost does not depend on the weights: a fresh drafter of the configured shape
        dcfg = drafter_config_for_target(target.args, tok.mask_token_id, cfg.drafter.num_layers,
                                         cfg.drafter.block_size, num_features=cfg.drafter.num_features or None)
        drafter = build_drafter(dcfg).bind_target(target.model.embed_tokens, target.lm_head).eval()
        drafter_src = "fresh (untrained) drafter of the configured shape"

    retrace = convert_drafter(drafter, "retrace").eval()
    torch.nn.init.normal_(retrace.retrace_gate_out.weight, std=0.02)  # fusion active (W_o = 0 would skip nothing)
    hf = AutoModelForCausalLM.from_pretrained(str(world.target_dir), dtype=torch.float32).eval()
    reqs = read_requests(world.bench_dir / "math.jsonl", lambda m: None)[:8]
    prompts = [encode_chat(tok, r.messages) for r in reqs]
    N = args.new_tokens
    out = {"drafter": drafter_src, "block_size": drafter.block_size, "new_tokens": N,
           "threads": torch.get_num_threads()}

    for bs in (1, 8):
        batch = prompts[:bs]
        gen = GenerationConfig(max_new_tokens=N)  # no stop tokens: exactly N tokens per row
        spec_res = generate(target, batch, gen, drafter=drafter)
        rounds = max(len(r.accept_lengths) for r in spec_res)

        tok.padding_side = "left"
        width = max(len(p) for p in batch)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in batch])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in batch])[:, None]).long()

        def hf_generate():
            with torch.inference_mode():
                hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                            pad_token_id=tok.pad_token_id)

        # one cycle = prefill, AR, speculative, HF back to back; ratios are taken within a cycle (the machine's
        # load drifts between cycles) and the median over cycles is reported with its range
        cycles = []
        for _ in range(args.repeats):
            prefill = wall_seconds(lambda: generate(target, batch, GenerationConfig(max_new_tokens=1)))
            ar_s = wall_seconds(lambda: generate(target, batch, gen))
            spec_s = wall_seconds(lambda: generate(target, batch, gen, drafter=drafter))
            hf_s = wall_seconds(hf_generate)
            ar_step, spec_round = (ar_s - prefill) / (N - 1), (spec_s - prefill) / rounds
            cycles.append({"ours_over_hf": hf_s / ar_s, "round_over_ar_step": spec_round / ar_step,
                           "ar_step_ms": 1000 * ar_step, "spec_round_ms": 1000 * spec_round,
                           "ours_ar_tokens_per_s": bs * N / ar_s, "hf_generate_tokens_per_s": bs * N / hf_s})
        # ReTrace's extra work per round, on tensors of a real round's shapes (n = 2 accepted): its ingest fuses
        # the rejected rows' target features too, it retains the suffix (next_round_state) and fuses it into the next
        # block's inputs (block_embeds). Measured as the difference to the same DFlash steps (ingest + block embeds).
        diffs = [d / 1000 for d in fusion_overhead_ms(drafter, retrace, target, bs, tok.mask_token_id,
                                                        n_pairs=max(15, 2 * args.repeats))]
        fusion = statistics.median(diffs)  # interleaved pairs, like the cycles above
        res = {k: statistics.median(c[k] for c in cycles) for k in cycles[0]}
        res["round_over_ar_step_range"] = [min(c["round_over_ar_step"] for c in cycles),
                                           max(c["round_over_ar_step"] for c in cycles)]
        res["ours_over_hf_range"] = [min(c["ours_over_hf"] for c in cycles), max(c["ours_over_hf"] for c in cycles)]
        res["spec_rounds"] = rounds
        res["retrace_fusion_ms"] = 1000 * fusion
        res["retrace_fusion_ms_quartiles"] = [1000 * q for q in statistics.quantiles(diffs, n=4)[::2]]
        res["retrace_fusion_share_of_round"] = fusion / (res["spec_round_ms"] / 1000 + fusion)
        out[f"bs{bs}"] = res
    write_report(out)


if __name__ == "__main__":
    main()
