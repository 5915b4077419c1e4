"""Data-parallel training: the sampler shards each global batch over the ranks (every item once, equal steps per
rank), and `specdraft train ... train.devices=2 train.strategy=ddp` trains with two CPU processes (gloo) the weights one
process trains at the same global batch, to one export, one MLflow run and one registered model version."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdraft.lit_modules.data import LengthGroupedSampler
from tests.pipeline.test_train import TINY

pytestmark = pytest.mark.integration  # `make test-fast` leaves it out


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


def _train(world, tmp_path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path, str]:
    work = tmp_path / name
    (work / "data").mkdir(parents=True)
    shutil.copy(world.target_dir.parent / "data.jsonl", work / "data" / "train.jsonl")
    uri = f"sqlite:///{tmp_path / (name + '.db')}"
    cmd = [sys.executable, "-m", "specdraft.pipeline.cli", "train", str(TINY), f"target.path={world.target_dir}",
           f"work_dir={work}", f"tracking.uri={uri}", "tracking.experiment=ddp", "drafter.num_layers=1",
           "drafter.block_size=4", "drafter.num_features=2", "train.num_anchors=8", "train.max_steps=3",
           "train.eval_every=3", "train.max_minutes=0", "train.eval_prompts=1", "train.features=online",
           "train.precision=32-true",  # fp32: bf16 rounding differs between one batch of 4 and two of 2
           "train.log_every=1", *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, work, uri


def test_ddp_with_two_cpu_processes_trains_what_one_process_trains_to_one_export_and_one_run(tiny_world, tmp_path):
    """Two gloo processes at batch 2 and one process at batch 4 see the same global batches, draw the same anchors
    (one stream per conversation) and average the loss over the same supervised slots: the same weights come out."""
    run, work, uri = _train(tiny_world, tmp_path, "ddp", "train.batch_size=2", "train.devices=2",
                            "train.strategy=ddp")
    assert run.stdout.count("exported") == 1  # the first process exports; the other only trains
    assert (work / "drafter" / "sft" / "model.safetensors").is_file()
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (the GPU image has none)")
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ddp")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_name for r in runs] == ["tiny-train"]  # one run, however many processes trained
    assert len(client.search_model_versions("name LIKE 'tiny%'")) == 1
    _, one, one_uri = _train(tiny_world, tmp_path, "one", "train.batch_size=4")
    ddp_w = load_file(str(work / "drafter" / "sft" / "model.safetensors"))
    one_w = load_file(str(one / "drafter" / "sft" / "model.safetensors"))
    assert ddp_w.keys() == one_w.keys()
    for k in ddp_w:
        torch.testing.assert_close(ddp_w[k], one_w[k], rtol=1e-4, atol=1e-5, msg=k)
    losses = [mlflow.MlflowClient(tracking_uri=u).get_metric_history(r.info.run_id, "train/loss")
              for u, r in ((uri, runs[0]), (one_uri, mlflow.MlflowClient(tracking_uri=one_uri).search_runs(
                  [mlflow.MlflowClient(tracking_uri=one_uri).get_experiment_by_name("ddp").experiment_id])[0]))]
    assert [m.step for m in losses[0]] == [m.step for m in losses[1]] and losses[0]
    for a, b in zip(*losses):
        assert abs(a.value - b.value) <= 1e-4 * abs(b.value), (a.step, a.value, b.value)
