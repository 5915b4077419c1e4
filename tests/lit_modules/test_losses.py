import torch
import torch.nn.functional as F

from specdraft.lit_modules import losses
from specdraft.lit_modules.losses import decayed_ce, forward_kl


def test_decayed_ce_matches_manual_weighted_mean():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4, 10)  # [B, N, K, V]
    labels = torch.randint(0, 10, (2, 3, 4))
    mask = torch.rand(2, 3, 4) > 0.3
    w = torch.tensor([1.0, 0.5, 0.25, 0.125])
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(2, 3, 4)
    expected = (ce * w * mask).sum() / (w * mask).sum()
    assert torch.allclose(decayed_ce(logits, labels, mask, w), expected)


def test_chunking_does_not_change_the_result(monkeypatch):
    torch.manual_seed(1)
    logits, labels = torch.randn(5, 7, 13), torch.randint(0, 13, (5, 7))
    mask, w = torch.ones(5, 7, dtype=torch.bool), torch.ones(7)
    full = decayed_ce(logits, labels, mask, w)
    monkeypatch.setattr(losses, "ROW_CHUNK", 3)
    assert torch.allclose(decayed_ce(logits, labels, mask, w), full)


def test_forward_kl_zero_iff_equal_and_positive_otherwise():
    torch.manual_seed(2)
    t = torch.randn(3, 4, 9)
    m, w = torch.ones(3, 4, dtype=torch.bool), torch.ones(4)
    assert forward_kl(t, t, m, w).abs() < 1e-6
    assert forward_kl(torch.randn(3, 4, 9), t, m, w) > 0.01


def test_masked_slots_do_not_contribute():
    logits = torch.randn(1, 2, 5)
    labels = torch.tensor([[1, 2]])
    w = torch.ones(2)
    a = decayed_ce(logits, labels, torch.tensor([[True, False]]), w)
    logits2 = logits.clone()
    logits2[0, 1] = 100.0 * torch.randn(5)
    assert torch.allclose(a, decayed_ce(logits2, labels, torch.tensor([[True, False]]), w))


def test_forward_kl_is_kl_p_target_q_draft_as_torch_computes_it():
    """Direction and scale pinned against ``F.kl_div`` (``kl_div(log q, p) = KL(p || q)``): the reverse direction
    KL(q || p), a missing temperature or an unweighted mean all give a different number."""
    torch.manual_seed(3)
    d, t = torch.randn(2, 3, 4, 11), torch.randn(2, 3, 4, 11) * 2  # [B, N, K, V]
    mask = torch.rand(2, 3, 4) > 0.2
    w = torch.tensor([1.0, 0.6, 0.3, 0.1])
    T = 0.7
    logq, logp = F.log_softmax(d / T, -1), F.log_softmax(t / T, -1)
    per_slot = F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)  # [B, N, K] = KL(p || q)
    expected = (per_slot * w * mask).sum() / (w * mask).sum()
    got = forward_kl(d, t, mask, w, temperature=T)
    torch.testing.assert_close(got, expected)
    reverse = (F.kl_div(logp, logq, log_target=True, reduction="none").sum(-1) * w * mask).sum() / (w * mask).sum()
    assert (got - reverse).abs() > 0.05  # the test can tell the directions apart on these logits
