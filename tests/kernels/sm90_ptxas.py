"""The offline half of the kernel tests' H200 checks: ptxas (Triton's bundled copy, or
TRITON_PTXAS_PATH) assembles PTX compiled for sm_90 and reports registers and spills, with no
GPU present. ``recorded_launches`` catches a launcher's launches, specialised for sm_90 as a
real launch would specialise them, so they can be compiled here."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triton import knobs

if TYPE_CHECKING:
    from triton.compiler import CompiledKernel


def _ptxas() -> str | None:
    try:
        return knobs.nvidia.ptxas.path
    except RuntimeError:  # neither runs here
        return None


PTXAS = _ptxas()


def ptxas_report(ptx: str) -> tuple[list[int], int, str]:
    """(spill store / load bytes, registers, ptxas's log) of one kernel's PTX for sm_90a."""
    assert PTXAS is not None, "ptxas is not installed"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        log = subprocess.run(
            [PTXAS, "-v", "--gpu-name=sm_90a", str(src), "-o", str(src.with_suffix(".cubin"))],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    registers = int(re.search(r"Used (\d+) registers", log).group(1))  # type: ignore[union-attr]
    return spills, registers, log


def compile_in_subprocess(module: str, out: Path, *args: str) -> Path:
    """Run ``module._compile_for_sm90(out, *args)`` (a test module beside this file) in a fresh
    interpreter without ``TRITON_INTERPRET``: in this process Triton's JIT was replaced by the
    interpreter at import, and only the real one compiles to PTX. Returns ``out``."""
    compile_in_subprocesses(module, [(out, *args)])
    return out


def compile_in_subprocesses(module: str, calls: list[tuple[Path, ...]]) -> None:
    """``compile_in_subprocess`` for each ``(out, *args)`` of ``calls``, all at once (one process
    each: compiling is single-threaded)."""
    here = Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(here.parents[1]), str(here), str(here.parent / "models"), env.get("PYTHONPATH", "")]
    )
    procs = []
    for out, *args in calls:
        code = f"from {module} import _compile_for_sm90; _compile_for_sm90({str(out)!r}, *{[str(a) for a in args]!r})"
        log = Path(out) / "stderr.txt"  # a file, not a pipe: a full pipe would stall a process nobody reads yet
        with open(log, "w") as err:
            procs.append(
                (subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=err), log)
            )
    errors = [log.read_text() for proc, log in procs if proc.wait()]
    assert not errors, "\n".join(errors)


ArgType = str | tuple[str, ...]  # an argument's Triton type: a tuple of them for a tuple argument


def compile_sm90(
    fn: Any,
    types: Mapping[str, ArgType],
    constants: dict[str, Any],
    aligned: Iterable[str] | Callable[[str], bool] = (),
    *,
    align_pointers: bool = True,
    **options: Any,
) -> CompiledKernel:
    """Compile the JIT (or Gluon) kernel ``fn`` for sm_90 as a launch would specialise it; returns Triton's
    compiled kernel (``.asm["ptx"]``, ``.metadata.shared``). Only in a process without
    ``TRITON_INTERPRET`` (see ``compile_in_subprocess``), hence the imports in here.

    Each argument of ``fn`` is a constexpr if it is in ``constants``, else of its type in
    ``types`` (a tuple of types for a tuple argument), else ``*fp32`` if it is named ``*_ptr``
    and ``i32`` otherwise. Divisible by 16 are the pointers (each element of a tuple of them)
    unless ``align_pointers`` is false, and the other non-constexpr arguments that ``aligned``
    names or accepts. ``options`` are the compile options (num_warps, num_stages, ...)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    is_aligned = aligned if callable(aligned) else frozenset(aligned).__contains__
    signature: dict[str, ArgType] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        ty = signature[name] = types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
        if isinstance(ty, tuple):
            divisible = [(i, j) for j, t in enumerate(ty) if align_pointers and t.startswith("*")]
        else:
            divisible = [(i,)] if (align_pointers and ty.startswith("*")) or is_aligned(name) else []
        attrs |= {path: [["tt.divisibility", 16]] for path in divisible}
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    src = source(fn, signature, constexprs=constants, attrs=attrs)
    return triton_compile(src, target=GPUTarget("cuda", 90, 32), options=options)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as Triton's launcher specialises it for sm_90: the JIT function, its
    argument types, constexpr values, argument attributes (16-byte divisibility) and options."""

    fn: Any
    signature: dict[str, Any]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: Any

    @property
    def name(self) -> str:
        return self.fn.fn.__name__

    def key(self) -> tuple:
        """Equal for launches that compile to the same binary (Triton's own cache key parts)."""

        def items(d: dict) -> tuple:
            return tuple(sorted((str(k), repr(v)) for k, v in d.items()))

        return (
            self.fn.fn.__module__,
            self.fn.fn.__qualname__,
            tuple(self.signature.items()),
            items(self.constexprs),
            items(self.attrs),
            items(self.options.__dict__),
        )

    def describe(self) -> str:
        """The kernel and its constexprs by name, for messages."""
        names = list(self.signature)
        consts = ", ".join(
            f"{names[k[0]]}={v}" for k, v in sorted(self.constexprs.items()) if len(k) == 1 and v is not None
        )
        return f"{self.name}({consts}; warps={self.options.num_warps}, stages={self.options.num_stages})"

    def compile(self) -> CompiledKernel:
        """The sm_90 binary, as the launch would have compiled it (only without TRITON_INTERPRET)."""
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile as triton_compile

        src = ASTSource(self.fn, self.signature, self.constexprs, self.attrs)
        return triton_compile(src, target=GPUTarget("cuda", 90, 32), options=self.options.__dict__)


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Inside the block, Triton kernel launches run nothing: each is bound and specialised as
    the launcher would for an sm_90 device (``JITFunction.run``'s own binder and argument
    packing: constexprs, integers equal to 1, 16-byte divisibility of pointers and integers)
    and appended to the list. Launchers can then run on ``meta`` tensors (whose data pointer is
    0, 16-byte aligned like an allocation) in a process without a GPU or the interpreter."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders: dict[Any, Any] = {}
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        if self not in binders:
            binders[self] = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binders[self](*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        launches.append(Launch(self, signature, constexprs, attrs, options))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original
