from pathlib import Path

import pytest

from specdraft.errors import SpecdraftError
from specdraft.pipeline.cli import main
from specdraft.pipeline.config import RunConfig, explain, load_config
from specdraft.pipeline.stages import default_drafter_dir

CONFIGS = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig) and cfg.name


def test_every_config_opens_with_its_launch_command():
    for p in CONFIGS:
        header = []
        for line in p.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
        assert any("specdraft " in h for h in header), f"{p.name} has no launch command in its header comment"


def test_dotted_overrides_are_typed():
    cfg = load_config(CONFIGS[0], ["train.lr=3e-4", "bench.temperatures=[0.0]", "drafter.block_size=8",
                                   "tracking.enabled=false"])
    assert cfg.train.lr == 3e-4 and cfg.bench.temperatures == [0.0] and cfg.drafter.block_size == 8
    assert cfg.tracking.enabled is False


@pytest.mark.parametrize("override,key", [
    (["train.lrr=1"], "train.lrr"),
    (["trian.lr=1"], "trian"),
    (["train.lr=fast"], "train.lr"),
    (["drafter.block_size=1"], "drafter.block_size"),
    (["decode.method=beam"], "decode.method"),
    (["target.tiny.num_layers=2.5"], "target.tiny.num_layers"),
    (["train.retrace_chain=1.5"], "train.retrace_chain"),
    (["train.prior_dropout=-0.1"], "train.prior_dropout"),
    (["decode.backend=onnx", "decode.cuda_graphs=true", "decode.batching=static"], "decode.backend"),
    (["decode.cuda_graphs=true"], "decode.batching"),
    (["decode.prefill_chunk=-1"], "decode.prefill_chunk"),
    (["bench.batching=[]"], "bench.batching"),
    (["bench.length_spread=0.5"], "bench.length_spread"),
    (["decode.method=ddtree", "decode.tree_budget=measured", "decode.cuda_graphs=true", "decode.batching=static"],
     "decode.cuda_graphs"),
    (["decode.tree_nodes=1"], "decode.tree_nodes"),
    (["decode.tree_nodes=1001"], "decode.tree_nodes"),
    (["bench.tree_nodes=[1]"], "bench.tree_nodes"),
    (["bench.merged_nodes=[1]"], "bench.merged_nodes"),
    (["decode.method=merged", "decode.tree_budget=measured", "decode.cuda_graphs=true", "decode.batching=static"],
     "decode.cuda_graphs"),
    (["train.opd.rejected_decay=0"], "train.opd.rejected_decay"),
    (["train.opd.eval_prompts=0"], "train.opd.eval_prompts"),
])
def test_bad_keys_and_values_name_the_key(override, key):
    with pytest.raises(SpecdraftError, match=f"'{key}'"):
        load_config(None, override)


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(SpecdraftError, match="did you mean 'train.lr'"):
        load_config(None, ["train.lrr=1"])


def test_cli_misspelt_key_is_one_clean_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrain:\n  epochs: 2\n  lerning_rate: 0.1\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.lerning_rate" in err[0] and "Traceback" not in err[0]


def test_cli_print_config(capsys):
    assert main(["run", str(CONFIGS[0]), "train.lr=0.5", "--print-config"]) == 0
    assert "lr: 0.5" in capsys.readouterr().out


def test_cli_missing_target_path_is_one_clean_line(tmp_path, capsys):
    assert main(["target", str(CONFIGS[0]), f"target.path={tmp_path / 'nope'}", "tracking.enabled=false",
                 f"work_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]


@pytest.mark.parametrize("old,new", [
    ("train.grpo_group_size=4", "train.grpo.group_size"),
    ("train.retrace_chain=0.5", "train.retrace.chain"),
    ("train.prior_dropout=0.1", "train.retrace.prior_dropout"),
    ("drafter.retrace_alignment=soft", "drafter.retrace.alignment"),
])
def test_flat_keys_of_earlier_releases_name_their_new_key(old, new):
    with pytest.raises(SpecdraftError, match=f"renamed to '{new}'"):
        load_config(None, [old])


@pytest.mark.parametrize("key,instead", [("decode.tree_siblings=64", "decode.method=merged"),
                                         ("bench.tree_siblings=[64]", "bench.merged_nodes")])
def test_a_removed_key_names_the_option_that_covers_it(key, instead):
    name = key.split("=")[0]
    with pytest.raises(SpecdraftError, match=f"'{name}': was removed: {instead}"):
        load_config(None, [key])
    with pytest.raises(SpecdraftError, match=f"'{name}': was removed: {instead}"):
        explain(RunConfig(), name)


def test_option_groups_nest_under_the_layer_that_uses_them():
    cfg = load_config(None, ["train.grpo.group_size=4", "train.retrace.chain=0.5", "drafter.retrace.alignment=soft",
                             "train.grpo.mode=sampling"])
    assert cfg.train.grpo.group_size == 4 and cfg.train.grpo.mode == "sampling"
    assert cfg.train.retrace.chain == 0.5 and cfg.drafter.retrace.alignment == "soft"


@pytest.mark.parametrize("override,key", [
    (["train.grpo.group_size=1"], "train.grpo.group_size"),
    (["train.retrace.chain=1.5"], "train.retrace.chain"),
    (["train.retrace.prior_dropout=-0.1"], "train.retrace.prior_dropout"),
    (["train.retrace.signals=fast"], "train.retrace.signals"),
    (["drafter.retrace.alignment=diagonal"], "drafter.retrace.alignment"),
    (["train.stage=dpo"], "train.stage"),
    (["train.export_name=a/b"], "train.export_name"),
    (["drafter.arch=medusa"], "drafter.arch"),
])
def test_nested_options_check_their_values_under_the_dotted_key(override, key):
    with pytest.raises(SpecdraftError, match=f"'{key}'"):
        load_config(None, override)


def test_acceptance_form_defaults_to_the_measured_log_len():
    assert load_config(None).train.acceptance_form == "log_len"


def test_export_name_places_the_export_and_what_decode_and_bench_read():
    cfg = load_config(None, ["work_dir=w", "train.stage=eal", "train.export_name=eal-len"])
    assert cfg.train.export == "eal-len" and default_drafter_dir(cfg) == Path("w/drafter/eal-len")
    assert default_drafter_dir(load_config(None, ["work_dir=w", "train.stage=eal"])) == Path("w/drafter/eal")


def test_overrides_are_accepted_after_the_options(capsys, tmp_path):
    args = ["decode", str(CONFIGS[0]), "decode.batch_size=3", "--input", "a.jsonl", "--output", "b.jsonl",
            "decode.max_new_tokens=7", "--print-config"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "batch_size: 3" in out and "max_new_tokens: 7" in out
    with pytest.raises(SystemExit):
        main(["decode", str(CONFIGS[0]), "--input", "a", "--output", "b", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
