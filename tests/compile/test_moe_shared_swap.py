"""The ``moe_shared_fused_kernel`` swap: a compiled MoE sublayer (``graphs/moe.py::moe`` of a tiny
V4 layer) holds one ``deepinfer::moe_experts_shared`` node and equals eager; switched off, the
routed swap and the traced shared expert take its place, as before the fused op existed; with
routed experts held in fp8 or expert parallelism in force (the one-process EP group of
``tests/distributed/test_model_parallel.py``) it falls back to the reference, so those keep
their own paths. The kernel itself is ``tests/kernels/test_triton_moe_shared.py``; whole steps
are ``test_steps.py``."""

from __future__ import annotations

import os

import pytest
import torch
from tiny import FP8_EXPERTS, tiny_v4

from deepinfer_fx.api import random_model
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.graphs import moe
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.passes.compiler import compile_graph, make_backend
from deepinfer_fx.passes.manager import registered_passes
from deepinfer_fx.passes.swap_calls import FOLD_MAX_TOKENS
from deepinfer_fx.sharding import eplb
from deepinfer_fx.sharding.ep import ep_group
from deepinfer_fx.sharding.parallel import ep_swaps

pytestmark = pytest.mark.usefixtures("fresh_compile")

SHARED = registered_passes()["moe_shared_fused_kernel"]
FUSED, ROUTED = SHARED.name, registered_passes()["moe_experts_kernel"].name
LAYER, T = 1, 7  # a layer with learned routing; decode-sized


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little") >> 1


def _layer(seed: int, fp8: bool = False, t: int = T) -> tuple:
    """(config, the layer's FFN params, x, token ids, real rows) of a tiny V4 in fp32."""
    c = config_from_dict(tiny_v4(**(FP8_EXPERTS if fp8 else {})))
    c, params = random_model(c.replace(held_experts="fp8" if fp8 else None), seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, c.hidden_size, generator=g)
    ids = torch.randint(3, c.vocab_size, (t,), generator=g)
    return c, params["layers"][LAYER]["ffn"], x, ids, torch.ones(t, dtype=torch.bool)


def _compiled(c, p: dict, x, ids, real, disabled: tuple[str, ...] = (), outer: dict | None = None):
    """The MoE sublayer compiled with the cpu pipeline (minus ``disabled``) under its swaps,
    ``outer`` (e.g. EP) swapped in around them as the engine's runner does; -> (result, rewrites)."""
    be = make_backend("cpu", disabled=disabled, environ={})

    def sublayer(p: dict, x: torch.Tensor, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        return moe.moe(p, c, x, ids, real)

    with torch.no_grad(), swapped(outer or {}), swapped(be.pipeline.swaps()):
        got = compile_graph(sublayer, be)(p, x, ids, real)
    assert len(be.graphs) == 1
    return got, be.rewrites()


@pytest.mark.parametrize("enabled", [True, False])
def test_compiled_moe_equals_eager(enabled: bool) -> None:
    seed = _seed()
    c, p, x, ids, real = _layer(seed)
    want = moe.moe(p, c, x, ids, real)
    got, rewrites = _compiled(c, p, x, ids, real, disabled=() if enabled else (FUSED,))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    # on: one fused node and the routed place never reached; off: the routed op, as before
    assert (rewrites.get(FUSED, 0), rewrites.get(ROUTED, 0)) == ((1, 0) if enabled else (0, 1)), (
        f"seed={seed} {rewrites}"
    )


def test_eager_swap_equals_reference() -> None:
    """Installed eagerly (``swapped``, outside a compiled step) the swap gives the reference's bits on
    CPU, where the op runs its reference."""
    seed = _seed()
    c, p, x, ids, real = _layer(seed)
    want = moe.moe(p, c, x, ids, real)
    with swapped(SHARED.swap()):
        assert torch.equal(moe.moe(p, c, x, ids, real), want), f"seed={seed}"


@pytest.mark.parametrize("t", [FOLD_MAX_TOKENS, FOLD_MAX_TOKENS + 1])
def test_prefill_sized_steps_fall_back(t: int) -> None:
    """Up to ``FOLD_MAX_TOKENS`` tokens (decode) the shared expert is folded in; above, the
    traced shared expert and the routed op run, as before the fused op existed."""
    seed = _seed()
    c, p, x, ids, real = _layer(seed, t=t)
    got, rewrites = _compiled(c, p, x, ids, real)
    torch.testing.assert_close(
        got, moe.moe(p, c, x, ids, real), rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}"
    )
    fused = t <= FOLD_MAX_TOKENS
    assert (rewrites.get(FUSED, 0), rewrites.get(ROUTED, 0)) == ((1, 0) if fused else (0, 1)), f"seed={seed} {rewrites}"


def test_fp8_experts_fall_back() -> None:
    seed = _seed()
    c, p, x, ids, real = _layer(seed, fp8=True)
    got, rewrites = _compiled(c, p, x, ids, real)
    torch.testing.assert_close(
        got, moe.moe(p, c, x, ids, real), rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}"
    )
    assert (rewrites.get(FUSED, 0), rewrites.get(ROUTED, 0)) == (0, 1), f"seed={seed} {rewrites}"


def test_expert_parallel_falls_back() -> None:
    """One process, an EP group over physical slots with redundant experts: the fused op would
    read the logical expert ids against the slot-ordered stack, so only the EP region (which
    counts every pair it routes) gives the one-process result."""
    seed = _seed()
    c, p, x, ids, real = _layer(seed)
    want = moe.moe(p, c, x, ids, real)
    pl = eplb.default_placement(c.n_routed_experts, eplb.num_physical_experts(c.n_routed_experts, 1, 3), 1)
    group = ep_group(pl, T, c.num_experts_per_tok)
    local = {**p, "experts": {n: eplb.physical_experts(v, pl) for n, v in p["experts"].items()}}
    got, rewrites = _compiled(c, local, x, ids, real, outer=ep_swaps(group))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    assert (rewrites.get(FUSED, 0), rewrites.get(ROUTED, 0)) == (0, 1), f"seed={seed} {rewrites}"
    assert int(group.loads.sum()) == T * c.num_experts_per_tok, f"seed={seed}: the EP region did not run"


def test_wider_shared_expert_falls_back() -> None:
    """``n_shared_experts`` 2: the shared expert is twice a routed one's width, no expert of the
    stack; the swap traces the reference."""
    seed = _seed()
    c = config_from_dict(tiny_v4(n_shared_experts=2))
    c, params = random_model(c, seed=seed)
    _, _, x, ids, real = _layer(seed)
    p = params["layers"][LAYER]["ffn"]
    got, rewrites = _compiled(c, p, x, ids, real)
    torch.testing.assert_close(
        got, moe.moe(p, c, x, ids, real), rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}"
    )
    assert (rewrites.get(FUSED, 0), rewrites.get(ROUTED, 0)) == (0, 1), f"seed={seed} {rewrites}"
