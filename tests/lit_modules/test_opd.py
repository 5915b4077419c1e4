"""Draft-OPD: rollout records replay to the engine's text and acceptance, replayed draft logits equal the serving
logits, the recorded teacher is the target on the drafted prefix, each loss equals a brute-force computation, and the
rollout stream refreshes on schedule."""

import math

import pytest
import torch

from specdraft.lit_modules.drafter_module import DrafterModule
from specdraft.lit_modules.opd import (
    OPDConfig,
    Replay,
    Rollout,
    collate_rollouts,
    opd_loss,
    opd_step,
    rejected_k3,
    response_kl,
    rollout,
    stream_masks,
)
from specdraft.lit_modules.opd_data import RolloutStream
from specdraft.lit_modules.stage_table import Objective
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.sampling import SamplingParams
from tests.helpers import make_drafter, make_target

PROMPTS = [[1, 2, 3], [5, 6, 4, 2, 1, 3, 6], [4], [2, 5], [6, 6, 1]]
STOP = (0,)


@pytest.fixture(scope="module")
def models():
    target = make_target(seed=3, vocab=8, std=0.5)  # 8 tokens: a random drafter is accepted now and then
    drafter = make_drafter(target, seed=4, block_size=5, layers=1)
    return target, drafter


def _rollouts(models, temperature=0.0, max_new=24):
    target, drafter = models
    cfg = OPDConfig(rollout_temperature=temperature, max_new_tokens=max_new, rollout_batch_size=3)
    g = torch.Generator().manual_seed(0)
    return rollout(target, drafter, PROMPTS, cfg, STOP, g, keep_logits=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rollout_records_replay_to_the_engines_text_and_acceptance(models, temperature):
    target, drafter = models
    rollouts, stats = _rollouts(models, temperature)
    gen = GenerationConfig(max_new_tokens=24, stop_token_ids=STOP, sampling=SamplingParams(temperature))
    g = torch.Generator().manual_seed(0)  # the rollout's chunks of 3 rows, one generator across them
    engine = [res for i in (0, 3) for res in generate(target, PROMPTS[i:i + 3], gen, drafter=drafter, generator=g)]
    if temperature == 0:  # lossless: the committed text is the target's own
        assert [r.tokens[r.prompt_len:] for r in rollouts] == [
            res.tokens + ([0] if res.finish_reason == "stop" else []) for res in generate(target, PROMPTS, gen)]
    accepted = [n for r in rollouts for n in r.accepted]
    assert 0 in accepted and max(accepted) >= 1  # rejections and acceptances both occur
    for r, res in zip(rollouts, engine):
        assert r.accepted == res.accepted  # the same engine, the same draws
        assert r.tokens[r.prompt_len:len(r.tokens) - (res.finish_reason == "stop")] == res.tokens
        assert r.anchors[0] == r.prompt_len
        for j, (a, n, d) in enumerate(zip(r.anchors, r.accepted, r.drafts)):
            committed = r.tokens[a + 1:a + n + 2]
            assert committed == (d[:n] + [r.corrections[j]])[:len(committed)]  # accepted drafts, then correction
            if j + 1 < len(r.anchors):
                assert r.anchors[j + 1] == a + n + 1
    assert stats["tau"] == pytest.approx(sum(sum(res.accept_lengths) for res in engine)
                                         / sum(len(res.accept_lengths) for res in engine))


def test_replayed_draft_logits_equal_the_serving_logits_and_the_teacher_is_exact(models):
    target, drafter = models
    rollouts, _ = _rollouts(models)
    raw = Objective(stage="opd", opd=OPDConfig(response_teacher="raw"))  # the target's slot logits, at T=1
    module = DrafterModule(drafter, target, 1e-3, 0.0, 10, 8, raw)
    batch = collate_rollouts(rollouts, max_rounds=4, generator=torch.Generator().manual_seed(1))
    db, _, _ = opd_step(module, batch, "train", None)
    K = drafter.block_size - 1
    checked = 0
    for b, r in enumerate(rollouts):
        for j in range(int(batch["valid"][b].sum())):
            rnd = r.anchors.index(int(batch["anchors"][b, j]))  # the round this block replays
            torch.testing.assert_close(db.logits[b, j], r.draft_logits[rnd], atol=2e-5, rtol=1e-5)
            a, n, d = r.anchors[rnd], r.accepted[rnd], r.drafts[rnd]
            for o in range(1, K + 1):  # the target on the anchor and the drafted prefix before slot o
                with torch.no_grad():
                    logits = target(torch.tensor([r.tokens[:a + 1] + d[:o - 1]])).logits[0, -1]
                assert r.teacher_logp[rnd][o - 1] == pytest.approx(float(logits.log_softmax(-1)[d[o - 1]]),
                                                                   abs=1e-5)
            if n < K and bool(batch["complete"][b, j]):  # first rejected slot: the teacher-forced replay agrees
                teacher_forced = db.target_logits[b, j, n].log_softmax(-1)[d[n]]
                assert float(teacher_forced) == pytest.approx(r.teacher_logp[rnd][n], abs=1e-5)
            checked += 1
    assert checked >= len(PROMPTS) * 3 and batch["anchors"].shape[1] == 4


def test_stream_masks_response_rejected_exact_and_cheap():
    replay = Replay(accepted=torch.tensor([[2, 4, 1]]), drafts=torch.zeros(1, 3, 4, dtype=torch.long),
                    teacher_logp=torch.zeros(1, 3, 4), complete=torch.tensor([[True, True, False]]))
    label_mask = torch.ones(1, 3, 4, dtype=torch.bool)
    label_mask[0, 2, 3] = False  # past the text
    resp, rej = stream_masks(replay, label_mask, "exact", 0.8)
    assert resp[0].int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    torch.testing.assert_close(rej[0], torch.tensor([[0, 0, 0.8 ** 2, 0.8 ** 3], [0, 0, 0, 0], [0, 0, 0, 0]]))
    _, cheap = stream_masks(replay, label_mask, "cheap", 0.8)
    torch.testing.assert_close(cheap[0], torch.tensor([[0, 0, 0.8 ** 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]]))


def test_losses_equal_brute_force_on_a_tiny_vocabulary():
    g = torch.Generator().manual_seed(0)
    V, T = 5, 0.7
    q_logits, p_logits = torch.randn(2, 3, V, generator=g), torch.randn(2, 3, V, generator=g)
    labels = torch.randint(0, V, (2, 3), generator=g)
    mask = torch.tensor([[True, False, True], [True, True, False]])
    full, sampled, n = 0.0, 0.0, 0
    for i in range(2):
        for k in range(3):
            if not mask[i, k]:
                continue
            q = [math.exp(x / T) for x in q_logits[i, k].tolist()]
            p = [math.exp(x / T) for x in p_logits[i, k].tolist()]
            q, p = [x / sum(q) for x in q], [x / sum(p) for x in p]
            full += sum(pv * math.log(pv / qv) for pv, qv in zip(p, q))
            y = int(labels[i, k])
            sampled += p[y] * math.log(p[y] / q[y]) + (1 - p[y]) * math.log((1 - p[y]) / (1 - q[y]))
            n += 1
    assert float(response_kl(q_logits, p_logits, labels, mask, "full", T)) == pytest.approx(full / n, rel=1e-5)
    assert float(response_kl(q_logits, p_logits, labels, mask, "sampled", T)) == pytest.approx(sampled / n, rel=1e-5)
    ce = -sum(math.log(float(torch.softmax(q_logits[i, k], -1)[labels[i, k]])) for i in range(2) for k in range(3)
              if mask[i, k])
    for form in ("full", "sampled"):  # T -> 0: the teacher is the argmax, and both forms are the committed token's CE
        assert float(response_kl(q_logits, p_logits, labels, mask, form, 0.0)) == pytest.approx(ce / n, rel=1e-5)

    drafts = torch.randint(0, V, (2, 3), generator=g)
    teacher = torch.log(torch.rand(2, 3, generator=g))
    weights = torch.tensor([[0.0, 1.0, 0.8], [0.64, 0.0, 0.0]])
    num, den = 0.0, 0.0
    for i in range(2):
        for k in range(3):
            if weights[i, k] == 0:
                continue
            qx = float(torch.softmax(q_logits[i, k] / T, -1)[drafts[i, k]])
            r = math.exp(float(teacher[i, k])) / qx
            num += float(weights[i, k]) * ((r - 1) - math.log(r))
            den += float(weights[i, k])
    assert float(rejected_k3(q_logits, drafts, teacher, weights, T)) == pytest.approx(num / den, rel=1e-5)


@pytest.mark.parametrize("opts", [{"rejected_weight": 1.0},
                                  {"rejected_weight": 1.0, "rejected_teacher": "exact", "response_loss": "sampled",
                                   "response_teacher": "raw"}, {"rejected_weight": 1.0, "rollout_temperature": 1.0}])
def test_opd_loss_trains_both_streams_with_finite_gradients(models, opts):
    target, _ = models
    drafter = make_drafter(target, seed=4, block_size=5, layers=1).train().requires_grad_(True)
    cfg = OPDConfig(**opts)
    rollouts, _ = _rollouts((target, drafter), cfg.rollout_temperature)
    module = DrafterModule(drafter, target, 1e-3, 0.0, 10, 8, Objective(stage="opd", opd=cfg))
    db, _, _ = opd_step(module, collate_rollouts(rollouts), "train", None)
    assert (db.target_logits is None) == (cfg.response_temperature == 0)  # greedy CE needs no target logits
    loss, stats = opd_loss(module, db)
    assert stats["response_loss"] > 0 and stats["rejected_loss"] > 0 and stats["rejected_drafts"] > 0
    loss.backward()
    grads = [p.grad for p in drafter.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(gr).all() for gr in grads) and any(gr.abs().sum() > 0 for gr in grads)


def test_rows_ending_at_once_and_batches_without_rounds(models):
    target, drafter = models
    first = generate(target, PROMPTS, GenerationConfig(max_new_tokens=1))[1].tokens[0]
    rollouts, _ = rollout(target, drafter, PROMPTS, OPDConfig(max_new_tokens=8), (first,))
    stopped = rollouts[1]  # its first token is the stop token: no round to replay, nothing to crash on
    assert stopped.anchors == [] and stopped.tokens == PROMPTS[1]
    short, _ = rollout(target, drafter, PROMPTS, OPDConfig(max_new_tokens=1))  # one token each: no rounds at all
    assert all(not r.anchors for r in short)
    batch = collate_rollouts(short)
    db, _, _ = opd_step(DrafterModule(drafter, target, 1e-3, 0.0, 10, 8, Objective(stage="opd")), batch, "train",
                        None)
    loss, stats = opd_loss(DrafterModule(drafter, target, 1e-3, 0.0, 10, 8, Objective(stage="opd")), db)
    assert float(loss.detach()) == 0.0 and stats["rejected_drafts"] == 0


def test_rollout_stream_refreshes_on_schedule_and_offline_rolls_out_once():
    prompts = [[i] for i in range(10)]
    calls = []

    def fake_rollout(ps, cycle):
        calls.append((cycle, [p[0] for p in ps]))
        return [Rollout(1, p + [0, 0], [1], [[0]], [0], [0], [0.0]) for p in ps]

    def take(stream, n):
        it = iter(stream)
        return [next(it) for _ in range(n)]

    on = RolloutStream(prompts, OPDConfig(refresh_every=2), 3, 6, 0, fake_rollout, lambda: 0, refresh_batches=2)
    batches = list(on)  # the run's 6 batches, and no rollout past them (the loader looks one batch ahead)
    assert len(batches) == 6 and [c for c, _ in calls] == [0, 1, 2] and all(len(ps) == 6 for _, ps in calls)
    assert batches[0]["input_ids"][:, 0].tolist() == calls[0][1][:3]  # batch 0 replays the cycle's first rollouts
    assert batches[1]["input_ids"][:, 0].tolist() == calls[0][1][3:6]
    seen = [p for _, ps in calls for p in ps]
    assert sorted(seen[:10]) == list(range(10))  # the shuffled pool is used up before any prompt repeats
    on_prompts = seen
    calls.clear()
    off = RolloutStream(prompts, OPDConfig(refresh_every=0), 3, 6, 0, fake_rollout, lambda: 0, refresh_batches=0)
    assert len(list(off)) == 6
    assert len(calls) == 1 and calls[0][1] == on_prompts  # the same prompts, rolled out once
    calls.clear()
    resumed = RolloutStream(prompts, OPDConfig(refresh_every=2), 3, 6, 0, fake_rollout, lambda: 3, refresh_batches=2)
    take(resumed, 1)
    assert calls == [(1, on_prompts[6:12])]  # resumed mid-cycle 1: that cycle is rolled out again
    calls.clear()
    ranks = [RolloutStream(prompts, OPDConfig(refresh_every=2), 3, 6, 0, fake_rollout, lambda: 0,
                           refresh_batches=2, num_replicas=2, rank=r) for r in (0, 1)]
    for s in ranks:
        take(s, 1)
    assert sorted(calls[0][1] + calls[1][1]) == sorted(on_prompts[:12])  # the global buffer dealt over the ranks
