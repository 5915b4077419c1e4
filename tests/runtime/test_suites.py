"""The suites papers report, read by path: every format, bad records reported by line, multi-turn conversations."""

import gzip
import json

import pytest

from specdraft.errors import SpecdraftError
from specdraft.pipeline.config import load_config
from specdraft.runtime.batch_job import Request, conversation, next_turn, read_requests, row_key
from specdraft.runtime.suites import packaged_path, parse_suite

RECORDS = {
    "question.jsonl": [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
                       {"question_id": 82, "category": "math", "turns": ["What is 2+2?"]}],
    "gsm8k.jsonl": [{"question": "Mia has 3 apples.", "answer": "3 #### 3"}],
    "humaneval.jsonl.gz": [{"task_id": "HumanEval/0", "prompt": "def f():\n", "test": "", "entry_point": "f"}],
    "math500.jsonl": [{"problem": "Solve x+1=2.", "solution": "x=1", "unique_id": "test/algebra/1.json"}],
    "alpaca.json": [{"instruction": "Translate.", "input": "Bonjour", "output": "Hello"},
                    {"instruction": "Name a colour.", "input": "", "output": "Red"}],
}


def _write(path, records):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize("name", list(RECORDS))
def test_each_format_is_detected_and_served_as_its_prompt(tmp_path, name):
    reqs = read_requests(_write(tmp_path / name, RECORDS[name]), pytest.fail)
    got = [(r.raw_id, r.prompt, r.turns) for r in reqs]
    assert got == {
        "question.jsonl": [(81, "Write a poem.", ("Now shorter.",)), (82, "What is 2+2?", ())],
        "gsm8k.jsonl": [(1, "Mia has 3 apples.", ())],
        "humaneval.jsonl.gz": [("HumanEval/0", "def f():\n", ())],
        "math500.jsonl": [("test/algebra/1.json", "Solve x+1=2.", ())],
        "alpaca.json": [(1, "Translate.\n\nBonjour", ()), (2, "Name a colour.", ())],
    }[name]


def test_a_record_the_format_cannot_read_is_reported_by_line_and_the_others_kept(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps(RECORDS["question.jsonl"][0]) + "\n{not json\n"
                    + json.dumps({"question_id": 3, "turns": []}) + "\n" + json.dumps({"category": "x"}) + "\n"
                    + json.dumps(RECORDS["question.jsonl"][1]) + "\n")
    said = []
    assert [r.raw_id for r in read_requests(path, said.append)] == [81, 82]
    assert [m.split(": skipped")[0] for m in said] == [f"{path}:{n}" for n in (2, 3, 4)]
    assert "not JSON" in said[0] and "'turns' must be a non-empty list" in said[1] and "needs 'question_id'" in said[2]
    with pytest.raises(SpecdraftError, match="cannot be read"):
        read_requests(_write(tmp_path / "bad.json", {"not": "a list"}), said.append)
    with pytest.raises(SpecdraftError, match="no valid requests"):
        read_requests(path, said.append, fmt="gsm8k")  # named: every record lacks the format's keys


def test_suite_entries_name_their_rows_and_a_bad_one_names_the_key(tmp_path):
    assert parse_suite("math").path is None and parse_suite("humaneval").fmt == "humaneval"
    spec = parse_suite("mt-bench:data/mt_bench/question.jsonl#writing")
    assert (spec.name, spec.fmt, spec.category, str(spec.path)) == ("mt_bench/writing", "turns", "writing",
                                                                     "data/mt_bench/question.jsonl")
    assert parse_suite("/x/gsm8k_test.jsonl.gz").name == "gsm8k_test"
    with pytest.raises(SpecdraftError, match="bench.suites.*neither a suite"):
        load_config("configs/tiny.yaml", ["bench.suites=[maths]"])
    with pytest.raises(SpecdraftError, match="data.prompts_format.*unknown suite format 'sharegpt'"):
        load_config("configs/tiny.yaml", ["data.prompts_format=sharegpt"])


def test_the_packaged_humaneval_suite_has_its_164_prompts():
    reqs = read_requests(packaged_path("humaneval"), pytest.fail)
    assert len(reqs) == 164 and reqs[0].id == "HumanEval/0" and reqs[0].prompt.startswith("from typing import List")


def test_a_later_turn_holds_the_answers_before_it_and_its_own_key():
    req = Request("81", [{"role": "user", "content": "a"}], 1, "a", None, 81, ("b", "c"))
    two = next_turn(req, "A")
    three = next_turn(two, "B")
    assert (two.id, two.turn, three.id, next_turn(three, "C")) == ("81#turn2", 2, "81#turn3", None)
    assert [m["content"] for m in three.messages] == ["a", "A", "b", "B", "c"]
    assert row_key({"id": 81, "turn": 3}) == three.id and row_key({"id": 81, "turn": 1}) == req.id
    assert [m["content"] for m in conversation(req, {"81": "A", "81#turn2": "B"})] == ["a", "A", "b", "B"]
    assert [m["content"] for m in conversation(req, {"81": "A", "81#turn2": " "})] == ["a", "A"]
