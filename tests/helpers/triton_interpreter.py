"""Three fixes to Triton's interpreter (``TRITON_INTERPRET=1``), so that the kernels of
``meshlm/kernels/`` can be checked on a CPU with the Triton release the GPU image has (3.6).

Each changes only how the interpreter evaluates a kernel in NumPy, never what a compiled kernel
does on a GPU, and each goes through the interpreter's own patch scope (``_LangPatchScope``) or
wraps one builder method, so nothing else in the process changes.

- **Program ids as loop bounds under NumPy >= 2.4.** The interpreter holds a scalar
  (``tl.program_id``, ``row_tile + 1``) as a one-element array and makes a Python int of it with
  ``int(array)``, which NumPy 2.4 refuses for arrays of ndim > 0 ("only 0-dimensional arrays can
  be converted to Python scalars"). Every kernel whose loop runs to a program id fails. Triton
  fixed it after 3.6 (triton-lang/triton#9171) with ``int(data.squeeze())``; this applies the same.
- **``tl.dot`` of bf16 operands.** The interpreter stores bf16 as its uint16 bit patterns and
  converts only 8-bit floats before ``np.matmul``, so a bf16 ``tl.dot`` multiplies the bit
  patterns (values near 1e9; triton-lang/triton#11584, "not supported yet"). Here bf16 operands
  are widened to fp32 first, exactly (a bf16 value is the top half of its fp32), which is what
  the tensor cores compute: bf16 products accumulated in fp32.
- **fp32 -> bf16 casts round to nearest even.** A plain ``.to(tl.bfloat16)`` (and a store of an
  fp32 value through a bf16 pointer) is an ``fp_trunc``, which a GPU compiles to a
  round-to-nearest-even conversion (``cvt.rn.bf16.f32``) and the interpreter evaluates by
  dropping the low 16 bits (rounding toward zero): one bf16 step off for about half the values.
  Here it rounds as the GPU and ``torch.Tensor.to(torch.bfloat16)`` do (NaN stays NaN).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

_APPLIED = "meshlm_tests_fixed"


def fix_triton_interpreter() -> None:
    """Apply both fixes where the interpreter is on and Triton is installed; idempotent."""
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is not None and not getattr(patch_tensor, _APPLIED, False):
        def patch_tensor_with_squeezed_index(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        setattr(patch_tensor_with_squeezed_index, _APPLIED, True)
        interpreter._patch_lang_tensor = patch_tensor_with_squeezed_index

    builder = getattr(interpreter, "InterpreterBuilder", None)
    create_dot = getattr(builder, "create_dot", None)
    if create_dot is not None and not getattr(create_dot, _APPLIED, False):
        def widened(operand):
            if operand.dtype.scalar != tl.bfloat16:
                return operand
            bits = operand.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

        def create_dot_of_widened_bf16(self, a, b, *args, **kwargs):
            return create_dot(self, widened(a), widened(b), *args, **kwargs)

        setattr(create_dot_of_widened_bf16, _APPLIED, True)
        builder.create_dot = create_dot_of_widened_bf16

    cast = getattr(builder, "cast_impl", None)
    if cast is not None and not getattr(cast, _APPLIED, False):
        def cast_rounding_bf16_to_nearest_even(self, src, dst_type):
            if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
                return cast(self, src, dst_type)
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded, tl.bfloat16)

        setattr(cast_rounding_bf16_to_nearest_even, _APPLIED, True)
        builder.cast_impl = cast_rounding_bf16_to_nearest_even
