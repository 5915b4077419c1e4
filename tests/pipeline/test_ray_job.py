"""`specdraft decode ... decode.runner=ray` on a local Ray cluster with two CPU workers (the optional `ray` extra;
skipped without it): the JSONL contract, bad lines reported by line, resume without duplicates, and the completions
of the local job, for chains, D²SD trees in static batches and the adaptive policy over chains and trees."""

import json

import pytest

from specdraft.pipeline.cli import main
from tests.pipeline.test_decode_job import _args, _rows, _write, drafter_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration  # `make test-fast` leaves it out

pytest.importorskip("ray", reason="the optional Ray extra is not installed: pip install -e '.[ray]'")


def test_a_ray_job_writes_the_local_jobs_rows_once_each_and_resumes(tiny_world, drafter_dir, tmp_path,  # noqa: F811
                                                                     capsys):
    inp = tmp_path / "in.jsonl"
    prompts = ["Mia has 3 apples.", "Tom has 12 coins. Then Tom finds 4 more coins.", "Ava", "Ben has 7 pens.",
               "Zoe reads 9 pages.", "Kim has 2 cats. Then Kim finds 5 more cats.", "Leo", "Sam has 4 hats.",
               "Eli has 6 cups.", "Max", "Ann has 8 books. Then Ann gives 3 books away.", "Joe has 1 dog.",
               "Liv reads 5 pages."]
    _write(inp, [json.dumps({"id": f"r{i}", "prompt": p, "max_new_tokens": 4 + i}) for i, p in enumerate(prompts)]
           + ["{broken", json.dumps({"id": "r0", "prompt": "a duplicate id"})])
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path), "--input", str(inp), "--output", str(local)]) == 0
    want = {json.loads(line)["id"]: json.loads(line) for line in local.read_text().splitlines()}
    on_ray.write_text(json.dumps(want["r2"]) + "\n" + '{"id": "r5", "compl')  # a killed job: one row and a torn one
    capsys.readouterr()
    # tasks of 4 requests (4 x decode.batch_size): the 12 pending requests travel in three, over two actors
    ray_args = [*_args(tiny_world, drafter_dir, tmp_path, "decode.batch_size=1"), "decode.runner=ray",
                "decode.ray_actors=2"]
    assert main(["decode", *ray_args, "--input", str(inp), "--output", str(on_ray)]) == 0
    out, err = capsys.readouterr()
    assert "in.jsonl:14" in err and "in.jsonl:15" in err  # bad lines reported by line, the others decoded
    assert "12 requests on 2 Ray actors (1 already done, 0 skipped, 2 bad lines)" in out, out
    rows = [json.loads(line) for line in on_ray.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(want)  # every id once: r2 kept, nothing duplicated or lost
    for r in rows:  # each row as the local job wrote it (greedy), its own cap applied
        assert {k: v for k, v in r.items() if k != "time_s"} == {k: v for k, v in want[r["id"]].items()
                                                                 if k != "time_s"}
        assert r["num_tokens"] <= 4 + int(r["id"][1:])


@pytest.mark.parametrize("mode", [["decode.method=d2sd", "decode.second_drafter=same", "decode.tree_k=2",
                                   "decode.batching=static"], ["decode.policy=adaptive"],
                                  ["decode.method=ddtree", "decode.tree_nodes=6", "decode.policy=adaptive"],
                                  ["decode.method=d2sd", "decode.second_drafter=same", "decode.tree_k=2",
                                   "decode.policy=adaptive"]],
                         ids=["d2sd-static-batches", "adaptive-policy", "adaptive-one-pass-trees", "adaptive-d2sd"])
def test_a_ray_job_decodes_trees_and_the_adaptive_policy_as_the_local_job(tiny_world, drafter_dir, tmp_path,  # noqa: F811
                                                                          mode):
    inp = tmp_path / "in.jsonl"
    prompts = ["Mia has 3 apples.", "Tom has 12 coins. Then Tom finds 4 more coins.", "Ava", "Ben has 7 pens.",
               "Zoe reads 9 pages.", "Leo"]
    _write(inp, [json.dumps({"id": f"r{i}", "prompt": p}) for i, p in enumerate(prompts)])
    args = _args(tiny_world, drafter_dir, tmp_path, "decode.batch_size=2", *mode)
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert main(["decode", *args, "--input", str(inp), "--output", str(local)]) == 0
    assert main(["decode", *args, "decode.runner=ray", "--input", str(inp), "--output", str(on_ray)]) == 0
    want, got = _rows(local), _rows(on_ray)
    assert set(got) == set(want)
    if "decode.policy=adaptive" in mode:  # its choices follow measured round times: the completions are the contract
        assert {i: r["completion"] for i, r in got.items()} == {i: r["completion"] for i, r in want.items()}
        assert all(len(r["verified"]) == len(r["accept_lengths"]) for r in got.values())
        if len(mode) > 1:  # trees: each round a whole tree or a plain one
            assert all(set(r["verified"]) <= {0, 3} for r in got.values())
    else:  # one task of the six requests, in the local job's batches: the same rows, accept lengths included
        assert got == want


def test_a_ray_job_decodes_follow_up_turns_as_the_local_job(tiny_world, drafter_dir, tmp_path):  # noqa: F811
    inp = tmp_path / "in.jsonl"
    _write(inp, [json.dumps({"id": "a", "prompt": "Mia has 3 apples.", "turns": ["And Tom?", "How many now?"]}),
                 json.dumps({"id": "b", "prompt": "Ava"}),
                 json.dumps({"id": "c", "prompt": "Ben has 7 pens.", "turns": ["Why?"]})])
    args = _args(tiny_world, drafter_dir, tmp_path)
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert main(["decode", *args, "--input", str(inp), "--output", str(local)]) == 0
    assert main(["decode", *args, "decode.runner=ray", "--input", str(inp), "--output", str(on_ray)]) == 0

    def rows(path):
        return {(r["id"], r.get("turn", 1)): {k: v for k, v in r.items() if k != "time_s"}
                for r in map(json.loads, path.read_text().splitlines())}
    assert set(rows(on_ray)) == {("a", 1), ("a", 2), ("a", 3), ("b", 1), ("c", 1), ("c", 2)}
    assert rows(on_ray) == rows(local)  # each turn after the target's own answers, as the local job decodes it
