"""CPU vs GPU bit-identity of the attention-area reference (the determinism claim of
``reference/attention/ordered.py``, ``detmath.py``, ``rope.py``, ``epilogue.py``). GPU only."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_numerics.reference.attention.ordered import Segment, bf16_p_error_bound, sparse_attention
from dsv4_numerics.reference.detmath import det_exp, det_log
from dsv4_numerics.reference.attention.epilogue import inv_rope_fp8_quant
from dsv4_numerics.reference.policies import RopeArithmetic
from dsv4_numerics.reference.pipeline.rope import YarnConfig, apply_rope, cos_sin_cache

pytestmark = pytest.mark.gpu


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        w = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.contiguous().view(w), b.contiguous().view(w))
    return torch.equal(a, b)


def test_det_exp_log_bits_cpu_vs_gpu():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(200000, generator=g, dtype=torch.float64) * 300,
                   torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -745.0, 709.7], dtype=torch.float64)])
    assert _bits_equal(det_exp(x), det_exp(x.cuda()))
    y = torch.cat([torch.rand(200000, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-300, 300, (200000,), generator=g),
                   torch.tensor([0.0, 1.0, math.inf, 5e-324, 1e-310], dtype=torch.float64)])
    assert _bits_equal(det_log(y), det_log(y.cuda()))


@pytest.mark.parametrize("mode", ["exact", "bf16_p"])
def test_oracle_bits_cpu_vs_gpu(mode):
    g = torch.Generator().manual_seed(1)
    T, H, N1, N2 = 6, 64, 300, 80
    q = torch.randn(T, H, 512, generator=g).clamp(-1, 1).to(torch.bfloat16)
    r1 = (torch.randn(N1, 512, generator=g) * 0.1).to(torch.bfloat16)
    r2 = (torch.randn(N2, 512, generator=g) * 0.1).to(torch.bfloat16)
    r1[7] = math.nan  # unreferenced poison
    i1 = torch.randint(-1, N1, (T, 128), generator=g, dtype=torch.int32)
    i1[i1 == 7] = 8
    i2 = torch.randint(-1, N2, (T, 64), generator=g, dtype=torch.int32)
    l1 = torch.tensor([128, 0, 5, 100, 128, 1], dtype=torch.int32)
    l2 = torch.tensor([64, 0, 0, 10, 3, 64], dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    sink[1], sink[2] = math.inf, -math.inf
    segs = lambda d: [Segment(r1.to(d), i1.to(d), l1.to(d)), Segment(r2.to(d), i2.to(d), l2.to(d))]  # noqa: E731
    a = sparse_attention(q, segs("cpu"), 512**-0.55, sink, mode=mode)
    b = sparse_attention(q.cuda(), segs("cuda"), 512**-0.55, sink.cuda(), mode=mode, chunk_tokens=4)
    for f in ("out", "lse", "lse_with_sink", "max_logits", "n_valid"):
        assert _bits_equal(getattr(a, f), getattr(b, f)), f
    if mode == "exact":
        assert _bits_equal(bf16_p_error_bound(q, segs("cpu"), 512**-0.55, sink),
                           bf16_p_error_bound(q.cuda(), segs("cuda"), 512**-0.55, sink.cuda()))


def test_rope_and_epilogue_bits_cpu_vs_gpu():
    g = torch.Generator().manual_seed(2)
    tab = cos_sin_cache(70000, theta=160000.0, yarn=YarnConfig(16.0, 65536))
    x = torch.randn(512, 16, 512, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 70000, (512,), generator=g)
    for arith in RopeArithmetic:
        for inv in (False, True):
            assert _bits_equal(apply_rope(x, pos, tab, inv, arith), apply_rope(x.cuda(), pos.cuda(), tab.cuda(), inv, arith))
    a = inv_rope_fp8_quant(x[:7], pos[:7], tab)
    b = inv_rope_fp8_quant(x[:7].cuda(), pos[:7].cuda(), tab.cuda())
    for f in ("rotated", "codes", "exponents", "scales_sm90", "scales_sm100", "dequantized"):
        assert _bits_equal(getattr(a, f), getattr(b, f)), f


def test_triton_epilogue_exponent_model():
    """Triton replica of fused_inv_rope_fp8_quant's quantiser math
    (``V:.../fused_inv_rope_fp8_quant.py:150-162``: ``max(amax, 1e-10) * (1/448)``,
    ``exp2(ceil(log2(.)))``, ``clamp(x / scale, +-448)`` -> ``float8e4nv``) gives exactly the
    exponents and codes of ``epilogue.quantize_groups_log2f`` on dense sweeps around every
    ``448 * 2**k`` and on random fp32 groups; the exact rule (``quant.quantize_groups_ue8m0``)
    is reported where it differs."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from dsv4_numerics.reference.attention.epilogue import quantize_groups_log2f
    from dsv4_numerics.reference.formats.quant import quantize_groups_ue8m0

    @triton.jit
    def _quant(x_ptr, code_ptr, scale_ptr, G: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, G)
        x = tl.load(x_ptr + row * G + offs)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10)
        scale_raw = amax * (1.0 / 448.0)
        scale = tl.math.exp2(tl.ceil(tl.log2(scale_raw)))
        q = tl.clamp(x / scale, -448.0, 448.0).to(tl.float8e4nv)
        tl.store(code_ptr + row * G + offs, q.to(tl.uint8, bitcast=True))
        tl.store(scale_ptr + row, scale)

    def run(x: torch.Tensor):
        n = x.shape[0]
        codes = torch.empty(n, 128, dtype=torch.uint8, device="cuda")
        scale = torch.empty(n, dtype=torch.float32, device="cuda")
        _quant[(n,)](x.cuda().contiguous(), codes, scale, G=128)
        e = torch.log2(scale.cpu().double()).round().to(torch.int32)
        return codes.cpu(), e

    g = torch.Generator().manual_seed(5)
    k = torch.arange(-40, 40, dtype=torch.float64)
    j = torch.arange(-32, 96, dtype=torch.float64)
    peaks = (448.0 * 2.0 ** k[:, None] * (1 + j[None, :] * 2.0**-23)).reshape(-1).to(torch.float32)
    x = torch.rand(peaks.numel(), 128, generator=g) * 2 - 1
    x = x * peaks[:, None].abs() * 0.99
    x[:, 17] = peaks
    rnd = torch.randn(4096, 128, generator=g) * torch.exp2(torch.randint(-20, 20, (4096, 1), generator=g).float())
    for xs in (x, rnd, rnd.to(torch.bfloat16).float()):
        codes, e = run(xs)
        mc, me = quantize_groups_log2f(xs)
        assert torch.equal(me[:, 0], e), f"{int((me[:, 0] != e).sum())} exponents differ"
        assert torch.equal(mc, codes), f"{int((mc != codes).sum())} codes differ"
        ec = quantize_groups_ue8m0(xs)[1][:, 0]
        print(f"\nexact rule differs from the kernel on {int((ec != e).sum())}/{e.numel()} groups")
