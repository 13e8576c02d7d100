"""The ordered oracle's one-launch multiply-add steps give the same bits as its multiply-then-add steps.

``ordered.scaled_logits`` and ``ordered.seq_pv`` issue one ``addcmul_`` per step where every product
is exact in float64 (``ordered.exact_product``: q times a row value; bf16 P times a row value in the
BF16_P numerator): rounded first or fused into an FMA, an exact product gives the same sum. These
tests hold that to adversarial values (wide exponents, subnormals, signed zeros, Inf, NaN) for each
pair of dtypes the oracle meets, and check that pairs whose products are not exact keep the two-step
loop.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_numerics.oracles.stages.core import SAME_PRECISION_DEVICE_BUDGET_BYTES, same_precision_chunk
from dsv4_numerics.reference.attention.ordered import (
    AttentionMode,
    IndexRule,
    Segment,
    auto_chunk_tokens,
    exact_product,
    scaled_logits,
    seq_pv,
    sparse_attention,
)
from dsv4_numerics.reference.attention import ordered

PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float32, torch.float32),
         (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float32)]


def _adversarial(shape, dtype, gen) -> torch.Tensor:
    """Values of ``dtype`` (returned as float64) over a wide exponent range, with zeros of both signs,
    the dtype's subnormals, +-Inf (where the dtype has them) and NaN sprinkled in."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-40, 40, shape, generator=gen).float())
    x = x.to(dtype).to(torch.float64).reshape(-1)
    n = x.numel()
    tiny = 2.0**-9 if dtype == torch.float8_e4m3fn else torch.finfo(dtype).tiny / 8
    for frac, val in ((50, 0.0), (200, -0.0), (500, float("inf")), (500, float("-inf")), (500, float("nan")),
                      (300, tiny)):
        x[torch.randint(0, n, (max(1, n // frac),), generator=gen)] = val
    return x.to(dtype).to(torch.float64).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a.view(torch.int64) == b.view(torch.int64)) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("dq,dk", PAIRS, ids=lambda d: str(d).replace("torch.", ""))
def test_fused_steps_same_bits(dq, dk):
    assert exact_product(dq, dk)
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        q, g = _adversarial((3, 5, 64), dq, gen), _adversarial((3, 7, 64), dk, gen)
        assert _same_bits(scaled_logits(q, g, 0.125), scaled_logits(q, g, 0.125, exact_products=True))
        p = _adversarial((3, 5, 7), torch.bfloat16, gen).abs()
        v = _adversarial((3, 7, 16), dk, gen)
        assert _same_bits(seq_pv(p, v), seq_pv(p, v, exact_products=True))


def test_exact_product_rule():
    assert not exact_product(torch.float64, torch.bfloat16)
    assert not exact_product(torch.bfloat16, torch.float64)
    assert exact_product(torch.float32, torch.float32)  # 24 + 24 <= 53
    assert not exact_product(torch.int32, torch.bfloat16)


@pytest.mark.parametrize("mode", [AttentionMode.EXACT, AttentionMode.BF16_P])
def test_oracle_same_bits_with_and_without_fused_steps(mode, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    T, H, K, D = 3, 4, 40, 64
    rows = _adversarial((96, D), torch.bfloat16, gen).to(torch.bfloat16)
    rows[rows.isnan().any(dim=1) | rows.isinf().any(dim=1)] = 1.0  # most rows finite (NaN / Inf rows below)
    rows[5] = float("nan")
    rows[9, 3] = float("inf")
    idx = torch.randint(-1, 96, (T, K), generator=gen, dtype=torch.int32)
    q = (torch.randn(T, H, D, generator=gen) * 4).to(torch.bfloat16)
    sink = torch.tensor([0.5, float("-inf"), float("inf"), -2.0])
    seg = [Segment(rows, idx, None, IndexRule.MINUS1_ONLY)]
    fused = sparse_attention(q, seg, D**-0.5, sink, mode=mode)
    fin = fused.out.isfinite()
    assert fin.any() and not fin.all()  # finite outputs and NaN-poisoned rows both judged
    monkeypatch.setattr(ordered, "exact_product", lambda a, b: False)
    plain = sparse_attention(q, seg, D**-0.5, sink, mode=mode)
    for name, a in fused.as_dict().items():
        b = plain.as_dict()[name]
        if a.is_floating_point():
            assert _same_bits(a, b)
        else:
            assert torch.equal(a, b)


def test_same_precision_chunk():
    q = torch.zeros(128, 64, 512, dtype=torch.bfloat16)
    segs = [Segment(torch.zeros(10, 512, dtype=torch.bfloat16), torch.zeros(128, 128, dtype=torch.int32), None,
                    IndexRule.MINUS1_ONLY),
            Segment(torch.zeros(10, 512, dtype=torch.bfloat16), torch.zeros(128, 2048, dtype=torch.int32), None,
                    IndexRule.MINUS1_ONLY)]
    assert same_precision_chunk(q, segs, torch.device("cpu")) is None
    c = same_precision_chunk(q, segs, torch.device("cuda"))
    assert c == auto_chunk_tokens(64, 2176, 512, 512, 2, budget_bytes=SAME_PRECISION_DEVICE_BUDGET_BYTES)
    assert ordered.peak_bytes_estimate(c, 64, 2176, 512, 512, 2) <= SAME_PRECISION_DEVICE_BUDGET_BYTES
    assert c > auto_chunk_tokens(64, 2176, 512, 512, 2)  # fewer chunks than the oracle's own default
