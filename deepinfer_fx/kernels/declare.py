"""``declare_op``: a ``deepinfer`` op declared once, from its reference function.

The op's schema is inferred from the reference's annotations (a ``graphs/`` function where the
model has the math, so the op cannot drift from it), its default kernel (every device, custom_op's
CompositeExplicitAutograd) is the reference, and its fake is a short function of the arguments it
reads, by name (``lambda x, **_: torch.empty_like(x)``): no signature is written twice.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

NAMESPACE = "deepinfer"


def declare_op(
    name: str,
    reference: Callable[..., Any],
    fake: Callable[..., Any] | None = None,
    *,
    mutates_args: Iterable[str] = (),
    fresh: bool = False,
) -> torch._library.custom_ops.CustomOpDef:
    """Declare ``deepinfer::<name>`` with ``reference``'s signature and math. A swap place
    (``graphs/swap.py``) stands for its ``.reference``, so the op never dispatches back to a swap.
    ``fake`` gets every argument by name (defaults filled in) and returns outputs with the right
    metadata; an op that only writes its arguments needs none. ``fresh``: every output is made
    contiguous, and an output that is an input is copied (an op's outputs never alias its
    inputs), as the fake promises."""
    ref = getattr(reference, "reference", reference)
    sig = inspect.signature(ref, eval_str=True)  # real annotation objects, whatever the module's __future__

    def kernel(*args: Any, **kwargs: Any) -> Any:
        out = ref(*args, **kwargs)
        return _fresh(out, (*args, *kwargs.values())) if fresh else out

    kernel.__signature__ = sig  # type: ignore[attr-defined]  # what infer_schema reads
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", kernel, mutates_args=tuple(mutates_args))
    if fake is not None:

        def by_name(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            return fake(**bound.arguments)

        op.register_fake(by_name)
    return op


def _fresh(out: Any, inputs: tuple[Any, ...]) -> Any:
    seen = {id(a) for a in inputs if isinstance(a, torch.Tensor)}

    def one(t: torch.Tensor) -> torch.Tensor:
        return t.clone(memory_format=torch.contiguous_format) if id(t) in seen else t.contiguous()

    return tuple(one(t) for t in out) if isinstance(out, tuple) else one(out)
