"""`specdraft export --to onnx` end to end on a seconds-sized world, and the engine backends in decode and bench:
the ONNX backend writes what the torch backend writes; an export of another drafter, a changed graph or a missing
export is one line before any compute; MLflow gets the artifacts as a new version of the drafter's model."""

import json
import shutil

import pytest

from specdraft.pipeline.cli import main
from tests.pipeline.test_decode_job import _args, _rows, _three_prompts, _write, drafter_dir  # noqa: F401  (a fixture)

pytestmark = pytest.mark.integration  # `make test-fast` leaves it out


@pytest.fixture(scope="module")
def exported_drafter(tiny_world, tmp_path_factory):
    """A drafter exported once for this module (the last test to use it tampers with the export)."""
    root = tmp_path_factory.mktemp("export")
    out = root / "drafter"
    assert main(["init-drafter", "--target", str(tiny_world.target_dir), "--out", str(out), "--layers", "1",
                 "--block-size", "4"]) == 0
    args = ["configs/tiny.yaml", f"target.path={tiny_world.target_dir}", f"decode.drafter={out}",
            f"work_dir={root / 'work'}", f"tracking.uri=sqlite:///{root / 'mlflow.db'}"]
    assert main(["export", *args, "--to", "onnx"]) == 0
    return out


def test_export_writes_both_flavours_with_manifests_and_registers_them(exported_drafter):
    for flavour in ("decomposed", "fused"):
        m = json.loads((exported_drafter / "onnx" / flavour / "manifest.json").read_text())
        assert m["flavour"] == flavour and set(m["graphs"]) == {"drafter_ingest", "drafter_draft", "target_verify"}
        assert m["target"]["fingerprint"] and m["drafter"]["weights_sha256"]
    import mlflow  # noqa: PLC0415  (slow to import; this test only)

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{exported_drafter.parent / 'mlflow.db'}")
    versions = client.search_model_versions("name LIKE 'tiny%'")
    assert any(v.tags.get("backend") == "onnx" for v in versions)


def test_decode_on_the_onnx_backend_writes_what_torch_writes(exported_drafter, tiny_world, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    _three_prompts(inp)
    outs = {}
    for backend, method in (("torch", "dflash"), ("onnx", "dflash"), ("onnx", "ar"), ("onnx", "adaptive")):
        outs[backend, method] = tmp_path / f"{backend}-{method}.jsonl"
        how = {"adaptive": ["decode.method=dflash", "decode.policy=adaptive"]}.get(method, [f"decode.method={method}"])
        assert main(["decode", *_args(tiny_world, exported_drafter, tmp_path, f"decode.backend={backend}", *how),
                     "--input", str(inp), "--output", str(outs[backend, method])]) == 0
    rows = {k: {json.loads(line)["id"]: json.loads(line) for line in p.read_text().splitlines()}
            for k, p in outs.items()}
    assert {i: r["completion"] for i, r in rows["onnx", "dflash"].items()} == \
        {i: r["completion"] for i, r in rows["torch", "dflash"].items()} == \
        {i: r["completion"] for i, r in rows["onnx", "ar"].items()} == \
        {i: r["completion"] for i, r in rows["onnx", "adaptive"].items()}
    assert all("verified" in r for r in rows["onnx", "adaptive"].values())  # the planner ran on the engine
    assert {i: r["accept_lengths"] for i, r in rows["onnx", "dflash"].items()} == \
        {i: r["accept_lengths"] for i, r in rows["torch", "dflash"].items()}

    # a changed graph, and an export left behind by another drafter, are refused in one line
    other = tmp_path / "other"
    shutil.copytree(exported_drafter, other)
    fused = exported_drafter / "onnx" / "decomposed" / "target_verify.onnx"
    fused.write_bytes(fused.read_bytes() + b"\0")
    capsys.readouterr()
    assert main(["decode", *_args(tiny_world, exported_drafter, tmp_path, "decode.backend=onnx"),
                 "--input", str(inp), "--output", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match its manifest hash" in err[0]
    assert main(["init-drafter", "--target", str(tiny_world.target_dir), "--out", str(tmp_path / "fresh"),
                 "--layers", "1", "--block-size", "4", "--seed", "5"]) == 0
    shutil.copy(tmp_path / "fresh" / "model.safetensors", other / "model.safetensors")
    capsys.readouterr()
    assert main(["decode", *_args(tiny_world, other, tmp_path, "decode.backend=onnx"),
                 "--input", str(inp), "--output", str(tmp_path / "y.jsonl")]) == 2
    assert "another drafter" in capsys.readouterr().err


def test_trees_on_the_onnx_backend_write_what_torch_writes(tiny_world, tmp_path):
    """``export`` with ``decode.method=d2sd`` exports the second drafter too; the tree then drafts with both exports
    and verifies with the exported target, under the fixed and the adaptive policy; one-pass trees run on the
    exports as well."""
    first, second = tmp_path / "first", tmp_path / "second"
    for out, seed in ((first, 0), (second, 5)):
        assert main(["init-drafter", "--target", str(tiny_world.target_dir), "--out", str(out), "--layers", "1",
                     "--block-size", "4", "--seed", str(seed)]) == 0
    tree = ["decode.method=d2sd", f"decode.second_drafter={second}", "decode.tree_k=2"]
    tracking = ["tracking.enabled=true", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    assert main(["export", *_args(tiny_world, first, tmp_path, *tree), *tracking, "--to", "onnx"]) == 0
    assert (second / "onnx" / "decomposed" / "manifest.json").is_file()
    import mlflow  # noqa: PLC0415  (slow to import; this test only)

    versions = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").search_model_versions()
    assert sorted(v.tags["drafter"] for v in versions) == sorted([str(first), str(second)])
    assert len({v.run_id for v in versions}) == 2  # each drafter's artifacts in a run of its own
    inp = tmp_path / "in.jsonl"
    _three_prompts(inp)
    rows = {}
    one_pass = ["decode.method=ddtree", "decode.tree_nodes=6"]
    merged = [*tree, "decode.method=merged", "decode.tree_nodes=8"]
    for name, how in (("torch", tree), ("onnx", tree), ("onnx-adaptive", [*tree, "decode.policy=adaptive"]),
                      ("torch-ddtree", one_pass), ("onnx-ddtree", one_pass), ("torch-merged", merged),
                      ("onnx-merged", merged),
                      ("onnx-ddtree-adaptive", [*one_pass, "decode.policy=adaptive"])):
        out = tmp_path / f"{name}.jsonl"
        backend = name.split("-")[0]
        assert main(["decode", *_args(tiny_world, first, tmp_path, *how, f"decode.backend={backend}"), "--input",
                     str(inp), "--output", str(out)]) == 0
        rows[name] = _rows(out)
    assert rows["onnx"] == rows["torch"]  # completions and accept lengths, round for round
    assert rows["onnx-ddtree"] == rows["torch-ddtree"]  # one-pass trees on the exported models too
    assert rows["onnx-merged"] == rows["torch-merged"]  # and merged ones, with both drafters' exports
    completions = {name: {i: r["completion"] for i, r in got.items()} for name, got in rows.items()}
    assert completions["onnx-adaptive"] == completions["onnx-ddtree-adaptive"] == completions["torch"]
    for name in ("onnx-adaptive", "onnx-ddtree-adaptive"):  # a plain round or a whole tree round, every round
        assert all(set(r["verified"]) <= {0, 3} and len(r["verified"]) == len(r["accept_lengths"])
                   for r in rows[name].values())


def test_decode_without_an_export_says_which_command_writes_it(drafter_dir, tiny_world, tmp_path, capsys):  # noqa: F811
    inp = tmp_path / "in.jsonl"
    _write(inp, [json.dumps({"id": "a", "prompt": "Ava"})])
    assert main(["decode", *_args(tiny_world, drafter_dir, tmp_path, "decode.backend=onnx"),
                 "--input", str(inp), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "specdraft export CONFIG --to onnx" in capsys.readouterr().err
