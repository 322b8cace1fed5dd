"""The window ring of a decode step is written in place once compiled. Inductor turns the ring
write (an ``index_put_`` on a step input) into a scatter into that input, unless the old ring
is read before the write: then it copies the whole ring, writes the copy and copies it back,
twice the ring's bytes per layer per step for one new row. ``window_keys`` reads a one-token
chunk's window after its write, and so a verify chunk's of ``k + 1`` rows in a ring of
``window + k`` (a speculating engine's); this checks the generated code allocates no ring-sized
buffer for them, and (the search's control) does for a chunk of several tokens in a ring without
spare rows, which must read first. All equal eager."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from deepinfer_fx.graphs.batch import Group
from deepinfer_fx.graphs.window import window_keys

pytestmark = pytest.mark.usefixtures("fresh_compile")

SLOTS, W, D = 3, 8, 16


def _group(length: int, starts: list[int]) -> Group:
    c = len(starts)
    index = torch.arange(c * length).view(c, length)
    return Group(index, torch.arange(c), torch.tensor(starts), torch.full((c,), length))


@pytest.mark.parametrize("length, spare", [(1, 0), (3, 0), (3, 2), (4, 5)])
def test_compiled_window_keys(length: int, spare: int) -> None:
    seed = int.from_bytes(os.urandom(4), "little") >> 1
    g = torch.Generator().manual_seed(seed)
    ring = torch.randn(SLOTS + 1, W + spare, D, generator=g)
    kv = torch.randn(SLOTS, length, D, generator=g)
    group = _group(length, [5, 11, 30])
    eager_ring = ring.clone()
    want = window_keys(eager_ring, kv, group, W)
    fn = torch.compile(lambda r, x: window_keys(r, x, group, W), backend="inductor", fullgraph=True)
    got, codes = run_and_get_code(fn, ring, kv)
    for a, b in zip(got, want):
        assert torch.equal(a, b), f"seed={seed}"
    assert torch.equal(ring, eager_ring), f"seed={seed}"
    rows = W + spare
    ring_buffers = sum(len(re.findall(rf"empty_strided\w*\(\({SLOTS + 1}, {rows}, {D}\)", code)) for code in codes)
    # A chunk longer than the spare rows allow must read the ring before writing it, and gets
    # the copy: the control that the search below finds a ring-sized buffer where Inductor makes
    # one (should a later Inductor write that case in place too, drop this half).
    in_place = length <= spare + 1
    assert (ring_buffers == 0) == in_place, f"seed={seed}: {ring_buffers} ring-sized buffers\n{codes[-1]}"
