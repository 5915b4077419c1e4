"""The adaptive policy's cache under ``<work_dir>/policy/``: costs measured once per machine and models, and a
calibration per sampling setting, fitted on rounds decoded as the job decodes."""

import json

import pytest
import torch

from specdraft.pipeline import policy as pipeline_policy
from specdraft.pipeline.policy import adaptive_policy, machine_costs, sampling_key
from specdraft.runtime.calibration import Calibration
from specdraft.runtime.cost_model import CostModel, extend_costs
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.policy import expected_committed
from specdraft.runtime.rounds import draft_confidence
from specdraft.runtime.sampling import SamplingParams, logits_to_probs
from tests.helpers import make_drafter, make_target
from tests.lossless import ControlledDrafter

PROMPTS = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5], [0], [1, 1, 1, 3], [1, 0]]
T1 = SamplingParams(1.0)


def _rounds(target, drafter, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Confidences ``[R, K]`` (as the engine takes them) and accepted drafts ``[R]`` of whole-block rounds."""
    conf, acc = [], []

    def observe(rec):
        q = None if sampling.greedy else logits_to_probs(rec.draft_logits, sampling)
        conf.append(draft_confidence(rec.draft_logits, rec.draft_tokens, q))
        acc.append(rec.num_accepted)

    generate(target, PROMPTS, GenerationConfig(max_new_tokens=24, sampling=sampling), drafter=drafter,
             observer=observe, generator=torch.Generator().manual_seed(7))
    return torch.cat(conf), torch.cat(acc)


def test_a_policy_is_calibrated_under_the_sampling_its_job_decodes_with(tmp_path, monkeypatch):
    """Greedy verification accepts a draft that is the target's argmax, speculative sampling with ``min(1, p / q)``:
    the same confidence means different acceptance. A drafter drafting the target's greedy path from a tempered copy
    of the target: at T=1 its sampled drafts are often tokens it gives little probability (low confidence) that the
    target accepts anyway (``q`` close to ``p``), while later slots follow the greedy text a sampled token may have
    left. A T=1 job's policy is calibrated on T=1 rounds and predicts their acceptance; the greedy calibration
    misjudges it by half. The costs are measured once; each calibration is cached beside them and loaded, not
    refitted, by the next job."""
    target = make_target(vocab=16)
    measured = []
    monkeypatch.setattr(pipeline_policy, "measure_costs",
                        lambda *a, **k: measured.append(1) or CostModel([1], [1, 2], [[1.0, 1.2]], [0.1]))

    def drafter():
        return ControlledDrafter(target, PROMPTS, block_size=4, mode="mix", alpha=0.8)

    greedy = adaptive_policy(tmp_path, target, drafter(), None, PROMPTS, batch_sizes=(1,), log=lambda m: None)
    sampled = adaptive_policy(tmp_path, target, drafter(), None, PROMPTS, batch_sizes=(1,), log=lambda m: None,
                              sampling=T1)
    assert measured == [1]
    (path,) = (tmp_path / "policy").iterdir()
    assert set(json.loads(path.read_text())["calibrations"]) == {"greedy", sampling_key(T1)}

    conf, accepted = _rounds(target, drafter(), T1)  # a T=1 job's rounds
    realized = accepted.double().mean().item()
    predicted = {name: (expected_committed(p.calibration.predict(conf.double().numpy()))[:, -1] - 1).mean()
                 for name, p in (("greedy", greedy), ("sampled", sampled))}
    assert abs(predicted["greedy"] - realized) > 0.6, (realized, predicted)
    assert abs(predicted["sampled"] - realized) < 0.25, (realized, predicted)

    monkeypatch.setattr(pipeline_policy, "calibrate", lambda *a, **k: pytest.fail("a cached calibration was refitted"))
    again = adaptive_policy(tmp_path, target, drafter(), None, PROMPTS, batch_sizes=(1,), sampling=T1)
    assert again.calibration.table == sampled.calibration.table and measured == [1]


def test_a_cache_from_before_calibrations_per_sampling_keeps_its_greedy_one(tmp_path, monkeypatch):
    """A policy file with one ``calibration`` (written when every job was calibrated on greedy rounds) is read as the
    greedy calibration; a sampled job adds its own."""
    target = make_target(vocab=16)
    drafter = ControlledDrafter(target, PROMPTS, block_size=4, mode="mix", alpha=0.8)
    key = pipeline_policy._key(target, drafter, None)
    name = pipeline_policy.hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    costs = CostModel([1], [1, 2], [[1.0, 1.2]], [0.1])
    old = {"bins": 1, "table": [[0.5]] * 3}
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / f"{name}.json").write_text(json.dumps(
        {"key": key, "costs": pipeline_policy.asdict(costs), "calibration": old}))
    assert adaptive_policy(tmp_path, target, drafter, None, PROMPTS, batch_sizes=(1,)).calibration.table == old["table"]
    adaptive_policy(tmp_path, target, drafter, None, PROMPTS, batch_sizes=(1,), log=lambda m: None, sampling=T1)
    saved = json.loads((tmp_path / "policy" / f"{name}.json").read_text())
    assert "calibration" not in saved and saved["calibrations"]["greedy"]["table"] == old["table"]
    assert sampling_key(T1) in saved["calibrations"]


def test_costs_cached_at_one_context_are_measured_again_and_the_calibrations_kept(tmp_path, monkeypatch):
    """Costs written before rounds were priced at their context (measured at one context, no ``context`` field) are
    measured again, at two contexts; the calibrations cached beside them stay."""
    target = make_target(vocab=16)
    drafter = ControlledDrafter(target, PROMPTS, block_size=4, mode="mix", alpha=0.8)
    key = pipeline_policy._key(target, drafter, None)
    name = pipeline_policy.hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    old = {"bins": 1, "table": [[0.5]] * 3}
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / f"{name}.json").write_text(json.dumps(
        {"key": key, "costs": {"rows": [1], "tokens": [1, 2], "target_s": [[1.0, 1.2]], "drafter_s": [0.1],
                               "key": {}}, "calibrations": {"greedy": old}}))
    two = CostModel([1], [1, 2], [[2.0, 2.2]], [0.1], {}, 256, {"context": 64, "target_s": [[1.0, 1.2]],
                                                                 "drafter_s": [0.1]})
    measured = []
    monkeypatch.setattr(pipeline_policy, "measure_costs", lambda *a, **k: measured.append(1) or two)
    monkeypatch.setattr(pipeline_policy, "calibrate", lambda *a, **k: pytest.fail("a cached calibration was refitted"))
    policy = adaptive_policy(tmp_path, target, drafter, None, PROMPTS, batch_sizes=(1,), log=lambda m: None)
    assert measured == [1] and policy.calibration.table == old["table"] and policy.costs.at(160).target(1, 1) == 1.5
    again = adaptive_policy(tmp_path, target, drafter, None, PROMPTS, batch_sizes=(1,))
    assert again.costs.short == two.short and measured == [1]


def test_a_node_budgets_passes_and_a_new_batch_size_are_measured_once_beside_the_policys_costs(tmp_path,
                                                                                                 monkeypatch):
    """A measured node budget prices its trees by the cached costs: node counts and batch sizes they lack are timed
    once (at both the cache's contexts) and added to the cache, what was measured before kept as it was; the next job
    and the adaptive policy read them without timing anything, the policy only passes of up to the drafter's block
    (it takes its widest round from its costs)."""
    target = make_target(vocab=16)
    drafter = make_drafter(target, seed=2, block_size=4)
    logs = []
    first = machine_costs(tmp_path, target, drafter, None, (1, 8), (4, 6, 9), log=logs.append)
    assert first.rows == [1, 8] and first.tokens == [1, 2, 4, 6, 9] and len(logs) == 2, logs
    assert all(len(r) == 5 for r in first.target_s + first.short["target_s"])
    added = []
    monkeypatch.setattr(pipeline_policy, "measure_costs", lambda *a, **k: pytest.fail("cached costs measured again"))
    monkeypatch.setattr(pipeline_policy, "extend_costs", lambda costs, t, d, rows, tokens: added.append(
        (rows, tokens)) or extend_costs(costs, t, d, rows, tokens, repeats=1))
    more = machine_costs(tmp_path, target, drafter, None, (4, 8), (6, 9, 13), log=lambda m: None)
    assert added == [([4], [13])] and more.rows == [1, 4, 8] and more.tokens == [1, 2, 4, 6, 9, 13]
    for near in (False, True):
        was, now = (first.short, more.short) if near else (vars(first), vars(more))
        assert [now["target_s"][i][:5] for i in (0, 2)] == was["target_s"]  # rows 1 and 8, the first five counts
        assert [now["drafter_s"][i] for i in (0, 2)] == was["drafter_s"]
        assert len(now["target_s"][1]) == 6 and now["drafter_s"][1] > 0
    assert machine_costs(tmp_path, target, drafter, None, (1, 4), (9, 13)).tokens == more.tokens and len(added) == 1
    monkeypatch.setattr(pipeline_policy, "calibrate", lambda *a, **k: Calibration())
    policy = adaptive_policy(tmp_path, target, drafter, None, PROMPTS, batch_sizes=(8,), log=lambda m: None)
    assert policy.costs.tokens == [1, 2, 4] and policy.costs.rows == more.rows and len(added) == 1  # up to a block


def test_an_unreadable_cache_is_named_and_measured_again(tmp_path, monkeypatch):
    target = make_target(vocab=16)
    drafter = make_drafter(target, seed=2, block_size=4)
    fresh = CostModel([1], [1, 4], [[1.0, 1.2]], [0.1], {}, 256, {"context": 64, "target_s": [[0.5, 0.6]],
                                                                    "drafter_s": [0.1]})
    measured = []
    monkeypatch.setattr(pipeline_policy, "measure_costs", lambda *a, **k: measured.append(1) or fresh)
    machine_costs(tmp_path, target, drafter, None, (1,), log=lambda m: None)
    (path,) = (tmp_path / "policy").iterdir()
    path.write_text(path.read_text()[:20])  # a write cut short
    logs = []
    assert machine_costs(tmp_path, target, drafter, None, (1,), log=logs.append).target_s == fresh.target_s
    assert logs[0] == f"policy: {path} is not a readable cache; measuring again" and measured == [1, 1], logs
    assert json.loads(path.read_text())["costs"]["target_s"] == fresh.target_s
