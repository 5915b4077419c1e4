"""Data-parallel training: the sampler shards each global batch over the ranks (every item once, equal steps per
rank), and `specdraft train ... train.devices=2 train.strategy=ddp` trains with two CPU processes (gloo) to one
export, one MLflow run and one registered model version."""

import os
import shutil
import subprocess
import sys

import mlflow

from specdraft.lit_modules.data import LengthGroupedSampler
from tests.pipeline.test_train import TINY


def test_ranks_split_the_global_batches_one_process_would_see():
    lengths = [((7 * i) % 23) + 5 for i in range(37)]
    one = list(LengthGroupedSampler(lengths, 8, seed=3))
    ranks = [list(LengthGroupedSampler(lengths, 4, seed=3, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == len(one)
    for step, batch in enumerate(one):
        if len(batch) >= 2:  # a global batch splits into the two ranks' halves
            assert sorted(ranks[0][step] + ranks[1][step]) == sorted(batch)
        assert ranks[0][step] and ranks[1][step]  # no rank ever gets an empty batch
    single = list(LengthGroupedSampler(lengths, 8, seed=3, num_replicas=1, rank=0))
    assert single == one


def test_ddp_with_two_cpu_processes_trains_to_one_export_and_one_run(tiny_world, tmp_path):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    shutil.copy(tiny_world.target_dir.parent / "data.jsonl", work / "data" / "train.jsonl")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "specdraft.pipeline.cli", "train", str(TINY), f"target.path={tiny_world.target_dir}",
           f"work_dir={work}", f"tracking.uri={uri}", "tracking.experiment=ddp", "drafter.num_layers=1",
           "drafter.block_size=4", "drafter.num_features=2", "train.batch_size=2", "train.num_anchors=8",
           "train.max_steps=2", "train.eval_every=2", "train.max_minutes=0", "train.eval_prompts=1",
           "train.devices=2", "train.strategy=ddp"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("exported") == 1  # the first process exports; the other only trains
    assert (work / "drafter" / "sft" / "model.safetensors").is_file()
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ddp")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_name for r in runs] == ["tiny-train"]  # one run, however many processes trained
    assert len(client.search_model_versions("name LIKE 'tiny%'")) == 1
