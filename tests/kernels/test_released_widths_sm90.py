"""Every Triton kernel at every released width, compiled offline for the H200 (sm_90), so a width
that breaks a kernel fails here and not on a user's GPU.

For each released config (``tests/models/released.py``) the launches its compiled steps make are
found without a GPU (``model_launches.py``: the step functions on ``meta`` tensors of the real
shapes, each ``deepinfer`` op's CUDA launcher deciding its tiling, launches specialised for sm_90
as a real launch would be), in bf16:

- ``steps``: the nvidia pipeline as the engine runs it, decode batches of 1, 16, 64 and 256 and a
  4096-token prefill chunk;
- ``fp8``: the routed experts held in block fp8 (``expert_format="fp8"``, a ``-Base``
  checkpoint's) and the dense projections too (``dense_format="fp8"``: the skinny GEMV reading
  fp8 tiles at decode), decode 1 and 64 and the prefill chunk;
- ``mhc-off``: ``DEEPINFER_DISABLE_PASSES=mhc_site_kernel,mhc_head_kernel`` (the Sinkhorn kernel
  and the reference's GEMMs instead; the Sinkhorn tiling reads the stream count only), decode 1;
- ``invariant``: batch-invariant inference's table over the swaps (``passes/batch_invariant.py``:
  its matmul, reduction, attention and expert kernels and the nvidia table's invariant kernels: mHC sites,
  the compressor, norms, RoPE, the mHC expand), decode 1 and 64 and the prefill chunk.

Configs with one trunk (V4-Flash and -0731: the steps do not run the draft model) are traced once,
and each trunk compiles in its own process, all at once.

Each distinct launch is compiled and assembled by ptxas: it must compile, spill no more than the
same kernel does at P8's widths (``P8_SPILLS``), and no kernel swap may decline a call at a
released width. The mHC kernels' numerics at the wide widths are ``test_triton_mhc.py``'s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_launches import CASES
from released import RELEASED, released_path
from sm90_ptxas import PTXAS, compile_in_subprocesses

# Spill-store bytes a kernel has at P8's widths too, which no released width may exceed: the
# decode attention programs (16 heads x 512 channels of fp32 accumulator; the ring variants are
# held to the gathered ones' spills in test_triton_ring_attention.py).
P8_SPILLS: dict[str, int] = {"mqa_sequential": 8}

# variant: (cases, disabled passes, fp8 weights, batch-invariant table)
VARIANTS: dict[str, tuple[tuple[tuple[str, int], ...], tuple[str, ...], bool, bool]] = {
    "steps": (CASES, (), False, False),
    "fp8": ((("decode", 1), ("decode", 64), ("prefill", 4096)), (), True, False),
    "mhc-off": ((("decode", 1),), ("mhc_site_kernel", "mhc_head_kernel"), False, False),
    "invariant": ((("decode", 1), ("decode", 64), ("prefill", 4096)), (), False, True),
}


def _compile_for_sm90(out_dir: str, *names: str) -> None:
    """For released configs ``names`` (of one trunk): the trunk's launches in every variant, each
    distinct binary compiled once and assembled by ptxas, into ``out_dir/<name>.json`` for each
    name. Runs in a child process without the interpreter (``sm90_ptxas.compile_in_subprocesses``)."""
    from model_launches import model_launches, trunk
    from sm90_ptxas import ptxas_report

    from deepinfer_fx.config import load_config
    from deepinfer_fx.passes.batch_invariant import batch_invariant_swaps

    base = trunk(load_config(released_path(names[0])))
    done: dict[tuple, dict] = {}
    rows, declined = [], {}
    for variant, (cases, disabled, fp8, invariant) in VARIANTS.items():
        c = base.replace(expert_dtype="fp8", held_experts="fp8", held_dense="fp8") if fp8 else base
        found = model_launches(c, cases, disabled, batch_invariant_swaps((), "nvidia") if invariant else None)
        declined.update({f"{variant}: {swap}": whys for swap, whys in found.declined.items()})
        for key, (launch, case, op) in found.launches.items():
            if key not in done:
                try:
                    spills, registers, log = ptxas_report(launch.compile().asm["ptx"])
                    done[key] = {"spills": spills, "registers": registers, "log": log if spills != [0, 0] else ""}
                except Exception as exc:  # a kernel that does not compile at this width: the finding
                    done[key] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            rows.append(
                {"kernel": launch.name, "launch": launch.describe(), "where": f"{variant} {case} {op}", **done[key]}
            )
    for name in names:
        Path(out_dir, f"{name}.json").write_text(json.dumps({"launches": rows, "declined": declined}, indent=1))


@pytest.fixture(scope="module")
def sm90_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The results of every released config present, one process per trunk, all at once."""
    from model_launches import trunk

    from deepinfer_fx.config import load_config

    if PTXAS is None:
        pytest.skip("ptxas is not installed")
    groups: dict[object, list[str]] = {}
    for name in RELEASED:
        groups.setdefault(trunk(load_config(released_path(name))), []).append(name)
    out = tmp_path_factory.mktemp("sm90")
    jobs = [(out / names[0], *names) for names in groups.values()]
    for job in jobs:
        job[0].mkdir()
    compile_in_subprocesses("test_released_widths_sm90", jobs)
    for job in jobs:
        for name in job[1:]:
            (job[0] / f"{name}.json").rename(out / f"{name}.json")
    return out


@pytest.mark.parametrize("name", list(RELEASED))
def test_every_kernel_compiles_at_the_released_width(name: str, sm90_results: Path) -> None:
    released_path(name)  # skips, saying where it looked, when this config is missing
    result = json.loads((sm90_results / f"{name}.json").read_text())
    rows = result["launches"]
    failed = [f"{r['where']}: {r['launch']}: {r['error']}" for r in rows if "error" in r]
    assert not failed, "kernels that do not compile for sm_90:\n" + "\n".join(failed)
    spilled = [
        f"{r['where']}: {r['launch']}: {r['spills']} bytes spilled, {r['registers']} registers\n{r['log']}"
        for r in rows
        if r["spills"][0] > P8_SPILLS.get(r["kernel"], 0)
    ]
    assert not spilled, "kernels that spill more than at P8's widths:\n" + "\n".join(spilled)
    assert result["declined"] == {}, f"kernel swaps that decline calls at a released width: {result['declined']}"


@pytest.mark.parametrize("name", list(RELEASED))
def test_fp8_projections_of_one_input_launch_as_groups(name: str, sm90_results: Path) -> None:
    """With dense weights held in fp8, decode projections of one input (wq_a with wkv, ...) go
    through ``skinny_linear_fp8_group`` as the bf16 ones go through ``skinny_linear_group``."""
    released_path(name)
    rows = json.loads((sm90_results / f"{name}.json").read_text())["launches"]
    assert any(r["where"].startswith("fp8 decode") and r["where"].endswith("skinny_linear_fp8_group") for r in rows)


# Kernels no step of a released config launches yet, and why.
OUTSIDE_STEPS = {
    "_row_scan_kernel": "the sampler's top-p scan under batch invariance: model_launches traces the model, not the sampler",
    "_engram_rows_kernel": "host Engram tables (DEEPINFER_ENGRAM_TABLES=host) are not traced by model_launches yet",
}


def test_every_launched_kernel_is_covered(sm90_results: Path) -> None:
    """Every kernel of ``kernels/triton`` that a launcher launches (a JIT function no other JIT
    function calls) is launched by some released config in some variant: a new kernel, or one a
    model change stops reaching, shows up here."""
    import importlib
    import inspect

    from triton.runtime import JITFunction
    from triton.runtime.interpreter import InterpretedFunction  # what triton.jit gives under TRITON_INTERPRET

    from deepinfer_fx.kernels import triton as kernels

    jitted = {}
    for module in kernels._MODULES + ("mqa_kernels", "moe_kernels", "pdl"):
        for obj in vars(importlib.import_module(f"{kernels.__name__}.{module}")).values():
            if isinstance(obj, (JITFunction, InterpretedFunction)):
                jitted[obj.fn.__name__] = inspect.getsource(obj.fn)
    helpers = {f for f in jitted if any(f"{f}(" in src for g, src in jitted.items() if g != f)}
    launched = {r["kernel"] for f in sm90_results.glob("*.json") for r in json.loads(f.read_text())["launches"]}
    assert set(jitted) - helpers - launched - set(OUTSIDE_STEPS) == set() and launched <= set(jitted)
