"""Training-stage experiments as data: one YAML file per variant under ``configs/experiments/``.

A variant file names the stage it trains, the export it starts from, the baselines it is compared with and the run
config it changes (a partial run config: the same sections and keys as ``configs/tiny.yaml``)::

    about: EAL as -log E (slot 1 keeps the full CE gradient)
    stage: eal
    start: sft                # an export of the base run, or another variant's
    compare: [[sft, 0]]       # [baseline variant, temperature] pairs, tau over tau
    ablation: false           # true: trained only when the comparison asks for ablations
    config:
      train: {acceptance_form: log_len}

The variant's name is its file's name; it trains into ``drafter/<name>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specdraft.errors import SpecdraftError
from specdraft.lit_modules.stage_table import STAGES

_KEYS = ("about", "stage", "start", "compare", "ablation", "config")


@dataclass(frozen=True)
class Experiment:
    """One training variant: what it trains, from where, and against what it is judged."""

    name: str
    about: str
    stage: str
    start: str = "sft"
    compare: tuple[tuple[str, float], ...] = ()
    ablation: bool = False
    config: dict = field(default_factory=dict)

    def overrides(self) -> list[str]:
        """The variant's config as dotted overrides (``train.acceptance_form="log_len"``), values JSON-written."""
        return [f"{key}={json.dumps(value)}" for key, value in _dotted(self.config, "").items()]


def _dotted(tree: dict, prefix: str) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def load_experiment(path: str | Path) -> Experiment:
    """Read one variant file; a wrong key, stage or pair is one line naming the file."""
    path = Path(path)

    def fail(message: str):
        raise SpecdraftError(f"experiment {path}: {message}")

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        fail(f"cannot be read: {e.strerror}")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        fail(f"is not valid YAML{f' at line {mark.line + 1}' if mark else ''}: {getattr(e, 'problem', e)}")
    if not isinstance(data, dict):
        fail("must be a mapping")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        fail(f"unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(_KEYS)}")
    if data.get("stage") not in STAGES:
        fail(f"stage {data.get('stage')!r} is not one of {', '.join(STAGES)}")
    if not isinstance(data.get("config", {}), dict):
        fail("config must be a mapping of run-config sections")
    compare = []
    for pair in data.get("compare") or []:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], (int, float))):
            fail(f"compare entry {pair!r} is not [baseline, temperature]")
        compare.append((pair[0], float(pair[1])))
    return Experiment(name=path.stem, about=str(data.get("about", "")), stage=data["stage"],
                      start=str(data.get("start", "sft")), compare=tuple(compare),
                      ablation=bool(data.get("ablation", False)), config=data.get("config") or {})


def load_experiments(folder: str | Path) -> dict[str, Experiment]:
    """Every ``*.yaml`` variant in ``folder`` by name, in name order; a start or baseline that names no variant (nor
    the base run's ``sft``) is refused."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SpecdraftError(f"experiments folder {folder} not found")
    found = {p.stem: load_experiment(p) for p in sorted(folder.glob("*.yaml"))}
    for exp in found.values():
        for other in (exp.start, *(b for b, _ in exp.compare)):
            if other != "sft" and other not in found:
                raise SpecdraftError(f"experiment {folder / exp.name}.yaml: {other!r} names no variant in {folder}")
    return found


def training_order(experiments: dict[str, Experiment]) -> list[str]:
    """The variants' names with each one's start (when it is among them) before it; a start cycle is refused."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise SpecdraftError(f"experiment {name!r} starts from itself through {', '.join(sorted(visiting))}")
        visiting.add(name)
        start = experiments[name].start
        if start in experiments and start != name:
            visit(start)
        visiting.discard(name)
        order.append(name)

    for name in experiments:
        visit(name)
    return order
