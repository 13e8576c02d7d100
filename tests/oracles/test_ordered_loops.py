"""The Triton loops of ``oracles.ordered_loops`` give the ordered oracle's PyTorch loops' bits.

On a CUDA device the kernels run compiled (the judge's configuration); on a CPU with Triton
installed they run in Triton's interpreter (the same per-element recurrences; the compiled
kernels' no-FMA setting is what the GPU run checks). Values: float64 copies of bfloat16 / FP8
values (exact products, the oracle's case) and arbitrary float64 values (inexact products: a
contracted FMA would show), each with signed zeros, subnormals, +-Inf and NaN sprinkled in. Without
Triton the tests skip, saying so; the install rules are checked everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Triton reads the interpreter switch when it is imported; without a GPU nothing can be compiled
    # anyway, so every Triton kernel of this process runs interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsv4_numerics.oracles import ordered_loops as loops
from dsv4_numerics.reference.attention import ordered

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


@pytest.fixture
def where():
    """The device the kernels run on: CUDA when present, else the CPU through Triton's interpreter."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (the Triton loops are a GPU judge's accelerator)")
    yield "cuda" if CUDA else "cpu"


def _values(shape, kind: str, gen) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-30, 30, shape, generator=gen).to(torch.float64))
    if kind != "float64":
        x = x.to(getattr(torch, kind)).to(torch.float64)
    flat = x.view(-1)
    n = flat.numel()
    tiny = 2.0**-1070 if kind == "float64" else torch.finfo(getattr(torch, kind)).tiny / 4
    for frac, val in ((40, 0.0), (80, -0.0), (300, float("inf")), (300, float("-inf")), (300, float("nan")),
                      (100, tiny)):
        flat[torch.randint(0, n, (max(1, n // frac),), generator=gen)] = val
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a.view(torch.int64) == b.view(torch.int64)) | (a.isnan() & b.isnan())).all())


def _torch_loops(fn, *args):
    saved = ordered.loop_backend()
    ordered.set_loop_backend(None)
    try:
        return fn(*args)
    finally:
        ordered.set_loop_backend(saved)


SHAPES = [(1, 1, 1, 1), (3, 5, 37, 19), (2, 64, 70, 40)]  # (c, H, K, D): edge, odd, the blocks' edges


@pytest.mark.parametrize("kind", ["bfloat16", "float8_e4m3fn", "float64"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_loops_same_bits(where, kind, shape):
    c, H, K, D = shape
    gen = torch.Generator().manual_seed(c * 1000 + H + K + D)
    q = _values((c, H, D), kind, gen).to(where)
    g = _values((c, K, D), kind, gen).to(where)
    assert _same_bits(loops.scaled_logits_unscaled(q, g), _torch_loops(ordered.scaled_logits, q, g, 1.0))
    x = _values((c, H, K), kind, gen).to(where)
    assert _same_bits(loops.seq_sum_last(x), _torch_loops(ordered.seq_sum_last, x))
    p = _values((c, H, K), kind, gen).abs().to(where)
    v = _values((c, K, D), kind, gen).to(where)
    assert _same_bits(loops.seq_pv(p, v), _torch_loops(ordered.seq_pv, p, v))


def test_strided_inputs(where):
    gen = torch.Generator().manual_seed(5)
    q = _values((6, 4, 24), "bfloat16", gen).to(where).transpose(0, 1)  # non-contiguous views
    g = _values((9, 4, 24), "bfloat16", gen).to(where).transpose(0, 1)
    assert not q.is_contiguous() and not g.is_contiguous()
    assert _same_bits(loops.scaled_logits_unscaled(q, g), _torch_loops(ordered.scaled_logits, q, g, 1.0))


@pytest.mark.skipif(not CUDA, reason="the installed backend serves CUDA tensors only (no GPU visible)")
@pytest.mark.parametrize("mode", ["exact", "bf16_p"])
def test_oracle_same_bits_with_backend(mode):
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    gen = torch.Generator().manual_seed(11)
    T, H, K, D = 5, 16, 300, 512
    rows = _values((700, D), "bfloat16", gen).clamp(-1e4, 1e4).nan_to_num(0.0).to(torch.bfloat16)
    rows[3] = float("nan")
    idx = torch.randint(-1, 700, (T, K), generator=gen, dtype=torch.int32)
    q = (torch.randn(T, H, D, generator=gen)).to(torch.bfloat16)
    sink = torch.linspace(-3, 3, H)
    seg = [ordered.Segment(rows.cuda(), idx.cuda(), None, ordered.IndexRule.MINUS1_ONLY)]
    plain = _torch_loops(ordered.sparse_attention, q.cuda(), seg, D**-0.5, sink.cuda(), None, mode)
    saved = ordered.loop_backend()
    assert loops.install()
    try:
        fast = ordered.sparse_attention(q.cuda(), seg, D**-0.5, sink.cuda(), mode=mode)
    finally:
        ordered.set_loop_backend(saved)
    for name, a in fast.as_dict().items():
        b = plain.as_dict()[name]
        assert _same_bits(a, b) if a.is_floating_point() else torch.equal(a, b), name


def test_backend_declines_what_it_does_not_serve():
    x = torch.zeros(2, 3, 4, dtype=torch.float64)
    assert loops.backend("seq_sum_last", x) is None  # a CPU tensor: the PyTorch loop
    if CUDA:
        assert loops.backend("seq_sum_last", x.cuda().float()) is None  # float32 chains (oracles/derive.py)
        assert loops.backend("seq_sum_last", x[:0].cuda()) is None  # empty


def test_install_rules(monkeypatch):
    saved = ordered.loop_backend()
    try:
        monkeypatch.setenv(loops.ENV, "torch")
        ordered.set_loop_backend(loops.backend)
        assert loops.install() is False
        assert ordered.loop_backend() is None  # the env turns an installed backend off again
        assert loops.available() == (False, f"{loops.ENV}=torch")
        monkeypatch.delenv(loops.ENV)
        assert loops.install() is HAVE_TRITON
        assert (ordered.loop_backend() is loops.backend) is HAVE_TRITON
    finally:
        ordered.set_loop_backend(saved)
