"""CUDA-graph replay of the fast oracle's device work, for call signatures that come again.

The fast oracle (``attention_fast``) issues ~60 small kernels per call; at production decode
shapes the host's cost of launching them one by one (10-20 us each on the H200's hosts) is
larger than the GPU work itself. A CUDA graph replays the same kernels with one launch.

What is cached: per *signature* (device; shape and dtype of q, sink and every segment's rows,
indices and lengths; rules, scale, ``d_v``, NaN policy, chunks) one ``torch.cuda.CUDAGraph`` of
``attention_fast._issue`` (every kernel up to the call's one host sync) with its static input
buffers and outputs. A call with a cached signature writes its inputs into the static buffers (a bucketed
call straight into its padded layout: ``fast_buckets.write_padded``), replays, then runs the host side as an eager call would (deferred validation errors, the rare
chunks that need ordered logits) and returns clones of the outputs: results never alias the
cache, and the next replay cannot change them.

When: a signature is captured on its ``CAPTURE_AFTER``-th call (2: a shape seen once, as in
hypothesis fuzzing or a matrix of cases, never pays a capture, which costs about two eager
calls), unless ``fast_sparse_attention(graph=True)`` asks for it on the first call or
``graph=False`` refuses it. The cached graphs (all devices together) hold at most ``max_bytes``
(default ``GRAPH_CACHE_BYTES``, 2 GiB) and at most 1/64 of the capturing device's memory (a GPU
CI runner may run 16 test workers per GPU, each judging in its own process and in its kernel child:
32 caches, which together keep at most half the device), measured at capture, least recently used
evicted first; a signature larger than that, or whose capture failed, runs eagerly. ``set_enabled(False)`` or the
environment variable ``DSV4_FAST_GRAPHS=0`` turns the default (``graph=None``) off.

Numerics: a replay runs the kernels the eager call runs, on the same values; cuBLAS may choose
another GEMM algorithm under capture, which the fast oracle's bound already allows (it is not
bit-identical across devices or libraries either). Thread safety: ``LOCK`` serialises the calls
that use the cache (static buffers are shared).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["GraphCache", "CACHE", "LOCK", "GRAPH_CACHE_BYTES", "CAPTURE_AFTER", "set_enabled", "signature"]

GRAPH_CACHE_BYTES = 2 * 2**30
CAPTURE_AFTER = 2
_SEEN_MAX = 1024  # signatures remembered for the capture count
# the cache holds at most 1/64 of a device's memory. It was 1/32, sized for 16 workers per GPU, but each
# worker's kernel child judges too: 32 caches could claim the whole of an 80 GB H100 (a suspect, not
# confirmed, for the illegal address that cost a worker its CUDA context in both suite runs on one
# H100 and in none on the 141 GB H200s)
_DEVICE_SHARE = 64
LOCK = threading.RLock()


def signature(flat: list) -> tuple:
    """Shape and dtype of each tensor of ``flat`` (``None`` kept): what a captured graph fixes."""
    return tuple(None if t is None else (tuple(t.shape), t.dtype) for t in flat)


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    static: list  # the static inputs, None where the call had none (no sink, no lengths)
    issued: object
    nbytes: int
    state: object = None  # what the last ``fill`` returned (``GraphCache.replay``)


class GraphCache:
    """Captured graphs by signature key (see the module docstring). ``stats()``: counters."""

    def __init__(self, max_bytes: int = GRAPH_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.enabled = os.environ.get("DSV4_FAST_GRAPHS", "1").strip() not in ("0", "false", "no", "off")
        self._entries: OrderedDict = OrderedDict()
        self._seen: OrderedDict = OrderedDict()
        self._failed: dict = {}
        self._bytes = 0
        self.captures = self.replays = 0

    def stats(self) -> dict:
        return {"enabled": self.enabled, "entries": len(self._entries), "bytes": self._bytes,
                "captures": self.captures, "replays": self.replays, "failed": dict(self._failed)}

    def clear(self) -> None:
        """Drop every graph (their memory returns to PyTorch's caching allocator) and the counts."""
        self._entries.clear()
        self._seen.clear()
        self._failed.clear()
        self._bytes = 0

    def replay(self, key, flat: Callable[[], list], nbytes: Callable[[], int], issue: Callable[[list], object],
               fill: Callable[[list, object], object], always: bool = False):
        """``(issued, static)`` of a replay for ``key`` -- the graph's outputs and its static inputs,
        both valid until the next replay -- capturing ``issue(static_inputs)`` when the signature is
        due; ``None`` where the call should run eagerly (not due yet, disabled, capture failed, too
        large). ``flat()``: the call's inputs in the static buffers' shapes (called only to capture:
        the static buffers start as copies of them). The call reaches the static buffers through
        ``fill(static, state) -> state`` (``state``: what the previous fill of this graph returned,
        None after the capture; ``fast_buckets.write_padded`` writes a call into its bucket's padded
        layout without building it). ``nbytes()``: the caller's upper estimate of the graph's bytes
        (called before a capture, to make room); what is kept is measured (the private pool's new
        segments plus the static inputs), and a graph larger than ``max_bytes`` is dropped, its
        signature then eager."""
        e = self._entries.get(key)
        if e is None:
            if not (self.enabled or always) or key in self._failed:
                return None
            n = self._seen.pop(key, 0) + 1
            self._seen[key] = n
            if len(self._seen) > _SEEN_MAX:
                self._seen.popitem(last=False)
            if n < CAPTURE_AFTER and not always:
                return None
            e = self._capture(key, flat(), nbytes(), issue)
            if e is None:
                return None
        else:
            self._entries.move_to_end(key)
        e.state = fill(e.static, e.state)
        e.graph.replay()
        self.replays += 1
        return e.issued, e.static

    def _capture(self, key, flat: list, nbytes: int, issue) -> _Entry | None:
        dev = next(t.device for t in flat if t is not None)
        limit = min(self.max_bytes, torch.cuda.get_device_properties(dev).total_memory // _DEVICE_SHARE)
        self._make_room(min(nbytes, limit), limit)
        with torch.cuda.device(dev):
            static = [None if t is None else torch.empty(t.shape, dtype=t.dtype, device=dev).copy_(t) for t in flat]
            # warm-up on the current stream: fills every constant cache the kernels read (a cache
            # miss would copy from the host inside the capture) and initialises lazy library state
            issue(static)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    r0 = torch.cuda.memory_reserved(dev)  # after the context's empty_cache
                    issued = issue(static)
                    r1 = torch.cuda.memory_reserved(dev)
            except Exception as exc:  # an op that cannot be captured: this signature stays eager
                self._failed[key] = f"{type(exc).__name__}: {exc}"[:300]
                return None
            # the graph's private pool (new segments) and the static inputs
            size = max(0, r1 - r0) + sum(t.numel() * t.element_size() for t in static if t is not None)
        if size > limit:
            self._failed[key] = f"needs {size} bytes, more than the cache's {limit}"
            return None
        self._make_room(size, limit)
        e = self._entries[key] = _Entry(graph, static, issued, size)
        self._seen.pop(key, None)
        self._bytes += size
        self.captures += 1
        return e

    def _make_room(self, need: int, limit: int) -> None:
        """Evict the least recently used graphs until ``need`` more bytes fit under ``limit``."""
        while self._entries and self._bytes + need > limit:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes


CACHE = GraphCache()


def set_enabled(enabled: bool) -> None:
    """Turn the default graph replay (``fast_sparse_attention(graph=None)``) on or off; off also
    drops the cached graphs."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_enabled: enabled must be a bool, got {enabled!r}")
    with LOCK:
        CACHE.enabled = enabled
        if not enabled:
            CACHE.clear()
