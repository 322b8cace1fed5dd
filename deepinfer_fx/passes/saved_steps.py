"""Compiled step functions saved ahead of time and loaded on a later start without tracing.

A warm start whose every Inductor cache hit still spent most of its time in Dynamo: it traces
each step's bytecode again to find the graph whose key the caches hold (``docs/decisions.md``,
"Start-up"). Here a static-shape step function is compiled on its first call with torch's
``aot_compile`` (Dynamo, our backend and Inductor, as ``torch.compile`` would), written under
``<DEEPINFER_CACHE_DIR>/steps``, and a later start that computes the same key loads it: no
tracing, no cache lookups, no Inductor.

The key is everything a trace reads that its kept guards do not check (the artifact keeps the
guards on its inputs' shapes, dtypes and strides; ``aot_compile`` drops the guards on globals):
this package's source, torch's and Triton's versions, the device, the backend's pipeline id
(each pass's source, PDL), the graph's name, what the caller adds (the model config, the
bucket's layout, the swaps in force), the inputs' tree and tensor metadata, and every
``DEEPINFER_*`` and ``TORCHINDUCTOR_*`` variable. A loaded function whose guards still fail is
compiled again and saved over.

Where torch lacks ``aot_compile`` nothing is saved (``supported``); the engine saves only
Inductor's results (aot_eager's do not serialise) and steps whose extra swaps carry no state
(``engine/step_functions.py``). A capture that ``aot_compile`` cannot package, or a closure that
does not pickle, is compiled by ``torch.compile`` as before and the reason is kept in
``SavedSteps.skipped``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from torch._dynamo.aot_compile import BundledAOTAutogradSerializableCallable

from .compiler import DeepinferBackend, compile_graph

SUFFIX = ".aot"


def supported() -> bool:
    """This torch compiles ahead of time and loads what it saved."""
    return hasattr(torch._dynamo.config, "enable_aot_compile") and hasattr(torch.compiler, "load_compiled_function")


@lru_cache(maxsize=1)
def _package_hash() -> str:
    """Every source file of the package: an edit anywhere may change what a trace records."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _versions() -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"python {sys.version_info[:3]} torch {torch.__version__} triton {triton_version}"


def _device(args: Sequence[Any]) -> str:
    for leaf in pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type == "cuda":
                return f"cuda {torch.cuda.get_device_name(leaf.device)} {torch.cuda.get_device_capability(leaf.device)}"
            return leaf.device.type
    return "none"


def _inputs(args: Sequence[Any]) -> str:
    leaves, spec = pytree.tree_flatten(args)
    metas = [
        (tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.type) if isinstance(x, torch.Tensor) else repr(x)
        for x in leaves
    ]
    return f"{spec}|{metas}"


def _environment() -> str:
    return repr(sorted((k, v) for k, v in os.environ.items() if k.startswith(("DEEPINFER_", "TORCHINDUCTOR_"))))


def _rank() -> str:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return f"{dist.get_rank()}/{dist.get_world_size()}"
    return "0/1"


class SavedSteps:
    """The folder of saved step functions, and what this process loaded, compiled and skipped."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.loaded: list[str] = []
        self.saved: list[str] = []
        self.skipped: dict[str, str] = {}
        self.broken: str | None = None  # why aot_compile failed here: the rest go to torch.compile directly

    def key(self, backend: DeepinferBackend, extra: str, args: Sequence[Any]) -> str:
        parts = (
            _package_hash(),
            _versions(),
            _device(args),
            backend.cache_key(),
            backend.name,
            extra,
            _inputs(args),
            _environment(),
            _rank(),
        )
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]

    def path(self, backend: DeepinferBackend, key: str) -> Path:
        return self.root / f"{backend.name}-{key}{SUFFIX}"

    def wrap(self, fn: Callable[..., Any], backend: DeepinferBackend, extra: str) -> Callable[..., Any]:
        """``fn`` compiled (or loaded) on its first call; ``extra`` adds what the caller's closure
        reads to the key."""
        return _Saved(self, fn, backend, extra)


class _Serializable(BundledAOTAutogradSerializableCallable):
    """Inductor's compiled graph, marked as one ``aot_compile`` can package: torch 2.11 packages
    only its own Inductor backend's results, later versions any result with ``serialize`` (this
    class hides that attribute, so they do not wrap it a second time)."""

    def __getattr__(self, attr: str) -> Any:
        raise AttributeError(attr)


def _serializable(backend: DeepinferBackend) -> Callable[..., Any]:
    def compile_serializable(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        compiled = backend(gm, example_inputs)
        return _Serializable(compiled) if getattr(compiled, "serialize", None) is not None else compiled

    return compile_serializable


class _Saved:
    """One step function: loaded or compiled ahead of time on its first call."""

    def __init__(self, store: SavedSteps, fn: Callable[..., Any], backend: DeepinferBackend, extra: str) -> None:
        self.store, self.fn, self.backend, self.extra = store, fn, backend, extra
        self.compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            self.compiled = self._first(args)
        return self.compiled(*args)

    def _first(self, args: tuple) -> Callable[..., Any]:
        store, name = self.store, self.backend.name
        path = store.path(self.backend, store.key(self.backend, self.extra, args))
        if path.exists():
            loaded = self._load(path, args)
            if loaded is not None:
                store.loaded.append(name)
                return loaded
        if store.broken is not None:
            store.skipped[name] = store.broken
            return compile_graph(self.fn, self.backend)
        with _aot_enabled():
            try:
                wrapper = torch.compile(self.fn, backend=_serializable(self.backend), fullgraph=True, dynamic=False)
                compiled = wrapper.aot_compile((args, {}))
            except Exception as e:  # a capture aot_compile cannot package: compile as torch.compile does
                store.broken = store.skipped[name] = f"aot_compile: {type(e).__name__}: {str(e)[:300]}"
                return compile_graph(self.fn, self.backend)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(tmp))
            os.replace(tmp, path)
            store.saved.append(name)
        except Exception as e:  # runs as compiled; only the next start pays the compile again
            store.skipped[name] = f"save: {type(e).__name__}: {str(e)[:300]}"
            with contextlib.suppress(OSError):
                tmp.unlink()
        return compiled

    def _load(self, path: Path, args: tuple) -> Callable[..., Any] | None:
        try:
            with _aot_enabled(), open(path, "rb") as f:
                fn = torch.compiler.load_compiled_function(f)
            ok = fn.guard_check(*args) if hasattr(fn, "guard_check") else True
        except Exception as e:  # a stale or torn file: compile again and save over it
            warnings.warn(
                f"saved step {path.name} did not load ({type(e).__name__}: {e}); compiling it again", stacklevel=3
            )
            return None
        if not ok:
            warnings.warn(f"saved step {path.name} fails its guards on these inputs; compiling it again", stacklevel=3)
            return None
        return fn


@contextlib.contextmanager
def _aot_enabled():
    with torch._dynamo.config.patch(enable_aot_compile=True):
        yield
