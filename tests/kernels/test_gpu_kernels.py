"""The compiled kernels on a GPU at real sizes (``pytest -m gpu``; skipped with a reason elsewhere)."""

import pytest
import torch

from specdraft.kernels.dispatch import HAVE_TRITON
from specdraft.kernels.speculative_attention import (
    pack_mask,
    speculative_attention_reference,
    speculative_attention_triton,
)
from tests.helpers import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda,
              pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install '.[triton]')")]


@pytest.mark.parametrize(("B", "L", "T"), [(1, 4096, 16), (1, 4000, 80), (8, 1023, 33), (3, 0, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_speculative_attention_at_qwen3_8b_shapes(B, L, T, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 32, T, 128, generator=g).to("cuda", dtype)
    k = torch.randn(B, 8, L + T + 5, 128, generator=g).to("cuda", dtype)
    v = torch.randn(B, 8, L + T + 5, 128, generator=g).to("cuda", dtype)
    lengths = torch.tensor([max(L - 7 * b, 0) for b in range(B)], device="cuda")
    mask = (torch.rand(B, T, T, generator=g) < 0.5).tril().to("cuda") | torch.eye(T, dtype=torch.bool, device="cuda")
    bits = pack_mask(mask)
    got = speculative_attention_triton(q, k, v, lengths, bits, 128 ** -0.5)
    want = speculative_attention_reference(q, k, v, lengths, bits, 128 ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
