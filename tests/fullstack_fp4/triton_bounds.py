"""A bounds check for Triton kernels under the interpreter (``TRITON_INTERPRET=1``).

``with bounds_checked() as bad:`` runs every launch inside it with each masked-in load, store and
atomic address checked against the byte extents of that launch's tensor arguments (the span of
each view: ``data_ptr`` to the last element its shape and strides reach). ``bad`` collects one
entry per access that falls outside every one of them: ``(kernel, kind, count)``.

The interpreter executes a kernel with NumPy on host pointers, so an out-of-bounds access there
reads or writes whatever lies next to the tensor and usually goes unnoticed; on a GPU the same
access faults only when it crosses into unmapped memory, which depends on where the allocator put
the tensor (an intermittent ``unspecified launch failure``). Checking the addresses makes the
access itself the failure, at any shape the interpreter can run.

It wraps three methods of ``triton.runtime.interpreter`` (``GridExecutor._init_args_hst`` for the
launch's tensors, ``InterpreterBuilder.create_masked_load`` / ``create_masked_store`` /
``create_atomic_rmw`` for the accesses); with a Triton that lacks them it raises
``RuntimeError`` rather than checking nothing. Accesses through pointer tensors are checked;
block pointers, tensor descriptors and ``atomic_cas`` (which no kernel here uses) are not.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

__all__ = ["bounds_checked"]


def _extent(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


@contextlib.contextmanager
def bounds_checked():
    from triton.runtime import interpreter as interp

    grid, builder = interp.GridExecutor, interp.InterpreterBuilder
    names = ("create_masked_load", "create_masked_store", "create_atomic_rmw")
    if not hasattr(grid, "_init_args_hst") or not all(hasattr(builder, n) for n in names):
        raise RuntimeError("this Triton's interpreter has no hooks for the bounds check")
    launch = {"kernel": None, "extents": []}
    bad: list[tuple[str, str, int]] = []

    def check(kind, ptrs, mask):
        addrs = np.asarray(ptrs.data).astype(np.uint64)
        on = np.ones(addrs.shape, bool) if mask is None else np.broadcast_to(np.asarray(mask.data), addrs.shape)
        a = addrs[on.astype(bool)]
        if a.size == 0:
            return
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(a.shape, bool)
        for lo, hi in launch["extents"]:
            inside |= (a >= lo) & (a + size <= hi)
        if not inside.all():
            bad.append((launch["kernel"], kind, int((~inside).sum())))

    orig = {"_init_args_hst": grid._init_args_hst, **{n: getattr(builder, n) for n in names}}

    def init_args(self, args_dev, kwargs):
        args, kw = orig["_init_args_hst"](self, args_dev, kwargs)
        tensors = [getattr(v, "base", v) for v in (*args, *kw.values())]
        launch["extents"] = [_extent(t) for t in tensors if isinstance(t, torch.Tensor)]
        launch["kernel"] = getattr(self.fn, "__name__", str(self.fn))
        return args, kw

    def load(self, ptrs, mask, *rest):
        check("load", ptrs, mask)
        return orig["create_masked_load"](self, ptrs, mask, *rest)

    def store(self, ptrs, value, mask, *rest):
        check("store", ptrs, mask)
        return orig["create_masked_store"](self, ptrs, value, mask, *rest)

    def atomic(self, op, ptr, val, mask, *rest):
        check("atomic", ptr, mask)
        return orig["create_atomic_rmw"](self, op, ptr, val, mask, *rest)

    grid._init_args_hst = init_args
    builder.create_masked_load, builder.create_masked_store, builder.create_atomic_rmw = load, store, atomic
    try:
        yield bad
    finally:
        grid._init_args_hst = orig["_init_args_hst"]
        for n in names:
            setattr(builder, n, orig[n])
