"""GRPO stage: its reward is the runtime's acceptance, its expectation is the WTV/EAL window length, and its updates
raise acceptance."""

from types import SimpleNamespace

import torch

from specdraft.lit_modules.grpo import GRPOConfig, grpo_loss, simulated_acceptance
from specdraft.lit_modules.losses import acceptance_alpha, expected_accept_length
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.verify import accept_greedy
from tests.helpers import make_target


def test_greedy_reward_equals_real_verification_on_the_same_drafts():
    """Teacher-forced reward on target-greedy text == accept_greedy after a real verify pass with a KV cache."""
    target = make_target(seed=11, vocab=16)
    prompt = [1, 2, 3, 4]
    text = prompt + generate(target, [prompt], GenerationConfig(max_new_tokens=20))[0].tokens
    ids = torch.tensor([text])
    greedy = target(ids).logits.argmax(-1)[0]  # target's token after each position
    K, a = 5, 8  # anchor at position 8
    g = torch.Generator().manual_seed(0)
    drafts = []
    for n_good in range(K + 1):  # drafts that agree with the text for n_good slots, then go wrong
        d = text[a + 1:a + 1 + K]
        d = d[:n_good] + [(t + 1 + int(torch.randint(0, 14, (1,), generator=g))) % 16 for t in d[n_good:]]
        drafts.append(d)
    drafts = torch.tensor(drafts)[:, None]  # [G=6, M=1, K]
    sim = simulated_acceptance(drafts, greedy[a:a + K + 1][None], "greedy")  # [6, 1]
    for i in range(drafts.shape[0]):
        cache = target.new_cache(1, 64)
        target(ids[:, :a], cache=cache)
        cache.crop(torch.tensor([a]))
        out = target(torch.cat([ids[:, a:a + 1], drafts[i]], dim=1), cache=cache)
        n_real, _ = accept_greedy(drafts[i], out.logits)
        assert sim[i, 0].item() == n_real.item() == i


def test_sampling_reward_mean_is_the_window_expectation():
    """E[accepted] of speculative sampling over drafts ~ q equals sum_k prod_{j<=k} alpha_j (the WTV quantity)."""
    torch.manual_seed(12)
    K, V, G = 3, 5, 40_000
    q = torch.softmax(torch.randn(1, K, V), -1)
    p = torch.softmax(torch.randn(1, K + 1, V), -1)
    g = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q[0].repeat(G, 1), 1, generator=g).view(G, K)[:, None]  # [G, 1, K]
    n = simulated_acceptance(drafts, None, "sampling", q.expand(G, 1, K, V), p, g)
    alpha = acceptance_alpha(q.log(), p[:, :K].log())
    E = expected_accept_length(alpha.log(), torch.ones(1, K, dtype=torch.bool))
    assert abs(n.float().mean().item() - E.item()) < 0.02


def _blocks(M, K):
    return SimpleNamespace(valid=torch.ones(1, M, dtype=torch.bool), label_mask=torch.ones(1, M, K, dtype=torch.bool))


def test_grpo_updates_raise_acceptance_and_kl_anchors():
    torch.manual_seed(13)
    M, K, V = 16, 4, 6
    logits = torch.randn(1, M, K, V, requires_grad=True)
    ref = logits.detach().clone()
    y = torch.zeros(1, M, K + 1, dtype=torch.long)  # the target always wants token 0
    opt = torch.optim.Adam([logits], lr=0.1)
    cfg = GRPOConfig(group_size=8, kl_coef=0.0)
    rewards = []
    for step in range(40):
        loss, stats = grpo_loss(logits, ref, y, None, _blocks(M, K), cfg, torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        rewards.append(stats["reward_mean"])
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.5
    # with a strong KL coefficient the policy stays near the reference
    logits2 = ref.clone().requires_grad_(True)
    opt2 = torch.optim.Adam([logits2], lr=0.1)
    for step in range(40):
        loss, stats = grpo_loss(logits2, ref, y, None, _blocks(M, K), GRPOConfig(group_size=8, kl_coef=50.0),
                                torch.Generator().manual_seed(step))
        opt2.zero_grad()
        loss.backward()
        opt2.step()
    assert (logits2 - ref).abs().mean() < (logits.detach() - ref).abs().mean()


def test_uniform_rewards_give_zero_policy_gradient():
    y = torch.zeros(1, 3, 3, dtype=torch.long)
    peaked = torch.full((1, 3, 2, 4), -30.0)
    peaked[..., 1] = 30.0  # every sample drafts token 1: all rewards 0, advantages 0
    loss, _ = grpo_loss(peaked.requires_grad_(True), peaked.detach(), y, None, _blocks(3, 2), GRPOConfig(kl_coef=0.0))
    loss.backward()
    assert loss.abs().item() < 1e-6


def test_sampling_mode_samples_groups_at_the_verification_temperature():
    """Speculative sampling's acceptance assumes drafts ~ q at the serving temperature: in sampling mode the group is
    drawn at ``temperature`` whatever ``draft_temperature`` says; in greedy mode ``draft_temperature`` applies."""
    torch.manual_seed(3)
    M, K, V = 6, 3, 5
    logits, ref = torch.randn(1, M, K, V), torch.randn(1, M, K, V)
    y = torch.randint(0, V, (1, M, K + 1))
    target = torch.randn(1, M, K, V)

    def run(**kw):
        return grpo_loss(logits, ref, y, target, _blocks(M, K), GRPOConfig(group_size=4, **kw),
                         torch.Generator().manual_seed(0))

    hot, cold = run(mode="sampling", draft_temperature=1.0), run(mode="sampling", draft_temperature=0.3)
    assert torch.equal(hot[0], cold[0]) and hot[1] == cold[1]
    hot, cold = run(mode="greedy", draft_temperature=1.0), run(mode="greedy", draft_temperature=0.3)
    assert hot[1]["kl"] != cold[1]["kl"]  # the policy (and its KL to the reference) is taken at draft_temperature
