import gzip
import json
import random
import shutil
import statistics
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from specdraft.errors import SpecdraftError
from specdraft.pipeline.bench import (
    distinct2,
    length_caps,
    per_prompt_counts,
    ratio_interval,
    speedup_repeats,
    suite_prompts,
    summarize,
    tau_interval,
    write_reports,
)
from specdraft.pipeline.config import load_config
from specdraft.pipeline.data import copy_bench_suites
from specdraft.pipeline.stages import existing_world
from specdraft.runtime.chat import encode_chat
from specdraft.runtime.suites import packaged_path


def test_summarize_tau_rates_and_per_position():
    rows = [SimpleNamespace(accept_lengths=[4, 1, 2]), SimpleNamespace(accept_lengths=[3])]  # block 4: K = 3
    s = summarize(rows, block_size=4)
    assert s["tau"] == pytest.approx(10 / 4)
    assert s["acceptance_rate"] == pytest.approx((3 + 0 + 1 + 2) / (4 * 3))
    assert s["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])


def test_ar_rows_have_tau_one_and_no_positions():
    s = summarize([SimpleNamespace(accept_lengths=[1, 1, 1])], block_size=1)
    assert s["tau"] == 1.0 and s["per_position_acceptance"] == [] and s["acceptance_rate"] == 0.0


def test_distinct2_flags_loops():
    assert distinct2([[1, 2, 1, 2, 1, 2, 1, 2]]) == pytest.approx(2 / 7)
    assert distinct2([[1, 2, 3, 4]]) == 1.0


def test_reports_written(tmp_path):
    row = {"method": "dflash", "stage": "sft", "suite": "math", "temperature": 0.0, "batch_size": 1, "tau": 3.0,
           "acceptance_rate": 0.5, "per_position_acceptance": [0.8], "tokens_per_s": 100.0, "speedup": 2.0,
           "target_distinct2": 0.9, "tau_ci95": [2.5, 3.4], "num_prompts": 24, "repeats": 2}
    ar = dict(row, method="ar", stage="", tau=1.0, speedup=1.0, tau_ci95=[1.0, 1.0])
    rep = write_reports([ar, row], tmp_path)
    assert "| dflash | sft | math | 0 | 1 | 24 x 2 | 3.00 (2.50-3.40) |" in rep["markdown"]
    assert (tmp_path / "bench.png").stat().st_size > 1000 and (tmp_path / "bench.json").is_file()


def test_tau_interval_covers_tau_and_narrows_with_more_prompts():
    rng = random.Random(0)
    few = [[rng.randint(20, 60), 20] for _ in range(6)]
    many = [[rng.randint(20, 60), 20] for _ in range(96)]
    for pp in (few, many):
        tau = sum(e for e, _ in pp) / sum(r for _, r in pp)
        lo, hi = tau_interval(pp)
        assert lo < tau < hi
    assert (tau_interval(many)[1] - tau_interval(many)[0]) < (tau_interval(few)[1] - tau_interval(few)[0]) / 2


def test_paired_ratio_interval_excludes_one_for_a_consistent_gain():
    base = [[30 + i % 7, 20] for i in range(24)]
    better = [[e + 4, r] for e, r in base]  # every prompt gains
    lo, hi = ratio_interval(better, base)
    assert 1.0 < lo < hi
    lo, hi = ratio_interval(base, base)
    assert lo == hi == 1.0


def test_speedup_interval_pairs_each_repeat_with_ar_in_the_same_repeat():
    # the machine ran at half speed in the second repeat: paired per repeat, the ratio is 0.9 both times
    s = speedup_repeats([[90, 1.0], [90, 2.0]], [100.0, 50.0])
    assert s["speedup_per_repeat"] == pytest.approx([0.9, 0.9]) and s["speedup_ci95"] == pytest.approx([0.9, 0.9])
    # a spread of ratios: the Student interval of their mean, wider with fewer repeats
    ratios = [0.95, 1.01, 0.98, 1.04, 0.97, 0.99]
    s = speedup_repeats([[r * 100, 1.0] for r in ratios], [100.0] * 6)
    lo, hi = s["speedup_ci95"]
    half = 2.5706 * statistics.stdev(ratios) / 6 ** 0.5  # t(0.975, 5)
    assert (lo, hi) == pytest.approx((statistics.mean(ratios) - half, statistics.mean(ratios) + half), rel=1e-4)
    few = speedup_repeats([[r * 100, 1.0] for r in ratios[:3]], [100.0] * 3)["speedup_ci95"]
    assert few[1] - few[0] > hi - lo
    one = speedup_repeats([[95, 1.0]], [100.0])
    assert one["speedup_per_repeat"] == pytest.approx([0.95]) and all(v != v for v in one["speedup_ci95"])


def test_per_prompt_counts_pool_repeats():
    res = [SimpleNamespace(accept_lengths=a) for a in ([3, 1], [2], [4], [1, 1])]  # 2 prompts x 2 repeats
    assert per_prompt_counts(res, 2) == [[3 + 1 + 4, 3], [2 + 1 + 1, 3]]


def test_bench_finds_the_suites_of_a_specdraft_world_given_as_target_path(tiny_world, tmp_path):
    root = tmp_path / "world"
    shutil.copytree(tiny_world.target_dir, root / "target")
    shutil.copytree(tiny_world.bench_dir, root / "bench")
    cfg = load_config(None, [f"target.path={root / 'target'}", f"work_dir={tmp_path / 'w'}"])
    assert existing_world(cfg).bench_dir is None  # not a world specdraft built: no report.json
    (root / "report.json").write_text("{}")
    assert existing_world(cfg).bench_dir == root / "bench"


def test_data_copies_held_out_suites_given_for_an_external_target(tiny_world, tmp_path):
    copy_bench_suites(tiny_world.bench_dir, tmp_path / "bench_prompts", log=lambda m: None)
    assert (tmp_path / "bench_prompts" / "math.jsonl").read_text() == (tiny_world.bench_dir / "math.jsonl").read_text()
    with pytest.raises(SpecdraftError, match="data.bench_dir"):
        copy_bench_suites(tmp_path / "nothing", tmp_path / "x")


def test_length_caps_vary_by_the_spread_log_uniformly_and_the_same_for_every_method():
    caps = length_caps(400, 80, 10.0, seed=0)
    assert min(caps) >= 8 and max(caps) <= 80 and max(caps) / min(caps) >= 8
    assert 20 <= sorted(caps)[200] <= 32  # the median of a log-uniform draw on [8, 80] is about 25
    assert caps == length_caps(400, 80, 10.0, seed=0) and length_caps(3, 80, 1.0, 0) == [80, 80, 80]


def test_bench_serves_humaneval_and_every_turn_of_a_multi_turn_file(tiny_world, tmp_path):
    tok = AutoTokenizer.from_pretrained(str(tiny_world.target_dir))
    humaneval = suite_prompts(tiny_world, "humaneval", 164, tok)
    assert len(humaneval) == 164 and humaneval[0] == encode_chat(tok, [{"role": "user", "content": json.loads(
        gzip.decompress(packaged_path("humaneval").read_bytes()).splitlines()[0])["prompt"]}])
    path = tmp_path / "mt_bench" / "question.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"question_id": 1, "category": "math", "turns": ["Mia has 3 apples.", "And Tom?"]},
        {"question_id": 2, "category": "writing", "turns": ["Ava has 2 coins."]}]))
    asked = []

    def answer(prompts):
        asked.extend(prompts)
        return ["She has 3."] * len(prompts)

    prompts = suite_prompts(tiny_world, f"mt-bench:{path}", 8, tok, answer=answer)
    first = encode_chat(tok, [{"role": "user", "content": "Mia has 3 apples."}])
    assert asked == [first]  # only the question with a second turn is answered
    assert prompts[:1] == [first] and prompts[2] == encode_chat(tok, [
        {"role": "user", "content": "Mia has 3 apples."}, {"role": "assistant", "content": "She has 3."},
        {"role": "user", "content": "And Tom?"}])
    assert len(suite_prompts(tiny_world, f"{path}#writing", 8, tok, answer=answer)) == 1
    with pytest.raises(SpecdraftError, match="bench.suites.*not found"):
        suite_prompts(tiny_world, str(tmp_path / "none.jsonl"), 8, tok)
