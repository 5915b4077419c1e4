"""The request formats of the suites papers report, read into specdraft's request objects.

A file is JSONL (``.jsonl``, or gzipped ``.jsonl.gz``) or a JSON list (``.json``). Its format is named or detected from
the first record's keys:

=============  ===============================================  ========================================
format         keys                                             served as
=============  ===============================================  ========================================
specdraft      ``id``, ``prompt`` or ``messages``               as given
turns          ``question_id``, ``turns`` (MT-Bench, Spec-Bench)  a conversation: one user turn after another
humaneval      ``task_id``, ``prompt`` (HumanEval)              the prompt
gsm8k          ``question``, ``answer``                         the question
math           ``problem`` (MATH-500)                           the problem
alpaca         ``instruction``, ``input``                       the instruction, then the input if any
=============  ===============================================  ========================================

A record a format cannot read raises ``ValueError`` naming the missing key; callers report it with the file and line.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

FORMATS = ("specdraft", "turns", "humaneval", "gsm8k", "math", "alpaca")
ALIASES = {"mt-bench": "turns", "mt_bench": "turns", "spec-bench": "turns", "spec_bench": "turns",
           "human-eval": "humaneval", "math-500": "math", "math500": "math"}
_DETECT = (("turns", ("question_id", "turns")), ("humaneval", ("task_id", "prompt")), ("specdraft", ("id",)),
           ("gsm8k", ("question", "answer")), ("math", ("problem",)), ("alpaca", ("instruction",)))


def format_name(name: str) -> str:
    """The canonical name of a format (``auto`` stays ``auto``); ValueError for one not in :data:`FORMATS`."""
    name = ALIASES.get(name.lower(), name.lower())
    if name != "auto" and name not in FORMATS:
        raise ValueError(f"unknown suite format {name!r} (auto, {', '.join(FORMATS)}, or an alias: "
                         f"{', '.join(ALIASES)})")
    return name


def detect(obj: dict) -> str:
    """The format of one record, from its keys; ValueError when none fits."""
    for name, keys in _DETECT:
        if all(k in obj for k in keys):
            return name
    if "prompt" in obj or "messages" in obj:
        return "specdraft"  # its own checks name what is missing
    raise ValueError(f"no known suite format has the keys {sorted(obj)[:8]} (expected one of: "
                     + "; ".join(f"{n}: {', '.join(k)}" for n, k in _DETECT) + ")")


def records(path: str | Path) -> Iterator[tuple[int, dict | str]]:
    """``(line, record)`` of a JSONL, gzipped JSONL or JSON-list file; a line that is not JSON comes back as its
    text (the caller reports it). Blank lines are skipped."""
    path = Path(path)
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json suite must be a list of records")
        yield from enumerate(data, start=1)
        return
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield n, json.loads(raw)
            except json.JSONDecodeError as e:
                yield n, f"not JSON ({e.msg})"


def _text(obj: dict, key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"'{key}' must be a non-empty string")
    return value


def _turns(obj: dict, n: int) -> dict:
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError("'turns' must be a non-empty list of non-empty strings")
    return {"id": obj["question_id"], "prompt": turns[0], "turns": turns[1:], "category": obj.get("category")}


def _alpaca(obj: dict, n: int) -> dict:
    extra = obj.get("input") or ""
    return {"id": obj.get("id", n), "prompt": _text(obj, "instruction") + (f"\n\n{extra}" if extra.strip() else "")}


_CONVERT: dict[str, Callable[[dict, int], dict]] = {
    "specdraft": lambda obj, n: obj,
    "turns": _turns,
    "humaneval": lambda obj, n: {"id": obj["task_id"], "prompt": _text(obj, "prompt")},
    "gsm8k": lambda obj, n: {"id": obj.get("id", n), "prompt": _text(obj, "question")},
    "math": lambda obj, n: {"id": obj.get("unique_id", obj.get("id", n)), "prompt": _text(obj, "problem")},
    "alpaca": _alpaca,
}


def to_request(obj: dict, fmt: str, line: int) -> dict:
    """The specdraft request object of one record of format ``fmt`` (its id: the record's own, else its line);
    ``turns`` holds the follow-up user turns of a multi-turn record. ValueError names what is missing."""
    if fmt != "specdraft":
        missing = [k for k in dict(_DETECT)[fmt] if k not in obj]
        if missing:
            raise ValueError(f"a {fmt} record needs {', '.join(repr(k) for k in missing)}")
    return _CONVERT[fmt](obj, line)


WORLD_SUITES = ("math", "code", "dialogue")
"""The held-out suites a world writes (``<suite>.jsonl`` in its bench directory)."""
PACKAGED = {"humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "humaneval")}
"""Suites a package ships: name -> (module, file under it, format)."""
_PLAIN_STEMS = ("question", "questions", "test", "data", "problems", "prompts")


@dataclass(frozen=True)
class SuiteSpec:
    """One entry of ``bench.suites``: a world suite (``math``), a packaged one (``humaneval``), or a file
    ``[format:]path[#category]`` (``mt-bench:data/mt_bench/question.jsonl``,
    ``spec_bench/question.jsonl#translation``)."""

    name: str
    """The suite's label in the bench's rows."""
    path: Path | None = None
    """The file (None: the world's ``<name>.jsonl``)."""
    fmt: str = "auto"
    category: str | None = None
    """Only the records of this ``category`` (MT-Bench and Spec-Bench carry one)."""


def parse_suite(entry: str) -> SuiteSpec:
    """The :class:`SuiteSpec` of a ``bench.suites`` entry; ValueError for a name that is neither a suite nor a path."""
    if entry in WORLD_SUITES:
        return SuiteSpec(entry)
    if entry in PACKAGED:
        return SuiteSpec(entry, fmt=PACKAGED[entry][2])
    fmt, sep, rest = entry.partition(":")
    if not sep or "/" in fmt or "." in fmt:
        fmt, rest = "auto", entry
    fmt = format_name(fmt)
    where, _, category = rest.partition("#")
    if not any(where.endswith(ext) for ext in (".jsonl", ".jsonl.gz", ".json")):
        raise ValueError(f"{entry!r} is neither a suite ({', '.join((*WORLD_SUITES, *PACKAGED))}) nor a "
                         ".jsonl, .jsonl.gz or .json file")
    path = Path(where)
    stem = path.name.split(".")[0]
    name = path.parent.name if stem in _PLAIN_STEMS and path.parent.name else stem
    return SuiteSpec(name + (f"/{category}" if category else ""), path, fmt, category or None)


def packaged_path(name: str) -> Path:
    """The file of a packaged suite; ValueError saying what to install when its package is missing."""
    module, file, _ = PACKAGED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"suite {name!r} comes with the {module.replace('_', '-')} package: pip install "
                         "'.[suites]'")
    return Path(next(iter(spec.submodule_search_locations))) / file
