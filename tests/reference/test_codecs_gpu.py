"""GPU checks of the codecs: identical bits on CPU and GPU, and the hardware FP8 conversion
(``cvt.rn.satfinite.e4m3x2`` reached through Triton's ``.to(tl.float8e4nv)``) against the model.

Skipped without a GPU (marker ``gpu``); the Triton test also skips without Triton.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_numerics.reference.caches import model1 as cm
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.formats.fp8 import encode_e4m3fn, encode_e4m3fnuz, exact_ceil_log2
from dsv4_numerics.reference.policies import Fp8Flavour, NonFinite, ScaleRule
from dsv4_numerics.reference.formats.quant import quantize_groups_ue8m0, quantize_tiles

pytestmark = pytest.mark.gpu

ALL_BF16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _special_f32(n: int = 1 << 18) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    r = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).to(torch.float32))
    specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 464.0, 480.0, -0.0,
                             2.0**-10, 3 * 2.0**-10, 1e-45, -1e-45, 3.4e38])
    return torch.cat([r, specials, ALL_BF16.to(torch.float32)])


@pytest.mark.parametrize("policy", list(NonFinite))
def test_encoders_cpu_equals_gpu(policy):
    x = _special_f32()
    if policy is NonFinite.FINITE:
        x = x[torch.isfinite(x)]
    for xx in (x, x.to(torch.float64), x.to(torch.bfloat16)):
        if policy is NonFinite.FINITE:
            xx = xx[torch.isfinite(xx)]  # 3.4e38 rounds to bf16 inf
        assert torch.equal(encode_e4m3fn(xx, policy), encode_e4m3fn(xx.cuda(), policy).cpu())
        assert torch.equal(encode_e4m3fnuz(xx, nonfinite=policy), encode_e4m3fnuz(xx.cuda(), nonfinite=policy).cpu())


def test_ceil_log2_and_group_quantiser_cpu_equals_gpu():
    x = _special_f32()
    r = x.abs()[torch.isfinite(x) & (x != 0)]
    assert torch.equal(exact_ceil_log2(r), exact_ceil_log2(r.cuda()).cpu())
    y = x[torch.isfinite(x)][: 1 << 17].reshape(-1, 128)
    a, b = quantize_groups_ue8m0(y), quantize_groups_ue8m0(y.cuda())
    assert torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu())


@pytest.mark.parametrize("stage", ["swa_write", "compressed_write"])
def test_insert_cpu_equals_gpu(stage):
    for case in default_cases(stage):
        i = case.inputs
        for rule in ScaleRule:
            a = cm.insert(i["cache"], i["k"], i["slot_mapping"], i["block_size"], rule)
            b = cm.insert(i["cache"].cuda(), i["k"].cuda(), i["slot_mapping"].cuda(), i["block_size"], rule)
            assert torch.equal(a, b.cpu()), (case.name, rule)
        c1 = quantize_tiles(i["k"][:, :448], ScaleRule.AMAX_CLAMP, Fp8Flavour.E4M3FNUZ, clamp=224.0)
        c2 = quantize_tiles(i["k"][:, :448].cuda(), ScaleRule.AMAX_CLAMP, Fp8Flavour.E4M3FNUZ, clamp=224.0)
        assert torch.equal(c1[0], c2[0].cpu()) and torch.equal(c1[1], c2[1].cpu())


def test_gather_cpu_equals_gpu():
    for case in default_cases("gather"):
        i = case.inputs
        gl = i["gather_lens"]
        a = cm.gather(i["cache"], i["block_table"], i["seq_lens"], i["block_size"], gl)
        b = cm.gather(i["cache"].cuda(), i["block_table"].cuda(), i["seq_lens"].cuda(), i["block_size"],
                      None if gl is None else gl.cuda())
        assert torch.equal(a[0].view(torch.int16), b[0].cpu().view(torch.int16)) and torch.equal(a[1], b[1].cpu())


def test_hardware_fp8_conversion_matches_model():
    """Triton ``clamp`` + ``.to(float8e4nv)`` (the vLLM Triton writer's last two steps) and
    ``minimum(maximum(x, -448), 448)`` + cast (the CUDA writer's fminf/fmaxf) on real hardware."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    if torch.version.hip is not None:
        pytest.skip("float8e4nv conversion is the NVIDIA path")

    @triton.jit
    def cast_kernel(x_ptr, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        y = tl.clamp(x, -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        z = tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(y_ptr + offs, y, mask=m)
        tl.store(z_ptr + offs, z, mask=m)

    x = _special_f32().cuda()
    y = torch.empty(x.shape, dtype=torch.uint8, device="cuda")
    z = torch.empty_like(y)
    n = x.numel()
    cast_kernel[(triton.cdiv(n, 1024),)](x, y, z, n, BLOCK=1024)
    for got, pol in ((y, NonFinite.TRITON), (z, NonFinite.CUDA_SATFINITE)):
        want = encode_e4m3fn(x.cpu(), pol)
        bad = got.cpu() != want
        assert not bad.any(), (pol, [(hex(b), g, w) for b, g, w in zip(
            x.cpu()[bad][:8].view(torch.int32).tolist(), got.cpu()[bad][:8].tolist(), want[bad][:8].tolist())],
            int(bad.sum()))


def _tile_inputs() -> torch.Tensor:
    """bf16 tiles [T, 64]: magnitudes 2**-30..2**30, exact ties, tiny/zero tiles, NaN and Inf tiles."""
    g = torch.Generator().manual_seed(11)
    t = torch.randn(4096, 64, generator=g) * torch.exp2(torch.randint(-30, 30, (4096, 1), generator=g).float())
    ties = torch.rand(256, 64, generator=g) * 1.75
    ties[:, 0] = 1.75
    ties = ties * torch.exp2(torch.arange(-128, 128).float().unsqueeze(1) / 4).floor()  # 2**m scales
    tiny = torch.randn(256, 64, generator=g) * 1e-4
    tiny[:16] = 0.0
    tiny[16:32] = -0.0
    special = torch.randn(64, 64, generator=g)
    special[:16, 5] = float("nan")
    special[16:32, 9] = float("inf")
    special[32:48, 3] = -float("inf")
    special[48:, 7] = -float("nan")
    return torch.cat([t, ties, tiny, special]).to(torch.bfloat16)


def test_triton_tile_quantiser_replica_matches_model():
    """A Triton replica of datapath 2.0 Q_A as the vLLM Triton writer evaluates it (IEEE-ish fp32
    divide, libdevice log2, ceil, exp2, divide by the scale, tl.clamp, hardware e4m3 cast) and of
    the CUDA writer's variant (multiply by exp2(-e), fminf/fmaxf clamp) against quantize_tiles."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    if torch.version.hip is not None:
        pytest.skip("float8e4nv conversion is the NVIDIA path")

    @triton.jit
    def tile_kernel(x_ptr, tc_ptr, ts_ptr, cc_ptr, cs_ptr):
        row = tl.program_id(0)
        offs = row * 64 + tl.arange(0, 64)
        x = tl.load(x_ptr + offs).to(tl.float32)
        a = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4)
        e = tl.ceil(tl.log2(a / 448.0))
        tc = tl.clamp(x / tl.exp2(e), -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        cc = tl.minimum(tl.maximum(x * tl.exp2(-e), -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        s = tl.maximum(tl.minimum(e + 127.0, 255.0), 0.0).to(tl.uint8)
        tl.store(tc_ptr + offs, tc)
        tl.store(cc_ptr + offs, cc)
        tl.store(ts_ptr + row, s)
        tl.store(cs_ptr + row, s)

    x = _tile_inputs()
    n = x.shape[0]
    xc = x.cuda()
    tc = torch.empty(n, 64, dtype=torch.uint8, device="cuda")
    cc = torch.empty_like(tc)
    ts = torch.empty(n, dtype=torch.uint8, device="cuda")
    cs = torch.empty_like(ts)
    tile_kernel[(n,)](xc, tc, ts, cc, cs)
    for codes, sb, pol in ((tc, ts, NonFinite.TRITON), (cc, cs, NonFinite.CUDA_SATFINITE)):
        want_c, want_s = quantize_tiles(x, ScaleRule.AMAX_CLAMP, nonfinite=pol)
        bad_rows = (codes.cpu() != want_c).any(1) | (sb.cpu() != want_s[:, 0])
        assert not bad_rows.any(), (pol, bad_rows.nonzero().flatten()[:8].tolist(), int(bad_rows.sum()))
