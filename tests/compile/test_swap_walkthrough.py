"""The walk-through of ``docs/architecture.md`` ("Adding a kernel swap"), done on the CPU: a toy
kernel file (its op declared from the place's function, a predicate of the shapes it serves) and
one table row, then a compiled function with the place in it: the op node where the kernel
serves the call, the reference and a recorded reason where it does not, nothing when the swap is
switched off by name. The fixture takes the place, the op and the pass back out afterwards."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch

from deepinfer_fx.graphs import swap
from deepinfer_fx.graphs.swap import swappable, swapped
from deepinfer_fx.kernels.declare import declare_op
from deepinfer_fx.passes import manager
from deepinfer_fx.passes.compiler import compile_graph, make_backend
from deepinfer_fx.passes.kernel_swap import SwapRow, register_swaps

pytestmark = pytest.mark.usefixtures("fresh_compile")

NAME, OP, MAX_WIDTH = "toy_tanh_kernel", "toy_scaled_tanh", 64


@pytest.fixture
def scaled_tanh(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., torch.Tensor]]:
    manager.registered_passes()  # the built-in passes first (their modules register on import)
    monkeypatch.setattr(manager, "_REGISTRY", dict(manager._REGISTRY))  # the toy pass leaves with the test
    monkeypatch.setattr(swap, "_PLACES", dict(swap._PLACES))  # and so does its place

    @swappable  # the model function (in graphs/): the place "test_swap_walkthrough.scaled_tanh"
    def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.tanh(x) * scale

    # --- the kernel file (kernels/ops_toy.py; its Triton launcher registers for "cuda") ---
    op = declare_op(OP, scaled_tanh, lambda x, **_: torch.empty_like(x))

    def toy_unserved(x: torch.Tensor, scale: float) -> str | None:
        return None if x.shape[-1] <= MAX_WIDTH else f"rows of {x.shape[-1]}: the toy kernel holds {MAX_WIDTH}"

    # --- the table row (passes/swaps.py: a row of SWAPS, which it registers like this) ---
    register_swaps([SwapRow(NAME, scaled_tanh.place, OP, unserved=toy_unserved)], __name__)  # type: ignore[attr-defined]
    yield scaled_tanh
    op._lib._destroy()  # take the op back out of torch.library
    torch._library.custom_ops.OPDEFS.pop(f"deepinfer::{OP}", None)
    torch.ops.deepinfer.__dict__.pop(OP, None)


def _run(fn: Callable[..., torch.Tensor], x: torch.Tensor, environ: dict[str, str]):
    be = make_backend("cpu", environ=environ)
    with torch.no_grad(), swapped(be.pipeline.swaps()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compile_graph(fn, be)(x)
    return be, got, [str(w.message) for w in caught if "declines" in str(w.message)]


def test_toy_swap_puts_its_op_in_the_graph_or_declines(scaled_tanh: Callable[..., torch.Tensor]) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return scaled_tanh(x * 2, 0.5) + 1

    x = torch.randn(3, MAX_WIDTH)
    be, got, warned = _run(step, x, {})
    assert NAME in be.pipeline.names and be.pipeline.names.index(NAME) == len(be.pipeline.names) - 1
    torch.testing.assert_close(got, step(x))
    assert be.rewrites()[NAME] == 1 and be.declines() == {} and warned == []  # one deepinfer::toy_scaled_tanh node

    wide = torch.randn(3, MAX_WIDTH + 1)
    be, got, warned = _run(step, wide, {})
    why = f"rows of {MAX_WIDTH + 1}: the toy kernel holds {MAX_WIDTH}"
    torch.testing.assert_close(got, step(wide))
    assert be.rewrites()[NAME] == 0 and be.declines() == {NAME: [why]}
    assert warned == [f"kernel swap {NAME!r} declines a call: {why}; the reference runs there"]

    be, got, _ = _run(step, x, {manager.ENV_DISABLE: NAME})  # switched off by name: the reference is traced
    torch.testing.assert_close(got, step(x))
    assert NAME not in be.pipeline.names and NAME not in be.rewrites()


def test_a_row_at_no_place_or_named_twice_is_refused(scaled_tanh: Callable[..., torch.Tensor]) -> None:
    with pytest.raises(ValueError, match="unknown place 'toy.nowhere'"):
        register_swaps([SwapRow("toy_nowhere_kernel", "toy.nowhere", OP)], __name__)
    row = SwapRow("toy_twice_kernel", scaled_tanh.place, OP)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="named twice"):
        register_swaps([row, row], __name__)
    with pytest.raises(ValueError, match="two passes are named 'rms_norm_fusion'"):
        register_swaps([SwapRow("rms_norm_fusion", scaled_tanh.place, OP)], __name__)  # type: ignore[attr-defined]
