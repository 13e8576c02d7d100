"""``reference.attention.triton_launch``: a kept compiled kernel launched directly gives what
``JITFunction`` gives, for every specialisation the key tells apart (pointer alignment, integers
equal to 1 / divisible by 16 / wider than 32 bits, constexpr values), and the launch goes through
``JITFunction`` where it must (the interpreter, launch hooks, ``DSV4_TRITON_DIRECT=0``). The
direct launches run only on a CUDA device; on the CPU the interpreter's path is checked."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel below is decorated
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from dsv4_numerics.reference.attention import triton_launch  # noqa: E402
from dsv4_numerics.reference.attention.triton_launch import launch  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="direct launches need a CUDA device (the CPU runs the interpreter)")


@triton.jit
def _affine(X, Y, n, a, b, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(X + i, mask=m, other=0.0)
    tl.store(Y + i, x * SCALE + a * 1.0 + b, mask=m)


def _run(x: torch.Tensor, n: int, a: int, b: float, scale: float, block: int = 64) -> torch.Tensor:
    y = torch.full_like(x, -7.0)
    launch(_affine, (triton.cdiv(max(n, 1), block),), x, y, n, a, b, SCALE=scale, BLOCK=block)
    return y


def _expected(x, n, a, b, scale):
    y = torch.full_like(x, -7.0)
    y[:n] = x[:n] * scale + a + b
    return y


@needs_cuda
def test_direct_launches_give_the_jit_results_for_every_specialisation(monkeypatch):
    monkeypatch.delenv(triton_launch.ENV, raising=False)
    triton_launch.clear()
    base = torch.arange(200, dtype=torch.float32, device=DEV)
    cases = [(base, 200, 3, 0.5, 2.0), (base, 1, 1, 0.0, 2.0), (base, 16, 16, -1.5, 3.0),
             (base[1:], 199, 17, 2.0, 2.0),  # a view 4 bytes past a 16-byte boundary
             (base[4:], 196, 2**33, 0.25, 2.0),  # 16-byte aligned view; an integer wider than 32 bits
             (base, 77, -5, 1.0, 0.5)]
    for _ in range(3):  # first round compiles through JITFunction, later rounds launch directly
        for x, n, a, b, scale in cases:
            torch.testing.assert_close(_run(x, n, a, b, scale), _expected(x, n, a, b, scale), rtol=0, atol=0)
    st = triton_launch.stats()
    assert st["jit"] <= len(cases) and st["direct"] >= 2 * len(cases)


@needs_cuda
def test_the_key_keeps_specialisations_apart(monkeypatch):
    """An aligned and a misaligned view, ``n == 1`` and ``n`` divisible by 16, and two values of a
    constexpr each reach their own compiled kernel: a key that merged them would launch a kernel
    specialised for the other and write a wrong value somewhere."""
    monkeypatch.delenv(triton_launch.ENV, raising=False)
    triton_launch.clear()
    x = torch.arange(64, dtype=torch.float32, device=DEV)
    _run(x, 32, 2, 0.0, 2.0)
    before = triton_launch.stats()["jit"]
    torch.testing.assert_close(_run(x[1:], 32, 2, 0.0, 2.0), _expected(x[1:], 32, 2, 0.0, 2.0), rtol=0, atol=0)
    torch.testing.assert_close(_run(x, 1, 2, 0.0, 2.0), _expected(x, 1, 2, 0.0, 2.0), rtol=0, atol=0)
    torch.testing.assert_close(_run(x, 32, 1, 0.0, 2.0), _expected(x, 32, 1, 0.0, 2.0), rtol=0, atol=0)
    torch.testing.assert_close(_run(x, 32, 2, 0.0, 4.0), _expected(x, 32, 2, 0.0, 4.0), rtol=0, atol=0)
    assert triton_launch.stats()["jit"] == before + 4  # each a new key: through JITFunction


@needs_cuda
def test_launch_hooks_and_the_switch_send_launches_through_jit(monkeypatch):
    from triton import knobs

    x = torch.arange(40, dtype=torch.float32, device=DEV)
    _run(x, 40, 1, 0.0, 2.0)
    seen = []
    hook = knobs.runtime.launch_enter_hook
    before = triton_launch.stats()["direct"]
    if hasattr(hook, "add"):  # Triton 3.6: a chain of hooks
        hook.add(seen.append)
        try:
            torch.testing.assert_close(_run(x, 40, 1, 0.0, 2.0), _expected(x, 40, 1, 0.0, 2.0), rtol=0, atol=0)
        finally:
            hook.remove(seen.append)
    else:
        with monkeypatch.context() as m:
            m.setattr(knobs.runtime, "launch_enter_hook", seen.append)
            torch.testing.assert_close(_run(x, 40, 1, 0.0, 2.0), _expected(x, 40, 1, 0.0, 2.0), rtol=0, atol=0)
    assert seen and triton_launch.stats()["direct"] == before  # the profiler's hook saw the launch
    _run(x, 40, 1, 0.0, 2.0)
    assert triton_launch.stats()["direct"] == before + 1  # no hook: direct again
    before += 1
    monkeypatch.setenv(triton_launch.ENV, "0")
    torch.testing.assert_close(_run(x, 40, 1, 0.0, 2.0), _expected(x, 40, 1, 0.0, 2.0), rtol=0, atol=0)
    assert triton_launch.stats()["direct"] == before


@pytest.mark.skipif(CUDA, reason="the interpreter's path: CPU only")
def test_the_interpreter_launches_through_jit():
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the kernel was compiled for a device: TRITON_INTERPRET was off at import")
    from dsv4_numerics.reference.attention.fast_fused import interpreter_index_shim

    interpreter_index_shim()
    triton_launch.clear()
    x = torch.arange(40, dtype=torch.float32)
    for _ in range(2):
        torch.testing.assert_close(_run(x, 33, 2, 0.5, 2.0), _expected(x, 33, 2, 0.5, 2.0), rtol=0, atol=0)
    assert triton_launch.stats() == {"direct": 0, "jit": 2}
