"""benchmarks/static_trees.py compares the eager engine and the static path on every tree kind: at T=0 no request
differs between them, and every cell reports both engines' τ and tokens/s."""

import sys
from pathlib import Path

from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.drafter_io import convert_drafter
from specdraft.runtime.merged import MergedDrafting
from specdraft.runtime.one_pass import OnePassDrafting
from tests.helpers import make_drafter, make_target

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from static_trees import compare  # noqa: E402


def test_the_static_path_decodes_every_tree_as_the_eager_engine():
    target = make_target(seed=7, vocab=6, std=1.0)
    first = make_drafter(target, seed=2, block_size=5, std=0.3)
    second = convert_drafter(make_drafter(target, seed=5, block_size=5, std=0.3), "vp")
    trees = {"dflash": None, "d2sd": TreeDrafting(second, 2), "ddtree": OnePassDrafting(10),
             "merged": MergedDrafting(TreeDrafting(second, 2), 10)}
    prompts = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5]]
    report = compare(target, first, trees, {"s": prompts}, [0.0, 1.0], batch_size=2, max_new_tokens=12)
    assert not report["graphs"]  # a CPU runs the static rounds without graphs
    assert [(c["method"], c["temperature"]) for c in report["cells"]] == [
        (m, t) for t in (0.0, 1.0) for m in trees]
    for cell in report["cells"]:
        assert cell["static_tokens_per_s"] > 0 and cell["eager_tokens_per_s"] > 0
        if cell["temperature"] == 0:
            assert cell["differing_requests"] == 0 and cell["static_tau"] == cell["eager_tau"] > 1, cell
