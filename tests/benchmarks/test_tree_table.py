"""benchmarks/tree_table.py: every tree row against the DFlash row with the same first drafter."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from tree_table import main  # noqa: E402


def test_each_tree_variant_is_priced_against_its_own_chain(tmp_path):
    cell = {"stage": "sft", "suite": "math", "temperature": 0.0, "batch_size": 1, "policy": "fixed"}
    chain = [[10, 5], [12, 6]]  # per prompt: [tokens, rounds] (tau 2.0 each)
    rows = [{**cell, "method": "dflash", "tau": 2.0, "speedup": 1.0, "per_prompt": chain},
            {**cell, "method": "ddtree", "tree_nodes": 32, "tree_budget": "measured", "tau": 3.0, "speedup": 0.8,
             "per_prompt": [[15, 5], [18, 6]], "nodes_per_round": 20.0, "sibling_share": 0.4},
            {**cell, "method": "d2sd", "tree_k": 4, "placement": "confidence", "tau": 2.5,
             "speedup": 0.5, "per_prompt": [[10, 4], [15, 6]], "nodes_per_round": 50.0,
             "winner_share": [0.5, 0.1, 0.1, 0.05, 0.25]},
            {**cell, "method": "merged", "tree_nodes": 64, "tree_k": 4, "tree_budget": "fixed", "tau": 4.0,
             "speedup": 0.6, "per_prompt": [[20, 5], [24, 6]], "nodes_per_round": 64.0, "sibling_share": 0.5}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"results": rows}))
    out = main([str(path)])
    assert "| ddtree N=32 measured | 0 | 1 | math | 2.00 | 3.00 | 1.500 (1.500–1.500) | 0.80 | 20.0 | 0.40 |" in out
    assert "| d2sd K=4 confidence | 0 | 1 | math | 2.00 | 2.50 | 1.250 (1.250–1.250) | 0.50 | 50.0 | 0.50 |" in out
    assert "| merged N=64 | 0 | 1 | math | 2.00 | 4.00 | 2.000 (2.000–2.000) | 0.60 | 64.0 | 0.50 |" in out
