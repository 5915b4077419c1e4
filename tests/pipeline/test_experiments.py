"""configs/experiments/: every stage-comparison variant is a valid run config over the tiny world's, and a malformed
variant file is refused with one line naming it."""

from pathlib import Path

import pytest

from specdraft.errors import SpecdraftError
from specdraft.pipeline.config import load_config, parse_overrides
from specdraft.pipeline.experiments import Experiment, load_experiment, load_experiments, training_order

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "configs" / "experiments"
VARIANTS = load_experiments(FOLDER)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_applies_over_the_tiny_config(name):
    exp = VARIANTS[name]
    cfg = load_config(ROOT / "configs" / "tiny.yaml",
                      [f"train.stage={exp.stage}", f"train.export_name={name}", *exp.overrides()])
    assert cfg.train.stage == exp.stage and cfg.train.export_name == name
    assert parse_overrides(exp.overrides()) == exp.config  # the file's config, key for key, value for value
    for key, value in exp.config.get("train", {}).items():
        if not isinstance(value, dict):
            assert getattr(cfg.train, key) == value
    assert exp.about, f"{name}.yaml says nothing about what it measures"


def test_the_comparison_covers_every_method_and_its_baselines():
    stages = {e.stage for e in VARIANTS.values()}
    assert {"sft", "kl", "eal", "wtv", "grpo", "retrace", "opd"} <= stages
    assert ("sft", 0.0) in VARIANTS["eal-len"].compare and ("kl", 1.0) in VARIANTS["wtv-len"].compare
    assert VARIANTS["grpo-wtv"].start == "wtv-len" and VARIANTS["retrace-slim"].ablation
    assert not VARIANTS["retrace-main"].ablation


def test_starts_train_before_the_variants_that_start_from_them():
    order = training_order(VARIANTS)
    assert sorted(order) == sorted(VARIANTS)
    for name, exp in VARIANTS.items():
        if exp.start != "sft":
            assert order.index(exp.start) < order.index(name), (name, exp.start)
    a, b = Experiment("a", "", "sft", start="b"), Experiment("b", "", "sft", start="a")
    with pytest.raises(SpecdraftError, match="starts from itself"):
        training_order({"a": a, "b": b})


@pytest.mark.parametrize("text, message", [
    ("stage: eal\nconfg: {}\n", "unknown key.*confg"),
    ("stage: eel\n", "stage 'eel' is not one of"),
    ("stage: eal\ncompare: [[sft]]\n", r"compare entry \['sft'\]"),
    ("stage: eal\nconfig: [1]\n", "config must be a mapping"),
    ("stage: [eal\n", "not valid YAML at line 2"),
])
def test_a_malformed_variant_is_one_line_naming_its_file(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecdraftError, match=message) as err:
        load_experiment(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value).strip()


def test_a_baseline_that_names_no_variant_is_refused(tmp_path):
    (tmp_path / "eal.yaml").write_text("stage: eal\ncompare: [[cee, 0]]\n")
    with pytest.raises(SpecdraftError, match="'cee' names no variant"):
        load_experiments(tmp_path)
