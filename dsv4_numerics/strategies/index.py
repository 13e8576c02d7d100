"""Public hypothesis strategies for the index plumbing (datapath 4): the ones behind this suite's
own index fuzz tests, for kernel authors' own properties. Needs hypothesis
(``pip install "dsv4-numerics[test]"``).

- :func:`batches`: a batch of 1-3 requests with sequence lengths, query lengths (the last
  ``query_len`` positions of each request are its query tokens), a *permuted* block table (physical
  pages drawn as a random permutation; page 0 is reserved as vLLM's null block and fills the
  unused cells) and the derived ``query_start_loc`` / ``token_to_req_indices`` / ``positions``.
- :func:`topk_rows`: request-local top-k rows for the tokens of a batch, as a valid prefix or
  with the valid entries scattered among ``-1`` (interior ``-1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from hypothesis import strategies as st
except ImportError as _e:  # hypothesis is an optional dependency (the ``test`` extra)
    raise ImportError(
        "dsv4_numerics.strategies.index needs hypothesis, an optional dependency: "
        'pip install "dsv4-numerics[test]"') from _e

BLOCK_SIZES = (2, 53, 61, 64, 256)


@dataclass
class Batch:
    block_size: int
    seq_lens: list[int]
    query_lens: list[int]
    block_table: torch.Tensor  # int32 [R, B]
    query_start_loc: torch.Tensor  # int32 [R + 1], base 0
    token_to_req: torch.Tensor  # int32 [T]
    positions: torch.Tensor  # int64 [T]

    @property
    def num_tokens(self) -> int:
        return int(self.token_to_req.shape[0])

    def pages(self, r: int) -> int:
        return -(-self.seq_lens[r] // self.block_size)

    def owned_pages(self, r: int) -> set[int]:
        return set(int(b) for b in self.block_table[r, : self.pages(r)].tolist())


@st.composite
def batches(draw, max_reqs: int = 3, block_sizes=BLOCK_SIZES, max_seq: int = 600,
            max_query: int = 12, min_seq: int = 1) -> Batch:
    bs = draw(st.sampled_from(block_sizes))
    r = draw(st.integers(1, max_reqs))
    seqs = [draw(st.integers(min_seq, max_seq)) for _ in range(r)]
    qls = [draw(st.integers(1, min(s, max_query))) for s in seqs]
    pages = [-(-s // bs) for s in seqs]
    width = max(pages) + draw(st.integers(0, 2))
    spare = draw(st.integers(0, 3))
    perm = draw(st.permutations(list(range(1, sum(pages) + spare + 1))))
    table = torch.zeros((r, width), dtype=torch.int32)
    at = 0
    for i, n in enumerate(pages):
        table[i, :n] = torch.tensor(perm[at: at + n], dtype=torch.int32)
        at += n
    qsl = [0]
    for q in qls:
        qsl.append(qsl[-1] + q)
    req = [i for i, q in enumerate(qls) for _ in range(q)]
    pos = [s - q + j for s, q in zip(seqs, qls) for j in range(q)]
    return Batch(bs, seqs, qls, table, torch.tensor(qsl, dtype=torch.int32),
                 torch.tensor(req, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64))


@st.composite
def topk_rows(draw, visible: list[int], width: int, prefix: bool | None = None) -> torch.Tensor:
    """One row per entry of ``visible``: distinct local indices in ``[0, visible[t])``.

    prefix True: valid entries fill the first columns; False: scattered with interior ``-1``
    where possible; None: either, per row.
    """
    rows = []
    for v in visible:
        n = draw(st.integers(0, min(v, width)))
        vals = draw(st.lists(st.integers(0, max(v - 1, 0)), min_size=n, max_size=n, unique=True)) if n else []
        row = [-1] * width
        as_prefix = draw(st.booleans()) if prefix is None else prefix
        if as_prefix:
            row[:n] = vals
        else:
            cols = sorted(draw(st.permutations(list(range(width))))[:n])
            for c, x in zip(cols, vals):
                row[c] = x
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32).reshape(len(visible), width)


def is_prefix_row(row: list[int]) -> bool:
    seen_empty = False
    for x in row:
        if x < 0:
            seen_empty = True
        elif seen_empty:
            return False
    return True
