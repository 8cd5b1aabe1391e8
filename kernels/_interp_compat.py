"""Triton 3.6's CPU interpreter with NumPy >= 2.4: an adapter to one Triton internal, pinned to the only release
that needs it (3.6.x, tested with 3.6.0). Compiled kernels (CUDA) never reach it; neither do Triton >= 3.7.

The interpreter holds every scalar as a one-element 1-d NumPy array, and a loop ``range(start, stop, BLOCK_N)``
with tensor bounds (every key-block loop of ``_triton_fwd`` / ``_triton_bwd``) converts them through the tensor's
``__index__``, which Triton 3.6 defines as ``int(array)``. NumPy 2.4 made that conversion of an array with
``ndim > 0`` a ``TypeError`` (deprecated since NumPy 1.25): "only 0-dimensional arrays can be converted to Python
scalars", and every such kernel fails. Triton 3.7 reads the single element first (triton-lang/triton issue 9171);
``install`` gives 3.6 that same ``__index__``, so the interpreter runs the kernels alike at both ends.
"""
from __future__ import annotations

import numpy as np
import triton

_RELEASES = ((3, 6),)  # Triton (major, minor) whose interpreter converts a scalar with int(array)
_NUMPY_STRICT = (2, 4)  # the first NumPy that refuses int() of a one-element 1-d array


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def needed(triton_version: str = triton.__version__, numpy_version: str = np.__version__) -> bool:
    """Whether this Triton's interpreter needs the adapter under this NumPy."""
    return _release(triton_version) in _RELEASES and _release(numpy_version) >= _NUMPY_STRICT


def _index(tensor) -> int:
    """A scalar's ``__index__`` as Triton >= 3.7 has it: the one element of its array."""
    return int(tensor.handle.data.reshape(-1)[0])


def install() -> bool:
    """Give the interpreter's tensors ``_index`` as ``__index__`` when ``needed()``; idempotent. Whether it did."""
    if not needed():
        return False
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor  # called per launch: patches tl.tensor, restored after the launch
    if getattr(original, "distattn_index", False):
        return True

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)  # restored with the interpreter's own patches

    patch_lang_tensor.distattn_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
