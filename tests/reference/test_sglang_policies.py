"""``NonFinite.SGLANG_JIT`` (SGLang 0.5.23's JIT-CUDA V4 store, ``store.cuh:59-71``): its codes on
the tiles where it departs from the vLLM writers, written out by hand from the CUDA source."""

from __future__ import annotations

import torch

from dsv4_numerics.reference.formats import quant
from dsv4_numerics.reference.formats.fp8 import encode_e4m3fn
from dsv4_numerics.reference.policies import NonFinite

NAN, INF = float("nan"), float("inf")


def _tile(values: dict[int, float], fill: float = 1.0) -> torch.Tensor:
    x = torch.full((64,), fill)
    for i, v in values.items():
        x[i] = v
    return x.to(torch.bfloat16)


def test_inf_tile_multiplies_by_minus_inf():
    # inv_scale_ue8m0(255) = bits (254 - 255) << 23 = 0xFF800000 = -Inf: x * -Inf, then
    # fmaxf(fminf(v, 448), -448) -> -448 (0xFE) for x > 0, +448 (0x7E) for x < 0, and 0 * -Inf = NaN,
    # fminf(NaN, 448) = 448 -> 0x7E for +-0 and NaN elements
    x = _tile({0: INF, 1: -INF, 2: -2.5, 3: 0.0, 4: -0.0, 5: NAN})
    codes, sbytes = quant.quantize_tiles(x, "amax_clamp", nonfinite=NonFinite.SGLANG_JIT)
    assert sbytes.tolist() == [255]
    assert codes[:6].tolist() == [0xFE, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E]
    assert set(codes[6:].tolist()) == {0xFE}  # the 1.0 fill
    # the vLLM CUDA writer multiplies by exp2f(-inf) = +0 instead: +-0 codes, NaN -> 0xFE
    v_codes, v_bytes = quant.quantize_tiles(x, "amax_clamp", nonfinite=NonFinite.CUDA_SATFINITE)
    assert v_bytes.tolist() == [255] and v_codes[2].item() == 0x80 and v_codes[6].item() == 0x00


def test_nan_elements_ignored_by_the_amax_and_written_as_plus_448():
    x = _tile({7: NAN, 9: -NAN}, fill=-3.0)
    codes, sbytes = quant.quantize_tiles(x, "amax_clamp", nonfinite=NonFinite.SGLANG_JIT)
    ref_codes, ref_bytes = quant.quantize_tiles(_tile({}, fill=-3.0), "amax_clamp")
    assert sbytes.tolist() == ref_bytes.tolist()  # fmaxf drops the NaNs from the tile max
    assert codes[7].item() == 0x7E and codes[9].item() == 0x7E  # whatever the NaN's sign
    keep = [i for i in range(64) if i not in (7, 9)]
    assert codes[keep].tolist() == ref_codes[keep].tolist()


def test_element_encoder_clamp():
    v = torch.tensor([NAN, -NAN, INF, -INF, 500.0, -500.0])
    assert encode_e4m3fn(v, nonfinite=NonFinite.SGLANG_JIT).tolist() == [0x7E, 0x7E, 0x7E, 0xFE, 0x7E, 0xFE]
