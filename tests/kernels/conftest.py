"""Kernel tests run on the GPU when there is one; elsewhere small cases run on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` before anything
imports Triton)."""

import os

import pytest
import torch

import triton  # noqa: F401,E402  (a test extra; missing it is an install error, not a skip)


def _interpreter_scalars_as_index() -> None:
    """Triton 3.6's interpreter holds scalar kernel arguments as 1-element arrays and turns them
    into ints with ``int(array)``, which NumPy >= 2.4 refuses; so ``range(0, n, BLOCK)`` over a
    runtime ``n`` fails. Re-patch ``__index__`` with ``.item()`` after the interpreter's own."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_scalars_as_index()


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
