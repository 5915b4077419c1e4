"""The package's shape: no import circle, runtime free of training/tracking libraries, one table of stages that the
config, the registry and the Lightning module all read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specdraft.lit_modules.stage_table import STAGES, Objective
from specdraft.pipeline.config import DrafterConfig, load_config
from specdraft.runtime.models import available_drafters, resolve_drafter

ROOT = Path(__file__).resolve().parents[1] / "specdraft"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (function-local imports count too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    assert "specdraft.lit_modules.blocks" in graph["specdraft.lit_modules.retrace_step"]  # the graph sees edges
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_runtime_imports_neither_lightning_nor_mlflow_nor_the_training_layers():
    for path in (ROOT / "runtime").rglob("*.py"):
        for mod in _imports(path):
            top = mod.split(".")[0]
            assert top not in ("lightning", "mlflow", "pytorch_lightning"), f"{path.name} imports {mod}"
            if top == "specdraft":
                assert mod.startswith(("specdraft.runtime", "specdraft.errors", "specdraft.kernels")), \
                    f"{path.name} imports {mod}"


def test_stage_table_rows_are_complete_and_consistent():
    for name, stage in STAGES.items():
        assert stage.name == name and callable(stage.loss) and callable(stage.step)
        assert stage.warm_start in ("", *STAGES), name
        assert stage.arch is None or stage.arch in available_drafters(), name
        o = Objective(stage=name)
        assert o.selection_metric in ("eval/sim_tau", "eval/sim_tau_sampled", stage.metric or "eval/sim_tau")
    assert Objective(stage="wtv").selection_metric == "eval/sim_tau_sampled"
    assert Objective(stage="grpo").selection_metric == "eval/sim_tau"
    assert Objective(stage="vp").selection_metric == "eval/vp_tau"
    assert Objective(stage="grpo", grpo=Objective().grpo.__class__(mode="sampling")).needs_target_logits


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_stage_in_the_table_is_a_valid_train_stage(stage):
    assert load_config(None, [f"train.stage={stage}"]).train.stage == stage


def test_every_architecture_with_options_has_its_config_section():
    for name in available_drafters():
        cls = resolve_drafter(name)
        if cls.options_class is not None:
            assert isinstance(DrafterConfig().options_for(name), cls.options_class), name
    assert DrafterConfig().options_for("dflash") is None
