"""`specdraft run` end to end on a micro world (corpora -> tokenizer -> target -> data -> train -> bench), CPU only,
no network (dialogue corpus off), plus the one-line errors a user sees for bad input."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.pipeline.cli import main
from specdraft.pipeline.data import regenerated_temperature
from specdraft.pipeline.train import check_resumable
from specdraft.runtime.drafter_io import convert_drafter, load_drafter, record_target, save_drafter
from specdraft.runtime.load import load_target

pytestmark = pytest.mark.integration  # `make test-fast` leaves it out

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
MICRO = [
    "data.math_problems=300", "data.code_files=6", "data.dialogue=false", "data.holdout_prompts=2",
    "data.train_prompts=48", "data.max_new_tokens=48", "data.batch_size=16", "data.temperature=1.0",
    "target.tiny.vocab_size=384", "target.tiny.hidden_size=64", "target.tiny.intermediate_size=128",
    "target.tiny.num_layers=4", "target.tiny.seq_len=64", "target.tiny.batch_size=8", "target.tiny.max_steps=25",
    "target.tiny.warmup_steps=2",
    "drafter.num_layers=1", "drafter.block_size=4", "drafter.num_features=2",
    "train.max_steps=8", "train.batch_size=4", "train.num_anchors=8", "train.eval_every=4", "train.eval_prompts=1",
    "train.max_seq_len=160",
    "bench.num_prompts=2", "bench.max_new_tokens=16", "bench.batch_sizes=[1,2]",
    "decode.top_k=20", "decode.top_p=0.9", "decode.draft_sampling=greedy",  # bench serves with the decode settings
]


@pytest.mark.slow
def test_run_end_to_end_and_rerun_is_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    args = ["run", TINY, f"work_dir={tmp_path / 'w'}", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}", *MICRO]
    assert main(args) == 0
    out = capsys.readouterr().out
    w = tmp_path / "w"
    world = next(w.glob("world-*"))
    report = json.loads((world / "report.json").read_text())
    assert set(report["heldout_loss"]) == {"math", "code"} and report["steps"] == 25
    assert (world / "bench" / "math.jsonl").is_file() and (w / "data" / "train.jsonl").is_file()
    rows = json.loads((w / "bench" / "bench.json").read_text())["results"]
    assert {r["method"] for r in rows} == {"ar", "dflash"} and {r["suite"] for r in rows} == {"math", "code"}
    assert {r["temperature"] for r in rows} == {0.0, 1.0} and {r["batch_size"] for r in rows} == {1, 2}
    for r in rows:
        assert r["tau"] >= 1.0 and r["tokens_per_s"] > 0
        assert len(r["per_position_acceptance"]) == (3 if r["method"] == "dflash" else 0)
        assert r["per_position_acceptance"] == sorted(r["per_position_acceptance"], reverse=True)
        assert (r["top_k"], r["top_p"], r["draft_sampling"]) == (20, 0.9, "greedy")
        lo, hi = r["tau_ci95"]
        assert lo <= r["tau"] <= hi and len(r["per_prompt"]) == r["num_prompts"] == 2
    assert (w / "bench" / "bench.png").stat().st_size > 1000 and "| dflash |" in (w / "bench" / "bench.md").read_text()
    assert "bench:" in out

    # a rerun reuses the cached world and the finished training (resumes with nothing left to do)
    assert main(args) == 0
    assert "reusing cached tiny world" in capsys.readouterr().out

    # D²SD rows next to DFlash (the first drafter reused as the second), with their tree statistics, under the fixed
    # and the adaptive policy (the config's bench.policies)
    bench = ["bench", TINY, f"work_dir={w}", "tracking.enabled=false", *MICRO, "bench.tree_ks=[1,2]",
             "decode.second_drafter=same", "bench.temperatures=[0.0]", "bench.batch_sizes=[2]"]
    assert main(bench) == 0
    rows = json.loads((w / "bench" / "bench.json").read_text())["results"]
    trees = [r for r in rows if r["method"] == "d2sd"]
    assert sorted((r["tree_k"], r["policy"]) for r in trees) == [(k, p) for k in (1, 2) for p in ("adaptive",) * 2
                                                                  + ("fixed",) * 2]
    for r in trees:
        assert 1 < r["nodes_per_round"] <= 1 + (r["tree_k"] + 1) * 3 and r["dedup_saved_per_round"] >= 0
        assert sum(r["winner_share"]) == pytest.approx(1.0) and len(r["winner_share"]) == r["tree_k"] + 1
    assert "| d2sd K=2 | sft |" in (w / "bench" / "bench.md").read_text()

    # one-pass tree rows at two node budgets, with the budget plot
    assert main([*bench, "bench.tree_ks=[]", "bench.tree_nodes=[3,8]"]) == 0
    rows = json.loads((w / "bench" / "bench.json").read_text())["results"]
    trees = [r for r in rows if r["method"] == "ddtree"]
    for policy in ("fixed", "adaptive"):  # the adaptive policy: a plain round (the root alone) or a whole tree round
        assert sorted(r["tree_nodes"] for r in trees if r["policy"] == policy) == [3, 3, 8, 8]  # two suites
    for r in trees:
        assert (1 if r["policy"] == "adaptive" else 1.001) <= r["nodes_per_round"] <= r["tree_nodes"]
        assert 0 <= r["sibling_share"] <= 1 and (r["policy"] == "fixed" or 0 <= r["plain_round_share"] <= 1)
    assert (w / "bench" / "bench_tree_nodes.png").stat().st_size > 1000

    # the adaptive policy beside the fixed one, each in static batches and continuous batching (requests of
    # lengths varying fourfold): rows carry the policy, the drafts chosen, the batching and the ratio to static
    assert main([*bench[:-4], "bench.policies=[fixed,adaptive]", "bench.batching=[static,continuous]",
                 "bench.length_spread=4"]) == 0
    rows = json.loads((w / "bench" / "bench.json").read_text())["results"]
    adaptive = [r for r in rows if r["policy"] == "adaptive"]
    assert {r["method"] for r in adaptive} == {"dflash"} and len(adaptive) == len(rows) // 3
    for r in adaptive:
        assert 0 <= r["verified_per_round"] <= 3 and 0 <= r["plain_round_share"] <= 1
    assert sum(r["batching"] == "continuous" for r in rows) == len(rows) // 2
    assert all(r["vs_static"] > 0 and r["vs_ar_static"] > 0 for r in rows)
    assert (w / "bench" / "bench_batch_sizes.png").stat().st_size > 1000

    # the adaptive policy alone, two repeats: no fixed rows; each row's speedup per repeat and its interval
    assert main([*bench[:-4], "bench.policies=[adaptive]", "bench.repeats=2", *bench[-2:]]) == 0
    rows = json.loads((w / "bench" / "bench.json").read_text())["results"]
    drafted = [r for r in rows if r["method"] != "ar"]
    assert drafted and len(drafted) == len(rows) // 2 and all(r["policy"] == "adaptive" for r in drafted)
    for r in rows:
        lo, hi = r["speedup_ci95"]
        assert len(r["speedup_per_repeat"]) == 2 and lo <= sum(r["speedup_per_repeat"]) / 2 <= hi
    assert "x (" in (w / "bench" / "bench.md").read_text()

    # a ReTrace drafter (the sft drafter converted, its prior active) gets fixed and adaptive rows like DFlash's
    target = load_target(world / "target")
    retrace = convert_drafter(load_drafter(w / "drafter" / "sft", target), "retrace")
    with torch.no_grad():
        torch.nn.init.normal_(retrace.retrace_gate_out.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    record_target(save_drafter(retrace, w / "drafter" / "retrace"), world / "target")
    assert main([*bench[:-4], "bench.stages=[retrace]", "bench.temperatures=[0.0]", "bench.batch_sizes=[2]"]) == 0
    rows = json.loads((w / "bench" / "bench.json").read_text())["results"]
    drafted = sorted((r["method"], r["stage"], r["policy"], r["suite"]) for r in rows if r["method"] != "ar")
    assert drafted == [("retrace", "retrace", p, s) for p in ("adaptive", "fixed") for s in ("code", "math")]
    for r in rows:
        assert r["tau"] >= 1.0 and (r["policy"] != "adaptive" or 0 <= r["verified_per_round"] <= 3)


def test_empty_prompt_file_for_data_is_one_clean_line(tmp_path, capsys, tiny_world):
    empty = tmp_path / "p.jsonl"
    empty.write_text("")
    assert main(["data", TINY, f"target.path={tiny_world.target_dir}", f"data.prompts_file={empty}",
                 "tracking.enabled=false", f"work_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "no valid requests" in err[0]


def test_data_resume_with_another_temperature_is_refused_and_keeps_the_responses(tmp_path, capsys, tiny_world):
    """The regeneration records its sampling settings; resuming it at another temperature would mix two response
    distributions, so it stops with one line naming the key, and the responses already written stay as they were."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"hello {i}"}) + "\n" for i in range(3)))
    args = ["data", TINY, f"target.path={tiny_world.target_dir}", f"data.prompts_file={prompts}",
            "data.max_new_tokens=6", "tracking.enabled=false", f"work_dir={tmp_path / 'w'}"]
    assert main(args) == 0
    data = tmp_path / "w" / "data"
    assert regenerated_temperature(data / "train.jsonl") == 0.0
    raw = (data / "regenerated.jsonl").read_text()
    capsys.readouterr()
    assert main([*args, "data.temperature=1.0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'data.temperature'" in err[0] and "mix" in err[0]
    assert (data / "regenerated.jsonl").read_text() == raw and regenerated_temperature(data / "train.jsonl") == 0.0
    assert main(args) == 0  # the same settings resume


def test_data_from_another_target_is_not_resumed(tmp_path, capsys, tiny_world):
    """A work dir whose responses another target wrote (e.g. the world was rebuilt) is refused, not mixed."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"hello {i}"}) + "\n" for i in range(2)))
    other = tmp_path / "other-target"
    shutil.copytree(tiny_world.target_dir, other)
    args = ["data", TINY, f"data.prompts_file={prompts}", "data.max_new_tokens=4", "tracking.enabled=false",
            f"work_dir={tmp_path / 'w'}"]
    assert main([*args, f"target.path={tiny_world.target_dir}"]) == 0
    raw = (tmp_path / "w" / "data" / "regenerated.jsonl").read_text()
    capsys.readouterr()
    assert main([*args, f"target.path={other}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another target" in err[0]
    assert (tmp_path / "w" / "data" / "regenerated.jsonl").read_text() == raw


def test_checkpoints_trained_on_other_data_are_not_resumed(tmp_path):
    ckpt = tmp_path / "checkpoints" / "sft"
    check_resumable(ckpt, {"target": "a", "data": "1"})
    (ckpt / "drafter-last.ckpt").write_bytes(b"x")
    check_resumable(ckpt, {"target": "a", "data": "1"})  # the same run resumes
    with pytest.raises(SpecdraftError, match="another target or other data"):
        check_resumable(ckpt, {"target": "a", "data": "2"})
    (ckpt / "trained_on.json").unlink()
    with pytest.raises(SpecdraftError, match="not recorded"):
        check_resumable(ckpt, {"target": "a", "data": "1"})


def test_data_reports_how_many_empty_responses_it_dropped(tmp_path, capsys, tiny_world):
    """Responses the target ended at once are not trained on; the stage says how many it dropped and why."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"hello {i}"}) + "\n" for i in range(3)))
    data = tmp_path / "w" / "data"
    data.mkdir(parents=True)
    (data / "regenerated.jsonl").write_text("".join(json.dumps({"id": i, "completion": c}) + "\n"
                                                    for i, c in (("p0", ""), ("p1", "  "))))  # a resumed job
    assert main(["data", TINY, f"target.path={tiny_world.target_dir}", f"data.prompts_file={prompts}",
                 "data.max_new_tokens=6", "tracking.enabled=false", f"work_dir={tmp_path / 'w'}"]) == 0
    out = capsys.readouterr().out
    kept = len((data / "train.jsonl").read_text().splitlines())
    assert f"data: {kept} conversations of 3 prompts" in out
    assert f"dropped {3 - kept} empty responses (the target stopped at once)" in out and kept <= 1
