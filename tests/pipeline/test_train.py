"""`specdraft train` on a seconds-sized world: resume gives the same next losses as an uninterrupted run; the best
checkpoint is exported in the HF layout the runtime loads; MLflow gets params, metrics, artifacts and a model
version."""

import json
import logging
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities import rank_zero_info

from specdraft.errors import SpecdraftError
from specdraft.lit_modules.stage_table import Objective
from specdraft.pipeline import stages
from specdraft.pipeline.cli import main
from specdraft.pipeline.config import load_config
from specdraft.pipeline.lightning_utils import TrackerCallback, quiet_lightning
from specdraft.pipeline.tracking import Tracker
from specdraft.pipeline.train import _best_including_final, data_temperature_note, train_drafter
from specdraft.pipeline.trees import tree_drafting
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import load_drafter
from specdraft.runtime.load import load_target


class RecordingTracker(Tracker):
    def __init__(self):
        self.metrics = {}

    def log_metrics(self, metrics, step=None):
        for k, v in metrics.items():
            self.metrics.setdefault(k, {})[step] = v


class StopAt(L.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _cfg(world, work, *extra):
    return load_config(TINY, [
        f"target.path={world.target_dir}", f"work_dir={work}", "tracking.enabled=false", "drafter.num_layers=1",
        "drafter.block_size=4", "drafter.num_features=2", "train.batch_size=4", "train.num_anchors=8",
        "train.max_steps=6", "train.eval_every=3", "train.log_every=1", "train.max_minutes=0", "train.lr=3e-3",
        *extra])


def _prepare(world, work):
    (work / "data").mkdir(parents=True)
    shutil.copy(world.target_dir.parent / "data.jsonl", work / "data" / "train.jsonl")
    return work / "data" / "train.jsonl"


def test_resume_gives_the_same_next_losses(tiny_world, tmp_path):
    full = RecordingTracker()
    data = _prepare(tiny_world, tmp_path / "a")
    train_drafter(_cfg(tiny_world, tmp_path / "a"), tiny_world, data, full, log=lambda m: None)

    data = _prepare(tiny_world, tmp_path / "b")
    first = RecordingTracker()
    train_drafter(_cfg(tiny_world, tmp_path / "b"), tiny_world, data, first, log=lambda m: None, callbacks=[StopAt(3)])
    assert max(first.metrics["train/loss"]) == 3
    second, said = RecordingTracker(), []
    train_drafter(_cfg(tiny_world, tmp_path / "b"), tiny_world, data, second, log=said.append)
    assert any("resuming from step 3 of 6 (train.max_steps)" in m for m in said)
    assert any(m.startswith("train: 3 steps (to step 6) in ") for m in said)
    resumed = second.metrics["train/loss"]
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full.metrics["train/loss"][step], rel=1e-5, abs=1e-6)
    for step in (1, 2, 3):
        assert first.metrics["train/loss"][step] == pytest.approx(full.metrics["train/loss"][step], rel=1e-5)


def test_export_loads_in_runtime_and_mlflow_records_the_run(tiny_world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = _cfg(tiny_world, tmp_path / "w", "tracking.enabled=true", f"tracking.uri={uri}", "tracking.experiment=t")
    _prepare(tiny_world, tmp_path / "w")
    out = stages.train(cfg, tiny_world)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    target = load_target(tiny_world.target_dir, dtype="float32", device="cpu")
    drafter = load_drafter(out, target)
    best = torch.load(tmp_path / "w" / "checkpoints" / "sft" / "drafter-best.ckpt", weights_only=True)["state_dict"]
    torch.testing.assert_close(drafter.fc.weight, best["drafter.fc.weight"])
    torch.testing.assert_close(drafter.layers[0].self_attn.qkv_proj.weight[:8],
                               best["drafter.layers.0.self_attn.q_proj.weight"][:8])

    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (the GPU image has none)")
    client = mlflow.MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.data.params["train.max_steps"] == "6"
    assert "eval/sim_tau" in run.data.metrics and "train/loss" in run.data.metrics
    assert any(a.path == "drafter" for a in client.list_artifacts(run.info.run_id))
    versions = client.search_model_versions("name='tiny-dflash'")
    assert versions and versions[0].tags["stage"] == "sft" and "sim_tau" in versions[0].tags
    record = json.loads((out / "specdraft.json").read_text())
    assert versions[0].tags["target_fingerprint"] == record["target_fingerprint"]  # two checkpoints at one path
    assert versions[0].tags["export_name"] == "sft"


class TagTracker(RecordingTracker):
    run_id = "run-x"

    def __init__(self):
        super().__init__()
        self.tags = {}

    def set_tags(self, tags):
        self.tags.update(tags)


@pytest.mark.integration
def test_stages_chain_sft_eal_wtv_grpo_with_warm_starts(tiny_world, tmp_path):
    work = tmp_path / "w"
    data = _prepare(tiny_world, work)
    (data.parent / "sampling.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 48}))  # greedy data
    base = ["train.max_steps=3", "train.eval_every=3", "train.features=online"]
    with pytest.raises(SpecdraftError, match="train.init_stage"):  # eal needs an sft drafter first
        train_drafter(_cfg(tiny_world, work, "train.stage=eal", *base), tiny_world, data, TagTracker(), lambda m: None)
    trackers, logs = {}, {}
    for stage in ("sft", "eal", "wtv", "grpo"):
        trackers[stage], logs[stage] = TagTracker(), []
        out = train_drafter(_cfg(tiny_world, work, f"train.stage={stage}", "train.grpo.group_size=4", *base),
                            tiny_world, data, trackers[stage], logs[stage].append)
        assert out == work / "drafter" / stage
        meta = json.loads((out / "specdraft.json").read_text())
        assert meta["stage"] == stage and meta["run_id"] == "run-x"
        # a sampling stage's export is picked by its expected acceptance under speculative sampling
        assert meta["selected_by"] == ("eval/sim_tau_sampled" if stage == "wtv" else "eval/sim_tau")
    assert trackers["sft"].tags["warm_start"] == ""
    assert trackers["eal"].tags["warm_start"] == str(work / "drafter" / "sft")
    assert trackers["grpo"].tags["warm_start"] == str(work / "drafter" / "eal")
    assert trackers["eal"].tags["warm_start_run_id"] == "run-x"
    assert "train/grpo_reward_mean" in trackers["grpo"].metrics
    assert "eval/sim_tau_sampled" in trackers["wtv"].metrics and "eval/sim_tau_sampled" not in trackers["eal"].metrics
    # only the sampling stage warns that its data was regenerated greedily; every run is tagged with the data's T
    warned = {s for s, lines in logs.items() if any("warning" in m and "data.temperature=0" in m for m in lines)}
    assert warned == {"wtv"} and trackers["eal"].tags["data_temperature"] == "0"
    target = load_target(tiny_world.target_dir, dtype="float32", device="cpu")
    sft, eal = load_drafter(work / "drafter" / "sft", target), load_drafter(work / "drafter" / "eal", target)
    assert not torch.equal(sft.fc.weight, eal.fc.weight)  # the stage trained
    with pytest.raises(SpecdraftError, match="train.features"):
        train_drafter(_cfg(tiny_world, work, "train.stage=wtv", "train.features=offline"), tiny_world, data,
                      TagTracker(), lambda m: None)

    # Draft-OPD warm-starts from sft, rolls out through the engine (refreshed every 2 steps), logs the rollout's
    # acceptance and both loss streams, and exports the checkpoint with the best serving-style acceptance
    ot = TagTracker()
    out = train_drafter(_cfg(tiny_world, work, "train.stage=opd", "train.opd.refresh_every=2",
                             "train.opd.max_new_tokens=24", "train.opd.eval_prompts=2", *base), tiny_world, data, ot,
                        lambda m: None)
    assert ot.tags["warm_start"] == str(work / "drafter" / "sft")
    assert json.loads((out / "specdraft.json").read_text())["selected_by"] == "eval/opd_tau"
    for key in ("train/opd_rollout_tau", "train/opd_rollout_share", "train/opd_response_loss",
                "train/opd_rejected_loss", "eval/opd_tau"):
        assert key in ot.metrics, key
    assert max(ot.metrics["train/opd_rollout_cycle"].values()) >= 1  # the buffer was refreshed inside Lightning
    assert not torch.equal(load_drafter(out, target).fc.weight, sft.fc.weight)

    # ReTrace warm-starts from the sft DFlash drafter; its fusion starts at zero, so it begins exactly as sft
    rt = TagTracker()
    out = train_drafter(_cfg(tiny_world, work, "train.stage=retrace", "drafter.retrace.alignment=soft", *base),
                        tiny_world, data, rt, lambda m: None)
    assert rt.tags["warm_start"] == str(work / "drafter" / "sft")
    assert json.loads((out / "config.json").read_text())["retrace_config"]["alignment"] == "soft"
    r = load_drafter(out, target)
    assert r.arch_name == "retrace" and "train/retrace_round1_tau" in rt.metrics
    assert "eval/sim_tau_noprior" in rt.metrics
    with pytest.raises(SpecdraftError, match="opd replays DFlash"):  # a ReTrace warm start cannot replay blocks
        train_drafter(_cfg(tiny_world, work, "train.stage=opd", f"drafter.init_from={out}", *base), tiny_world, data,
                      TagTracker(), lambda m: None)
    with pytest.raises(SpecdraftError, match="verify pass"):  # exact correction signals need the target in the loop
        train_drafter(_cfg(tiny_world, work, "train.stage=retrace", "train.features=offline"), tiny_world, data,
                      TagTracker(), lambda m: None)

    # D²SD's VP drafter warm-starts from sft (or starts fresh), is picked by eval/vp_tau and records its prefix law
    for init, name in (("", "vp"), ("none", "vp-fresh")):
        vt = TagTracker()
        out = train_drafter(_cfg(tiny_world, work, "train.stage=vp", f"train.init_stage={init}",
                                 f"train.export_name={name}", "drafter.vp.prefix_beta=0.7", *base), tiny_world, data,
                            vt, lambda m: None)
        assert vt.tags["warm_start"] == (str(work / "drafter" / "sft") if not init else "")
        meta, cfg = (json.loads((out / f).read_text()) for f in ("specdraft.json", "config.json"))
        assert meta["selected_by"] == "eval/vp_tau" and cfg["vp_config"]["prefix_beta"] == 0.7
        assert load_drafter(out, target).arch_name == "vp" and "eval/vp_tau" in vt.metrics

    # d2sd serves the sft drafter first and the vp export second; its greedy output is the target's
    sft_cfg = _cfg(tiny_world, work, "decode.method=d2sd", "decode.tree_k=2")
    tree = tree_drafting(sft_cfg, target, sft)
    assert tree.second.arch_name == "vp" and tree.num_branches == 2
    prompts = [[5, 6, 7, 8], [9, 10]]
    gen = GenerationConfig(max_new_tokens=12)
    want = [r.tokens for r in generate(target, prompts, gen)]
    assert [r.tokens for r in generate(target, prompts, gen, drafter=sft, tree=tree)] == want
    assert tree_drafting(_cfg(tiny_world, work, "decode.second_drafter=same", "decode.tree_k=1"), target,
                         sft).second is sft
    for bad, match in (("decode.tree_k=3", "decode.tree_k"), ("decode.second_drafter=nothing", "second_drafter")):
        with pytest.raises(SpecdraftError, match=match):
            tree_drafting(_cfg(tiny_world, work, "decode.tree_k=2", bad), target, sft)
    with pytest.raises(SpecdraftError, match="d2sd drafts first"):
        tree_drafting(sft_cfg, target, r)


def test_evaluations_count_optimizer_steps_across_short_epochs(tiny_world, tmp_path):
    """An epoch shorter than ``eval_every`` (here 2-3 steps) must not shift or hide evaluations: they land on every
    ``eval_every``-th optimizer step, including the last, so the best checkpoint can be the final one."""
    class EvalSteps(L.Callback):
        steps = []

        def on_validation_end(self, trainer, pl_module):
            if trainer.state.fn == "fit":
                self.steps.append(trainer.global_step)

    data = _prepare(tiny_world, tmp_path / "w")
    train_drafter(_cfg(tiny_world, tmp_path / "w", "train.batch_size=40"), tiny_world, data, RecordingTracker(),
                  log=lambda m: None, callbacks=[EvalSteps()])
    assert EvalSteps.steps == [3, 6]


def test_export_takes_the_final_weights_when_they_score_best(tmp_path):
    saved = []
    trainer = SimpleNamespace(callback_metrics={"eval/sim_tau": torch.tensor(6.0)},
                              save_checkpoint=lambda path, weights_only=None: saved.append(path))
    better_before = SimpleNamespace(best_model_path="ckpt/step3.ckpt", best_model_score=torch.tensor(7.0))
    assert _best_including_final(trainer, better_before, tmp_path) == (Path("ckpt/step3.ckpt"), 7.0) and not saved
    worse_before = SimpleNamespace(best_model_path="ckpt/step3.ckpt", best_model_score=torch.tensor(5.0))
    assert _best_including_final(trainer, worse_before, tmp_path) == (tmp_path / "drafter-best.ckpt", 6.0)
    assert saved == [str(tmp_path / "drafter-best.ckpt")]
    trainer.callback_metrics = {}  # no final number: keep the evaluated best
    assert _best_including_final(trainer, worse_before, tmp_path)[0] == Path("ckpt/step3.ckpt")


def test_sampling_stages_warn_only_when_the_data_temperature_differs():
    wtv = Objective(stage="wtv", temperature=0.7)
    assert "data.temperature=0" in data_temperature_note(wtv, 0.0) and "T=0.7" in data_temperature_note(wtv, 0.0)
    assert data_temperature_note(wtv, 0.7) is None and data_temperature_note(wtv, None) is None
    assert data_temperature_note(Objective(stage="kl"), 0.0) is not None
    assert data_temperature_note(Objective(stage="eal"), 1.0) is None  # greedy stages: no sampling temperature


def test_tracker_logs_each_evaluation_once_at_its_step():
    """Training metrics go out every ``every`` steps, evaluation metrics only when an evaluation ends: an eval
    point is not repeated at the training steps that follow it."""

    tracker = RecordingTracker()
    cb = TrackerCallback(tracker, every=10)
    trainer = SimpleNamespace(global_step=300, callback_metrics={"train/loss": torch.tensor(1.5),
                                                                 "eval/sim_tau": torch.tensor(4.25),
                                                                 "val/loss": torch.tensor(2.0)})
    cb.on_validation_end(trainer, None)
    for step in (300, 310, 320):
        trainer.global_step = step
        cb.on_train_batch_end(trainer, None, None, None, 0)
    assert tracker.metrics["eval/sim_tau"] == {300: 4.25} and tracker.metrics["val/loss"] == {300: 2.0}
    assert set(tracker.metrics["train/loss"]) == {300, 310, 320}


def test_expected_lightning_messages_are_silenced_and_others_are_not():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_lightning()
        warnings.warn("You defined a `validation_step` but have no `val_dataloader`. Skipping val loop.")
        warnings.warn("Found 66 module(s) in eval mode at the start of training.")
        warnings.warn("something a user should see")
    assert [str(w.message) for w in seen] == ["something a user should see"]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        logger.setLevel(logging.INFO)  # as Lightning leaves it: its info lines (the litlogger tip among them) print
        rank_zero_info("GPU available: False")
        quiet_lightning()
        rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing litlogger")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["GPU available: False"]


def test_a_warm_start_that_conflicts_with_the_config_is_refused_naming_both_values(tiny_world, tmp_path):
    """The config sets ``drafter.block_size`` (4 here) and ``drafter.init_from`` a drafter made with 8: refused
    before training, naming both values, instead of training and exporting block size 8 without a word."""
    init = tmp_path / "init"
    assert main(["init-drafter", "--target", str(tiny_world.target_dir), "--out", str(init), "--layers", "1",
                 "--block-size", "8"]) == 0
    data = _prepare(tiny_world, tmp_path / "w")
    with pytest.raises(SpecdraftError, match="'drafter.block_size': the config sets 4, but the warm start .* has 8"):
        train_drafter(_cfg(tiny_world, tmp_path / "w", f"drafter.init_from={init}"), tiny_world, data,
                      RecordingTracker(), log=lambda m: None)


class RegisteringTracker(RecordingTracker):
    def __init__(self):
        super().__init__()
        self.versions = 0

    def register_model(self, artifact_path, name, tags=None):
        self.versions += 1
        return str(self.versions)


def test_a_resume_refuses_changed_settings_and_a_finished_run_registers_nothing_new(tiny_world, tmp_path):
    data = _prepare(tiny_world, tmp_path)
    train_drafter(_cfg(tiny_world, tmp_path), tiny_world, data, RecordingTracker(), log=lambda m: None,
                  callbacks=[StopAt(3)])
    with pytest.raises(SpecdraftError, match="other settings \\(train.lr: 0.003 then, 0.001 now\\)"):
        train_drafter(_cfg(tiny_world, tmp_path, "train.lr=1e-3"), tiny_world, data, RecordingTracker(),
                      log=lambda m: None)
    tracker, said = RegisteringTracker(), []
    train_drafter(_cfg(tiny_world, tmp_path, "train.lr=1e-3", "train.restart=true"), tiny_world, data, tracker,
                  log=said.append)
    assert any("starting over" in m for m in said) and any(m.startswith("train: 6 steps in ") for m in said)
    assert tracker.versions == 1 and max(tracker.metrics["train/loss"]) == 6
    again, said = RegisteringTracker(), []
    train_drafter(_cfg(tiny_world, tmp_path, "train.lr=1e-3", "train.max_minutes=5"), tiny_world, data, again,
                  log=said.append)  # how long to train may change on a resume
    assert any("nothing left to train" in m for m in said)
    assert any("0 steps (to step 6); best" in m and "no new model version" in m for m in said)
    assert again.versions == 0
