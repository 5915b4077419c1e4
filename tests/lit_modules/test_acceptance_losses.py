"""EAL / WTV / TV losses: brute-force expectations, limits, identities, gradients."""

import itertools

import pytest
import torch

from specdraft.lit_modules.losses import acceptance_alpha, eal_loss, greedy_slot_gains, tv_hybrid_loss, wtv_loss


def _brute_force_expected_accepted(q: torch.Tensor, y: list[int]) -> float:
    """Sum over every draft outcome of P(outcome) * (#leading matches with y) for independent slots q [K, V]."""
    K, V = q.shape
    total = 0.0
    for drafts in itertools.product(range(V), repeat=K):
        p = 1.0
        for k, d in enumerate(drafts):
            p *= float(q[k, d])
        n = 0
        while n < K and drafts[n] == y[n]:
            n += 1
        total += p * n
    return total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eal_equals_brute_force_expectation(seed):
    torch.manual_seed(seed)
    K, V = 4, 3
    logits = torch.randn(K, V) * 2
    y = torch.randint(0, V, (K,))
    _, E = eal_loss(logits[None], y[None], torch.ones(1, K, dtype=torch.bool), form="log")
    assert E.item() == pytest.approx(_brute_force_expected_accepted(logits.softmax(-1), y.tolist()), rel=1e-5)


def test_eal_respects_window_end():
    logits = torch.randn(1, 4, 5)
    y = torch.randint(0, 5, (1, 4))
    mask = torch.tensor([[True, True, False, True]])  # the slot after an invalid one cannot be accepted either
    _, E = eal_loss(logits, y, mask, form="log")
    q = logits.softmax(-1)[0, torch.arange(4), y[0]]
    assert E.item() == pytest.approx(float(q[0] + q[0] * q[1]), rel=1e-5)


def test_wtv_with_target_sharpened_to_zero_temperature_equals_eal():
    torch.manual_seed(3)
    d, t = torch.randn(2, 3, 5, 11), torch.randn(2, 3, 5, 11)
    mask = torch.ones(2, 3, 5, dtype=torch.bool)
    l_eal, e_eal = eal_loss(d, t.argmax(-1), mask, form="log")
    l_wtv, e_wtv = wtv_loss(d, t, mask, temperature=1.0, target_temperature=0.0, form="log")
    torch.testing.assert_close(e_wtv, e_eal, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l_wtv, l_eal, rtol=1e-5, atol=1e-6)


def test_sharpening_both_gives_hard_greedy_acceptance():
    torch.manual_seed(4)
    d, t = torch.randn(6, 4, 9), torch.randn(6, 4, 9)
    a = acceptance_alpha(d, t, temperature=1e-4)
    torch.testing.assert_close(a, (d.argmax(-1) == t.argmax(-1)).float(), atol=1e-4, rtol=0)


def test_alpha_is_one_minus_total_variation():
    torch.manual_seed(5)
    d, t = torch.randn(3, 7, 13), torch.randn(3, 7, 13)
    for T in (0.5, 1.0, 2.0):
        p, q = (t / T).softmax(-1), (d / T).softmax(-1)
        tv = 0.5 * (p - q).abs().sum(-1)
        torch.testing.assert_close(acceptance_alpha(d, t, T), 1 - tv, rtol=1e-5, atol=1e-6)


def test_wtv_equals_product_of_alphas():
    torch.manual_seed(6)
    d, t = torch.randn(1, 3, 6), torch.randn(1, 3, 6)
    a = acceptance_alpha(d, t)[0]
    _, E = wtv_loss(d, t, torch.ones(1, 3, dtype=torch.bool), form="log")
    assert E.item() == pytest.approx(float(a[0] + a[0] * a[1] + a[0] * a[1] * a[2]), rel=1e-5)


@pytest.mark.parametrize("loss_name", ["eal", "wtv", "wtv_stopgrad", "eal_linear", "eal_log_len", "wtv_log_len", "tv"])
def test_two_token_toy_gradients_are_finite_and_point_toward_the_target(loss_name):
    """Vocabulary {0, 1}, two slots, target wants token 0 in both: descending the loss raises q(0) in both slots."""
    z = torch.tensor([[[0.3, 0.5], [-20.0, 20.0]]], requires_grad=True)  # slot 2 is (almost) surely wrong
    t_logits = torch.tensor([[[4.0, -4.0], [4.0, -4.0]]])
    y = torch.tensor([[0, 0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    if loss_name == "eal":
        loss, _ = eal_loss(z, y, mask, form="log")
    elif loss_name == "eal_linear":
        loss, _ = eal_loss(z, y, mask, form="linear")
    elif loss_name == "eal_log_len":
        loss, _ = eal_loss(z, y, mask, form="log_len")
    elif loss_name == "wtv":
        loss, _ = wtv_loss(z, t_logits, mask, form="log")
    elif loss_name == "wtv_log_len":
        loss, _ = wtv_loss(z, t_logits, mask, form="log_len")
    elif loss_name == "wtv_stopgrad":
        loss, _ = wtv_loss(z, t_logits, mask, variant="stopgrad", form="log")
    else:
        loss = tv_hybrid_loss(z, t_logits, mask, torch.ones(2))
    loss.backward()
    g = z.grad[0]
    assert torch.isfinite(g).all()
    assert g[0, 0] < 0 < g[0, 1]  # slot 1: increase the logit of token 0
    assert g[1, 0] <= 0 <= g[1, 1]
    if loss_name != "tv":  # the window losses are front-weighted: the first slot matters most
        assert g[0, 0].abs() > g[1, 0].abs()


def test_stopgrad_variant_has_the_gradient_of_linear_E():
    torch.manual_seed(7)
    d = torch.randn(2, 4, 6, requires_grad=True)
    t = torch.randn(2, 4, 6)
    mask = torch.ones(2, 4, dtype=torch.bool)
    wtv_loss(d, t, mask, variant="stopgrad", form="log")[0].backward()
    g1 = d.grad.clone()
    d.grad = None
    _, E = wtv_loss(d, t, mask, form="log")
    (-E.mean()).backward()
    torch.testing.assert_close(g1, d.grad, rtol=1e-4, atol=1e-6)


def test_log_len_form_is_minus_log_E_with_full_strength_gradient_on_slot_one():
    """-log E: slot 1's gradient is exactly the CE gradient (weight 1) however small E is, while -log(1+E)'s
    gradient there shrinks with E; later slots get the share of E that needs them accepted (W_k / E)."""
    torch.manual_seed(8)
    K, V = 5, 7
    z = (torch.randn(1, K, V) * 3).requires_grad_()
    y = torch.randint(0, V, (1, K))
    y[0, 0] = z[0, 0].argmin()  # a hard first slot: E is small
    mask = torch.ones(1, K, dtype=torch.bool)
    loss, E = eal_loss(z, y, mask, form="log_len")
    assert loss.item() == pytest.approx(-float(E.detach().log()), rel=1e-5)
    loss.backward()
    z1 = z[0, 0].detach().requires_grad_()
    torch.nn.functional.cross_entropy(z1[None], y[0, :1]).backward()
    torch.testing.assert_close(z.grad[0, 0], z1.grad, rtol=1e-5, atol=1e-7)
    q = z.detach().softmax(-1)[0, torch.arange(K), y[0]]
    C = torch.cumprod(q, 0)
    W = torch.flip(torch.cumsum(torch.flip(C, [0]), 0), [0])  # W_k = sum_{i>=k} C_i
    for k in range(1, K):
        zk = z[0, k].detach().requires_grad_()
        (W[k] / E.detach()[0] * torch.nn.functional.cross_entropy(zk[None], y[0, k:k + 1])).backward()
        torch.testing.assert_close(z.grad[0, k], zk.grad, rtol=1e-4, atol=1e-7)
    z.grad = None
    eal_loss(z, y, mask, form="log")[0].backward()  # -log(1+E): slot 1's gradient is E/(1+E) times as strong
    assert z.grad[0, 0].norm() < 0.5 * z1.grad.norm()


def test_log_len_form_ignores_empty_blocks_without_nan():
    z = torch.randn(2, 3, 4, requires_grad=True)
    y = torch.randint(0, 4, (2, 3))
    mask = torch.tensor([[True, True, False], [False, False, False]])
    loss, _ = eal_loss(z, y, mask, form="log_len")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(z.grad).all()
    assert z.grad[1].abs().sum() == 0 and z.grad[0, 2].abs().sum() == 0
    only, _ = eal_loss(z[:1], y[:1], mask[:1], form="log_len")
    assert loss.item() == pytest.approx(only.item(), rel=1e-6)


def _greedy_len(g: list[int]) -> int:
    n = 0
    while n < len(g) and g[n]:
        n += 1
    return n


def test_greedy_slot_gains_are_the_counterfactual_change_in_accepted_length():
    """W_k = n(slot k hit) - n(slot k missed), the other slots at their outcome, for every outcome of 5 slots."""
    K = 5
    outcomes = torch.tensor(list(itertools.product([0, 1], repeat=K)), dtype=torch.bool)  # [32, K]
    W = greedy_slot_gains(outcomes, torch.ones_like(outcomes))
    for o, w in zip(outcomes.tolist(), W.tolist()):
        for k in range(K):
            hit, miss = list(o), list(o)
            hit[k], miss[k] = 1, 0
            assert w[k] == _greedy_len(hit) - _greedy_len(miss), (o, k)
    cut = greedy_slot_gains(torch.ones(1, K, dtype=torch.bool), torch.tensor([[True, True, False, True, True]]))
    assert cut[0].tolist() == [2, 1, 0, 0, 0]  # the window ends at the invalid slot


def test_greedy_eal_is_weighted_ce_on_slots_up_to_the_first_rejection():
    torch.manual_seed(9)
    K, V = 6, 5
    y = torch.randint(0, V, (1, K))
    z = torch.randn(1, K, V)
    z[0, torch.arange(K), y[0]] += 10  # every slot right ...
    z[0, 2, y[0, 2]] -= 20  # ... except slot 3: n = 2, and slots 4-6 would be accepted if slot 3 were fixed
    z.requires_grad_()
    loss, _ = eal_loss(z, y, torch.ones(1, K, dtype=torch.bool), variant="greedy", form="log")
    loss.backward()
    logq = z.detach().log_softmax(-1)[0, torch.arange(K), y[0]]
    W = torch.tensor([2.0, 1.0, 4.0, 0.0, 0.0, 0.0])  # slot 3 unlocks itself and the 3 hits after it
    assert loss.item() == pytest.approx(float(-(W * logq).sum() / W.sum()), rel=1e-5)
    assert z.grad[0, 3:].abs().sum() == 0  # past the first rejection greedy verification never looks
    assert z.grad[0, 2, y[0, 2]] < 0 and z.grad[0, 2].norm() > z.grad[0, 0].norm()  # the rejected slot, hardest
    with pytest.raises(ValueError, match="unknown EAL variant"):
        eal_loss(z, y, torch.ones(1, K, dtype=torch.bool), variant="nope", form="log")
