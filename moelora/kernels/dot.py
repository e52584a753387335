"""The one matrix-product helper every kernel uses.

tl.dot on float32 operands defaults to TF32 on the GPU (about 1e-3 relative error): a float32
model would then no longer match its float32 reference. Float32 takes the exact ("ieee")
path; other dtypes are unaffected. The branch is on a compile-time dtype, so it costs nothing.
"""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc):
    """acc + a @ b, exact in float32."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
