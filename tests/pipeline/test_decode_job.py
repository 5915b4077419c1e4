"""`specdraft decode` and `init-drafter` end to end on a seconds-sized world: the JSONL contract, malformed lines,
resume without duplicates or losses, vocab mismatch refused before compute."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from specdraft.errors import SpecdraftError
from specdraft.lit_modules.data import tokenize_conversation
from specdraft.pipeline.cli import main
from specdraft.pipeline.stages import load_note
from specdraft.pipeline.tokenizer import format_chat
from specdraft.runtime import batch_job
from specdraft.runtime.batch_job import Request, done_ids, read_requests
from specdraft.runtime.chat import encode_chat
from specdraft.runtime.decode import GenerationConfig, RowResult, generate
from specdraft.runtime.drafter_io import convert_drafter, load_drafter, record_target, save_drafter
from specdraft.runtime.load import load_target


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


@pytest.fixture
def drafter_dir(tiny_world, tmp_path):
    out = tmp_path / "drafter"
    assert main(["init-drafter", "--target", str(tiny_world.target_dir), "--out", str(out), "--layers", "1",
                 "--block-size", "4"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] and "mask_token_id" in cfg["dflash_config"]
    return out


def _three_prompts(path):
    """A JSONL of three requests, ids ``0`` to ``2``: a sentence, two sentences, one word."""
    _write(path, [json.dumps({"id": str(i), "prompt": p}) for i, p in
                  enumerate(["Mia has 3 apples.", "Tom has 12 coins. Then Tom finds 4 more coins.", "Ava"])])
    return path


def _rows(path) -> dict:
    """A job's output rows by id, without ``time_s`` (a wall time: it differs run to run)."""
    rows = map(json.loads, path.read_text().splitlines())
    return {r["id"]: {k: v for k, v in r.items() if k != "time_s"} for r in rows}


def _args(world, drafter, tmp_path, *extra):
    return ["configs/tiny.yaml", f"target.path={world.target_dir}", f"decode.drafter={drafter}",
            "tracking.enabled=false", f"work_dir={tmp_path / 'work'}", "decode.max_new_tokens=12",
            "decode.batch_size=2", *extra]


def test_decode_contract_malformed_lines_and_resume(tiny_world, drafter_dir, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, ['{"id": "a", "prompt": "Mia has 3 apples."}',
                 '{"id": "b", "prompt": ',  # line 2: broken JSON
                 '{"prompt": "no id"}',  # line 3: no id
                 '{"id": "c", "messages": [{"role": "user", "content": "Tom has 5 coins."}]}',
                 '',
                 '{"id": "d", "prompt": "Ben has 9 cards."}'])
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path), "--input", str(inp), "--output", str(out)]) == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "in.jsonl:2" in err and "in.jsonl:3" in err
    assert "decode: 3 requests (0 already done, 0 skipped, 2 bad lines)" in captured.out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == ["a", "c", "d"]
    for r in rows:
        assert set(r) == {"id", "completion", "num_tokens", "finish_reason", "accept_lengths", "tau", "time_s"}
        assert r["finish_reason"] == "length" if r["num_tokens"] == 12 else r["finish_reason"] == "stop"
        assert 1 <= r["num_tokens"] <= 12 and r["tau"] >= 1.0 and all(1 <= a <= 4 for a in r["accept_lengths"])

    # simulate an interruption: drop one finished row and leave a torn half line, then rerun
    lines = out.read_text().splitlines()
    out.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path), "--input", str(inp), "--output", str(out)]) == 0
    rows2 = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows2) == ["a", "c", "d"]  # nothing lost, nothing duplicated
    assert rows2[0] == rows[0]


def test_greedy_decode_job_equals_ar_job(tiny_world, drafter_dir, tmp_path):
    inp = tmp_path / "in.jsonl"
    _three_prompts(inp)
    outs = {}
    modes = {"false": [], "true": ["decode.cuda_graphs=true", "decode.batching=static"],
             "static": ["decode.batching=static"], "adaptive": ["decode.policy=adaptive"],
             "adaptive-graphs": ["decode.policy=adaptive", "decode.cuda_graphs=true", "decode.batching=static"]}
    tree = ["decode.second_drafter=same", "decode.tree_k=2"]  # D²SD with the first drafter re-drafting
    for method, graphs in (("ar", "false"), ("dflash", "false"), ("dflash", "true"), ("ar", "true"),
                           ("dflash", "static"), ("dflash", "adaptive"), ("d2sd", "static"), ("d2sd", "true"),
                           ("ddtree", "false"), ("ddtree", "static"), ("ddtree", "true"), ("ddtree", "adaptive"),
                           ("d2sd", "adaptive"), ("dflash", "adaptive-graphs"), ("ddtree", "adaptive-graphs"),
                           ("d2sd", "adaptive-graphs"), ("merged", "static"), ("merged", "true"),
                           ("merged", "adaptive")):
        outs[method, graphs] = tmp_path / f"{method}-{graphs}.jsonl"
        extra = {"d2sd": tree, "ddtree": ["decode.tree_nodes=6"], "merged": [*tree, "decode.tree_nodes=8"]}.get(
            method, [])
        assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path, f"decode.method={method}", *modes[graphs],
                                      *extra), "--input", str(inp), "--output", str(outs[method, graphs])]) == 0
    comp = {m: {json.loads(line)["id"]: json.loads(line)["completion"]
                for line in p.read_text().splitlines()} for m, p in outs.items()}
    assert comp["ar", "false"] == comp["dflash", "false"] == comp["dflash", "true"] == comp["ar", "true"]
    assert comp["dflash", "adaptive"] == comp["ar", "false"] == comp["dflash", "static"]
    adaptive = [json.loads(line) for line in outs["dflash", "adaptive"].read_text().splitlines()]
    assert all(len(r["verified"]) == len(r["accept_lengths"]) and all(0 <= v <= 3 for v in r["verified"])
               for r in adaptive)  # the chosen drafts per round, in each request's stats
    assert len(list((tmp_path / "work" / "policy").glob("*.json"))) == 1  # costs measured once, cached
    again = tmp_path / "adaptive-again.jsonl"  # a second job reads the cached costs and calibration
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path, *modes["adaptive"]), "--input", str(inp),
                 "--output", str(again)]) == 0
    assert {json.loads(line)["id"]: json.loads(line)["completion"] for line in again.read_text().splitlines()} \
        == comp["dflash", "adaptive"]
    assert len(list((tmp_path / "work" / "policy").glob("*.json"))) == 1
    assert comp["d2sd", "static"] == comp["d2sd", "true"] == comp["ar", "false"] == comp["ddtree", "false"]
    assert comp["ddtree", "true"] == comp["ar", "false"] == comp["ddtree", "adaptive"] == comp["d2sd", "adaptive"]
    assert comp["ar", "false"] == comp["dflash", "adaptive-graphs"] == comp["ddtree", "adaptive-graphs"] \
        == comp["d2sd", "adaptive-graphs"] == comp["merged", "static"] == comp["merged", "true"] \
        == comp["merged", "adaptive"]
    for method, mode in (("ddtree", "adaptive"), ("d2sd", "adaptive"), ("dflash", "adaptive-graphs"),
                         ("ddtree", "adaptive-graphs"), ("d2sd", "adaptive-graphs"), ("merged", "adaptive")):
        # a plain round or a whole tree (or block) round, and the tree's statistics every round
        rows = [json.loads(line) for line in outs[method, mode].read_text().splitlines()]
        assert all(set(r["verified"]) <= {0, 3} and len(r["verified"]) == len(r["accept_lengths"]) for r in rows)
    tau = {(m, g): {json.loads(line)["id"]: json.loads(line)["tau"] for line in outs[m, g].read_text().splitlines()}
           for m, g in (("dflash", "true"), ("dflash", "false"), ("d2sd", "true"), ("d2sd", "static"),
                        ("ddtree", "true"), ("ddtree", "static"), ("merged", "true"), ("merged", "static"))}
    assert tau["dflash", "true"] == tau["dflash", "false"]  # the static path drafts what the eager engine drafts
    assert tau["d2sd", "true"] == tau["d2sd", "static"]  # and builds the same trees
    assert tau["ddtree", "true"] == tau["ddtree", "static"]
    assert tau["merged", "true"] == tau["merged", "static"]


def test_a_merged_job_of_sampled_drafts_is_the_one_pass_job(tiny_world, drafter_dir, tmp_path, capsys):
    """At T>0 with sampled drafts a merged job verifies the one-pass tree of its budget: the rows a ddtree job of the
    same seed writes, and a line that says so."""
    inp = tmp_path / "in.jsonl"
    _three_prompts(inp)
    rows = {}
    for method, extra in (("ddtree", []), ("merged", ["decode.second_drafter=same", "decode.tree_k=2"])):
        out = tmp_path / f"{method}.jsonl"
        assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path, f"decode.method={method}",
                                      "decode.temperature=1", "decode.tree_nodes=8", *extra),
                     "--input", str(inp), "--output", str(out)]) == 0
        rows[method] = [{k: r[k] for k in ("id", "completion", "tau")}
                        for r in map(json.loads, out.read_text().splitlines())]
    assert rows["merged"] == rows["ddtree"]
    captured = capsys.readouterr()
    assert "merged at temperature 1 with sampled drafts verifies the one-pass tree" in captured.out + captured.err


def test_a_retrace_job_on_the_static_path_writes_the_eager_jobs_rows(tiny_world, drafter_dir, tmp_path):
    """decode.cuda_graphs with a ReTrace drafter (an active fusion: its prior changes the drafts): the static rounds
    carry the prior as the eager engine does; under the adaptive policy, eager or static, the job writes the same
    completions."""
    target = load_target(tiny_world.target_dir)
    retrace = convert_drafter(load_drafter(drafter_dir, target), "retrace")
    with torch.no_grad():
        torch.manual_seed(0)
        torch.nn.init.normal_(retrace.retrace_gate_out.weight, std=0.5)
    out = save_drafter(retrace, tmp_path / "retrace")
    record_target(out, tiny_world.target_dir)
    inp = tmp_path / "in.jsonl"
    _three_prompts(inp)
    rows = {}
    for mode in ("decode.cuda_graphs=false", "decode.cuda_graphs=true", "decode.policy=adaptive",
                 "decode.policy=adaptive decode.cuda_graphs=true"):
        path = tmp_path / f"{len(rows)}.jsonl"
        assert main(["decode", *_args(tiny_world, out, tmp_path, "decode.method=retrace", "decode.batching=static",
                                      *mode.split()), "--input", str(inp), "--output", str(path)]) == 0
        rows[mode] = _rows(path)
    assert rows["decode.cuda_graphs=true"] == rows["decode.cuda_graphs=false"]  # completions and accept lengths
    for mode in ("decode.policy=adaptive", "decode.policy=adaptive decode.cuda_graphs=true"):
        adaptive = rows[mode]
        assert {i: r["completion"] for i, r in adaptive.items()} == {
            i: r["completion"] for i, r in rows["decode.cuda_graphs=false"].items()}
        assert all(len(r["verified"]) == len(r["accept_lengths"]) and all(0 <= v <= 3 for v in r["verified"])
                   for r in adaptive.values())  # the widths the policy chose, within the block


def test_a_continuous_job_killed_mid_way_resumes_with_every_request_once_and_its_own_cap(tiny_world, drafter_dir,
                                                                                           tmp_path, monkeypatch,
                                                                                           capsys):
    """Continuous batching (2 slots, prompts prefilled 3 tokens per round) writes each request as it ends; a job
    killed after three rows resumes, and the output equals an uninterrupted static job's, request caps honoured."""
    inp = tmp_path / "in.jsonl"
    prompts = ["Mia has 3 apples.", "Tom has 12 coins. Then Tom finds 4 more coins.", "Ava", "Ben has 7 pens.",
               "Zoe reads 9 pages.", "Kim has 2 cats. Then Kim finds 5 more cats.", "Leo", "Sam has 4 hats."]
    caps = [2, 12, 4, 12, 1, 12, 3, 12]
    _write(inp, [json.dumps({"id": f"r{i}", "prompt": p, "max_new_tokens": c})
                 for i, (p, c) in enumerate(zip(prompts, caps))]
           + ['{"id": "bad", "prompt": "x", "max_new_tokens": 0}'])
    static, cont = tmp_path / "static.jsonl", tmp_path / "continuous.jsonl"
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path, "decode.batching=static"), "--input", str(inp),
                 "--output", str(static)]) == 0
    assert "in.jsonl:9" in capsys.readouterr().err  # the bad cap is reported by line; the others are decoded
    real = batch_job.generate

    def killed(*args, on_result=None, **kw):  # dies as the fourth request ends (rows already written stay)
        def hook(i, res):
            if hook.n == 3:
                raise KeyboardInterrupt
            hook.n += 1
            on_result(i, res)
        hook.n = 0
        return real(*args, on_result=hook, **kw)

    monkeypatch.setattr(batch_job, "generate", killed)
    args = _args(tiny_world, drafter_dir, tmp_path, "decode.prefill_chunk=3")
    assert main(["decode", *args, "--input", str(inp), "--output", str(cont)]) == 130
    assert "rerun the same command to resume" in capsys.readouterr().err
    assert len(cont.read_text().splitlines()) == 3
    monkeypatch.setattr(batch_job, "generate", real)
    assert main(["decode", *args, "--input", str(inp), "--output", str(cont)]) == 0
    rows = [json.loads(line) for line in cont.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(f"r{i}" for i in range(8))  # each once: none lost, none twice
    want = {json.loads(line)["id"]: json.loads(line) for line in static.read_text().splitlines()}
    for r in rows:
        assert r["completion"] == want[r["id"]]["completion"] and r["num_tokens"] <= caps[int(r["id"][1:])]
    assert any(r["num_tokens"] == 12 for r in rows) and any(r["num_tokens"] <= 2 for r in rows)


def test_empty_input_is_a_clean_error(tiny_world, drafter_dir, tmp_path, capsys):
    inp = tmp_path / "empty.jsonl"
    inp.write_text("\n")
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path), "--input", str(inp),
                 "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no valid requests" in err[0]


def test_a_ray_job_under_torchrun_is_refused_in_one_line(tiny_world, drafter_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # every rank would start its own driver over its own shard
    inp = tmp_path / "in.jsonl"
    _write(inp, ['{"id": "a", "prompt": "hi"}'])
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path, "decode.runner=ray"), "--input", str(inp),
                 "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "decode.runner" in err[0] and "torchrun" in err[0]


def test_vocab_mismatch_refused_before_compute(tiny_world, drafter_dir, tmp_path, capsys):
    cfg = json.loads((drafter_dir / "config.json").read_text())
    cfg["vocab_size"] += 1
    (drafter_dir / "config.json").write_text(json.dumps(cfg))
    inp = tmp_path / "in.jsonl"
    _write(inp, ['{"id": "a", "prompt": "hi"}'])
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path), "--input", str(inp),
                 "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "vocab size" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_read_requests_and_done_ids(tmp_path):
    p = tmp_path / "x.jsonl"
    _write(p, ['{"id": 1, "prompt": "a"}', '[1, 2]', '{"id": 1, "prompt": "dup"}', '{"id": 2, "prompt": "  "}'])
    warnings = []
    reqs = read_requests(p, warnings.append)
    assert [r.id for r in reqs] == ["1"] and len(warnings) == 3
    assert any(":2:" in w for w in warnings) and any("duplicate" in w for w in warnings)
    o = tmp_path / "o.jsonl"
    o.write_text('{"id": "1"}\n{"id": "2"')
    assert done_ids(o) == {"1"}


def test_training_data_and_decode_encode_the_same_prompt_ids(tiny_world, tmp_path, monkeypatch):
    """The drafter trains on exactly the prompt ids it serves: the data module's prompt part equals what a decode
    job hands the engine."""
    tok = AutoTokenizer.from_pretrained(str(tiny_world.target_dir))
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    ids, mask = tokenize_conversation(tok, messages + [{"role": "assistant", "content": "12 + 30 = 42."}])
    trained_prompt = ids[: mask.index(1)]
    seen = []

    def engine(target, prompts, gen, **kw):
        seen.extend(prompts)
        return [RowResult([], [], "stop", 0.0) for _ in prompts]

    monkeypatch.setattr(batch_job, "generate", engine)
    batch_job.run_batch_job([Request("a", messages, 1)], tmp_path / "out.jsonl", tok,
                            batch_job.Decoding(None, GenerationConfig(), 1))
    assert seen == [trained_prompt] and len(trained_prompt) > 5


def test_the_worlds_corpus_text_is_what_the_chat_template_renders(tiny_world):
    tok = AutoTokenizer.from_pretrained(str(tiny_world.target_dir))
    user = [{"role": "user", "content": "What is 2 + 2?\nShow the steps."}]
    both = user + [{"role": "assistant", "content": "2 + 2 = 4."}]
    assert format_chat(user[0]["content"]) == tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert format_chat(user[0]["content"], "2 + 2 = 4.") == tok.apply_chat_template(both, tokenize=False)


def _target_copy(world, tmp_path, **config_updates):
    """A copy of the world's target whose config.json gets ``config_updates``."""
    t = tmp_path / "target-copy"
    shutil.copytree(world.target_dir, t)
    cfg = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps({**cfg, **config_updates}))
    return t


def test_base_model_without_chat_template_decodes_prompts_as_plain_text(tiny_world, drafter_dir, tmp_path, capsys):
    t = _target_copy(tiny_world, tmp_path)
    (t / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((t / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (t / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    assert not AutoTokenizer.from_pretrained(str(t)).chat_template
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, ['{"id": "a", "prompt": "Mia has 3 apples."}',
                 '{"id": "m", "messages": [{"role": "user", "content": "Tom has 5 coins."}]}'])
    args = _args(tiny_world, drafter_dir, tmp_path, f"target.path={t}")
    assert main(["decode", *args, "--input", str(inp), "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert "no chat template" in err and "'m' (line 2)" in err and "Traceback" not in err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a"]


def test_a_corrupt_checkpoint_is_one_line_naming_the_file_and_nothing_is_written(tiny_world, drafter_dir, tmp_path,
                                                                                  capsys):
    bad = tmp_path / "bad-drafter"
    shutil.copytree(drafter_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a truncated copy
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, ['{"id": "a", "prompt": "Mia has 3 apples."}'])
    assert main(["decode", *_args(tiny_world, bad, tmp_path), "--input", str(inp), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(weights) in err[0] and "Traceback" not in err[0]
    assert not out.exists()


def test_a_prompt_longer_than_the_targets_context_is_reported_and_the_others_written(tiny_world, drafter_dir,
                                                                                      tmp_path, capsys):
    t = _target_copy(tiny_world, tmp_path, max_position_embeddings=40)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, ['{"id": "short", "prompt": "Mia has 3 apples."}',
                 '{"id": "long", "prompt": "' + "Tom has 5 coins and gives 2 away. " * 12 + '"}'])
    args = _args(tiny_world, drafter_dir, tmp_path, f"target.path={t}", "decode.max_new_tokens=30")
    assert main(["decode", *args, "--input", str(inp), "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert "'long' (line 2)" in err and "context is 40" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["short"]
    prompt_len = len(AutoTokenizer.from_pretrained(str(t)).apply_chat_template(
        [{"role": "user", "content": "Mia has 3 apples."}], add_generation_prompt=True, tokenize=True)["input_ids"])
    assert prompt_len + rows[0]["num_tokens"] <= 40  # generation stops at the context
    assert rows[0]["finish_reason"] == ("context" if prompt_len + rows[0]["num_tokens"] == 40 else "stop")


def test_a_base_model_trains_on_the_prompt_ids_its_decode_job_serves(tiny_world, tmp_path, monkeypatch):
    t = _target_copy(tiny_world, tmp_path)
    (t / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((t / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (t / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    tok = AutoTokenizer.from_pretrained(str(t))
    ids, mask = tokenize_conversation(tok, [{"role": "user", "content": "Mia has 3 apples."},
                                            {"role": "assistant", "content": "She has 3."}])
    served = batch_job.encode_requests([Request("a", [], 1, "Mia has 3 apples.")], tok, None, warn=lambda m: None)
    prompt_len = mask.index(1)
    assert ids[:prompt_len] == served[0][1] and ids[-1] == tok.eos_token_id and all(mask[prompt_len:])
    with pytest.raises(ValueError, match="chat template"):
        tokenize_conversation(tok, [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])


@pytest.mark.integration
def test_a_torchrun_sharded_job_writes_every_id_once_and_merges_in_input_order(tiny_world, drafter_dir, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = ["Mia has 3 apples.", "Tom has 12 coins. Then Tom finds 4 more coins.", "Ava", "Ben has 7 pens.",
               "Zoe reads 9 pages.", "Kim has 2 cats. Then Kim finds 5 more cats.", "Leo"]
    _write(inp, [json.dumps({"id": f"r{i}", "prompt": p}) for i, p in enumerate(prompts)] + ["{not json"])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29577",
           "-m", "specdraft.pipeline.cli", "decode", *_args(tiny_world, drafter_dir, tmp_path), "--input", str(inp),
           "--output", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    shards = [json.loads(line)["id"] for r in (0, 1) for line in (tmp_path / f"out.jsonl.rank{r}").read_text(
        ).splitlines()]
    assert sorted(shards) == sorted(f"r{i}" for i in range(len(prompts)))  # every id once, across the shards
    assert main(["merge", "--input", str(inp), "--output", str(out)]) == 0
    merged = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in merged] == [f"r{i}" for i in range(len(prompts))]  # the input's order
    single = tmp_path / "single.jsonl"
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path), "--input", str(inp), "--output",
                 str(single)]) == 0
    alone = {json.loads(line)["id"]: json.loads(line)["completion"] for line in single.read_text().splitlines()}
    assert {r["id"]: r["completion"] for r in merged} == alone  # greedy: sharding changes nothing
    assert main(["merge", "--input", str(inp), "--output", str(out)]) == 0  # merging again is idempotent
    assert [json.loads(line) for line in out.read_text().splitlines()] == merged


def test_merge_refuses_foreign_and_conflicting_rows_and_reports_missing_ones(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [json.dumps({"id": i, "prompt": "x"}) for i in ("a", "b", "c")])
    _write(tmp_path / "out.jsonl.rank0", [json.dumps({"id": "c", "completion": "3"}), '{"id": "a", "compl'])
    _write(tmp_path / "out.jsonl.rank1", [json.dumps({"id": "a", "completion": "1"})])
    warnings = []
    assert batch_job.merge_shards(inp, out, warnings.append) == {"rows": 2, "missing": 1, "shards": 2}
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "c"]
    assert any("torn" in w for w in warnings) and any("no result" in w and "b" in w for w in warnings)
    _write(tmp_path / "out.jsonl.rank1", [json.dumps({"id": "a", "completion": "other"})])
    with pytest.raises(SpecdraftError, match="two different results"):
        batch_job.merge_shards(inp, out, warnings.append)
    _write(tmp_path / "out.jsonl.rank1", [json.dumps({"id": "zz", "completion": "1"})])
    with pytest.raises(SpecdraftError, match="another input"):
        batch_job.merge_shards(inp, out, warnings.append)


def test_a_drafter_made_for_another_target_checkpoint_is_refused_before_compute(tiny_world, drafter_dir, tmp_path,
                                                                                capsys):
    """A sibling checkpoint of the same shapes with other weights: the drafter's recorded fingerprint does not match,
    so the torch backend refuses before loading anything; a deliberate reuse is allowed and said."""
    record = json.loads((drafter_dir / "specdraft.json").read_text())
    assert record["target_fingerprint"] and record["target"] == str(tiny_world.target_dir)
    sibling = _target_copy(tiny_world, tmp_path)
    weights = next(sibling.glob("*.safetensors"))
    state = load_file(str(weights))
    save_file({k: v + 0.01 for k, v in state.items()}, str(weights), metadata={"format": "pt"})  # other weights
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    _write(inp, ['{"id": 7, "prompt": "Mia has 3 apples."}'])
    args = _args(tiny_world, drafter_dir, tmp_path, f"target.path={sibling}")
    assert main(["decode", *args, "--input", str(inp), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"made for another target checkpoint (fingerprint {record['target_fingerprint']}" in err
    assert len(err.splitlines()) == 1 and not out.exists()
    assert main(["decode", *args, "decode.allow_other_target=true", "--input", str(inp), "--output", str(out)]) == 0
    assert "warning: the drafter in" in capsys.readouterr().out and len(out.read_text().splitlines()) == 1
    assert json.loads(out.read_text())["id"] == 7  # the id's type as given
    second = tmp_path / "second"  # D²SD's second drafter is checked too: one made for the sibling is refused
    assert main(["init-drafter", "--target", str(sibling), "--out", str(second), "--layers", "1",
                 "--block-size", "4"]) == 0
    capsys.readouterr()
    tree = _args(tiny_world, drafter_dir, tmp_path, "decode.method=d2sd", f"decode.second_drafter={second}",
                 "decode.tree_k=1")
    assert main(["decode", *tree, "--input", str(inp), "--output", str(tmp_path / "t.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"the drafter in {second} was made for another target checkpoint" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "t.jsonl").exists()


def test_a_resume_with_other_settings_is_refused_naming_the_keys_and_keeps_the_rows(tiny_world, drafter_dir,
                                                                                     tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    _write(inp, ['{"id": "a", "prompt": "Mia has 3 apples."}', '{"id": "b", "prompt": "Tom"}'])
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path), "--input", str(inp), "--output", str(out)]) == 0
    rows = out.read_text()
    capsys.readouterr()
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path, "decode.temperature=1.0",
                                  "decode.max_new_tokens=8"), "--input", str(inp), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "other settings" in err and "max_new_tokens: 12 then, 8 now" in err and "temperature: 0.0 then" in err
    assert out.read_text() == rows
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path), "--input", str(inp), "--output", str(out)]) == 0
    assert out.read_text() == rows  # the same settings resume
    assert "decode: nothing left to do" in capsys.readouterr().out


def test_a_second_writer_on_one_output_is_refused(tiny_world, drafter_dir, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    _write(inp, ['{"id": "a", "prompt": "Mia has 3 apples."}'])
    with batch_job.claim_output(out, {"job": "first"}):  # another job holds the output
        assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path), "--input", str(inp),
                     "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} is being written by another job (pid {os.getpid()})" in err
    assert not out.exists() or out.read_text() == ""


@pytest.mark.integration
def test_decode_jobs_track_in_their_own_experiment_and_a_sigtermed_job_is_killed(tiny_world, drafter_dir, tmp_path):
    """A decode job's MLflow run goes to ``<experiment>-jobs``, not to training's experiment; a job ended by SIGTERM
    (what a scheduler sends) is marked KILLED, not left RUNNING."""
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (the GPU image has none)")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    _write(inp, ['{"id": "a", "prompt": "Mia has 3 apples."}'])
    args = [a for a in _args(tiny_world, drafter_dir, tmp_path) if a != "tracking.enabled=false"]
    assert main(["decode", *args, "tracking.enabled=true", f"tracking.uri={uri}", "tracking.experiment=exp",
                 "--input", str(inp), "--output", str(out)]) == 0
    client = mlflow.MlflowClient(tracking_uri=uri)
    assert client.get_experiment_by_name("exp") is None
    jobs = client.search_runs([client.get_experiment_by_name("exp-jobs").experiment_id])
    assert [r.data.tags["stage"] for r in jobs] == ["decode"] and jobs[0].info.status == "FINISHED"
    code = ("import os, signal\nfrom specdraft.pipeline.cli import stop_on_sigterm\n"
            "from specdraft.pipeline.config import TrackingConfig\nfrom specdraft.pipeline.tracking import "
            "MLflowTracker\nstop_on_sigterm()\n"
            f"t = MLflowTracker(TrackingConfig(uri={uri!r}, experiment='killed'))\n"
            "try:\n    with t.run('job'):\n        os.kill(os.getpid(), signal.SIGTERM)\n        signal.pause()\n"
            "except KeyboardInterrupt:\n    print('stopped')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0 and "stopped" in run.stdout, run.stderr[-2000:]
    killed = client.search_runs([client.get_experiment_by_name("killed").experiment_id])
    assert [r.info.status for r in killed] == ["KILLED"]


def test_a_job_runs_on_the_threads_it_is_given_and_bench_names_a_busy_machine(tiny_world, drafter_dir, tmp_path):
    inp = tmp_path / "in.jsonl"
    _write(inp, ['{"id": "a", "prompt": "Mia has 3 apples."}'])
    before = torch.get_num_threads()
    try:
        assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path, "target.threads=1"), "--input", str(inp),
                     "--output", str(tmp_path / "o.jsonl")]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert load_note(1.5, 2) is None
    assert "load (3.2) is above its 2 cores" in load_note(3.2, 2)


def test_target_check_says_it_passes_and_decode_drafter_takes_an_export_name(tiny_world, drafter_dir, tmp_path,
                                                                             capsys):
    assert main(["target", "configs/tiny.yaml", f"target.path={tiny_world.target_dir}", "tracking.enabled=false",
                 f"work_dir={tmp_path / 'work'}"]) == 0
    assert f"target: {tiny_world.target_dir} passes: qwen3, " in capsys.readouterr().out
    shutil.copytree(drafter_dir, tmp_path / "work" / "drafter" / "mine")
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    _write(inp, ['{"id": "a", "prompt": "Mia has 3 apples."}'])
    args = [a for a in _args(tiny_world, drafter_dir, tmp_path) if not a.startswith("decode.drafter=")]
    assert main(["decode", *args, "decode.drafter=mine", "--input", str(inp), "--output", str(out)]) == 0
    assert json.loads(out.read_text())["tau"] >= 1.0
    assert main(["decode", *args, "decode.drafter=nosuch", "--input", str(inp), "--output", str(out)]) == 2
    assert "holds no drafter (no config.json): a drafter directory or an export name" in capsys.readouterr().err


def test_an_mt_bench_file_decodes_every_turn_after_the_answer_before_it(tiny_world, drafter_dir, tmp_path):
    """MT-Bench's question.jsonl as the input: a row per turn, turn 2 decoded on the conversation with turn 1's
    answer; greedy DFlash equals AR turn for turn, and a rerun finds every turn done."""
    inp = tmp_path / "question.jsonl"
    _write(inp, [json.dumps({"question_id": 81, "category": "math", "turns": ["Mia has 3 apples.", "Tom has 4."]}),
                 json.dumps({"question_id": 82, "category": "math", "turns": ["Ava has 2 coins."]})])
    rows = {}
    for method in ("ar", "dflash"):
        out = tmp_path / f"{method}.jsonl"
        assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path, f"decode.method={method}"), "--input",
                     str(inp), "--output", str(out)]) == 0
        rows[method] = {batch_job.row_key(r): r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows["ar"]) == ["81", "81#turn2", "82"] and rows["ar"]["81#turn2"]["turn"] == 2
    completions = {m: {k: r["completion"] for k, r in rows[m].items()} for m in rows}
    assert completions["ar"] == completions["dflash"]
    assert all(r["accept_lengths"] for r in rows["dflash"].values())  # every turn went through verify rounds
    tok = AutoTokenizer.from_pretrained(str(tiny_world.target_dir))
    chat = [{"role": "user", "content": "Mia has 3 apples."}, {"role": "assistant",
            "content": rows["ar"]["81"]["completion"]}, {"role": "user", "content": "Tom has 4."}]
    alone = generate(load_target(tiny_world.target_dir), [encode_chat(tok, chat)],
                     GenerationConfig(max_new_tokens=12, stop_token_ids=[tok.eos_token_id]))[0]
    assert tok.decode(alone.tokens, skip_special_tokens=True) == rows["ar"]["81#turn2"]["completion"]
    stats = main(["decode", *_args(tiny_world, drafter_dir, tmp_path, "decode.method=ar"), "--input", str(inp),
                  "--output", str(tmp_path / "ar.jsonl")])
    assert stats == 0 and len((tmp_path / "ar.jsonl").read_text().splitlines()) == 3  # nothing twice
