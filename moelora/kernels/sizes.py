"""Tile and grid arithmetic for the kernels' host wrappers, in plain Python.

triton.next_power_of_2 and triton.cdiv are constexpr functions: each call from the host costs a
few µs, and an eager forward calls them a few times per launch, hundreds of launches a step.
These give the same integers for the positive sizes the wrappers pass.
"""


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n; 0 for n <= 0, as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0."""
    return -(-a // b)
