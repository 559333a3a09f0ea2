"""Hadamard matrices, the fast Walsh-Hadamard transform, and a Linear whose input is rotated online.

An online rotation of a Linear's input (QuaRot's and SpinQuant's R4 on the down projection) keeps
y = W x with x' = H x and W' = W H^T, where H is block-diagonal: the normalized Sylvester matrix of
size `block` (a power of two dividing in_features) repeated along the input. The Sylvester matrix is
symmetric, so x' = x H per row and W' = W H. The weights are rotated once, offline; x is rotated at
every forward by the transform below, H's Kronecker factors applied in turn, not a dense matmul (qtk's
runtime calls its own C++ butterfly, csrc/cpu_layers.cpp, where it is built).

In a checkpoint this is compressed-tensors' transform config (`transform_config`, type "hadamard",
`head_dim` the block, an "input" rotation and the inverse "weight_input" one already fused into the
weights), as llm-compressor's SpinQuant R4 writes it; checkpoint.py reads and writes it.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

ATTRIBUTE = "input_hadamard"  # the block size on a Linear whose input is rotated online
MAX_BLOCK = 512  # the largest block qtk chooses: a power of two dividing in_features, at most this


def sylvester(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix / sqrt(n) (orthogonal and symmetric), float64."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix of size {n}: only powers of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = the quadratic character of (j - i) mod q, q prime: 0, 1 (a square) or -1."""
    squares = {i * i % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if r in squares else -1.0 for r in range(1, q)], dtype=torch.float64)
    i = torch.arange(q)
    return chi[(i[None, :] - i[:, None]) % q]


def paley(n: int) -> torch.Tensor | None:
    """An unnormalized n x n Hadamard matrix by Paley's constructions (q prime), or None:
    I:  n = q + 1, q = 3 mod 4: H = I + [[0, 1], [-1, Q]] (Q, the Jacobsthal matrix, skew)
    II: n = 2(q + 1), q = 1 mod 4: C = [[0, 1], [1, Q]] (symmetric), H = C x [[1, 1], [1, -1]] + I x [[1, -1], [-1, -1]]."""
    def bordered(q: int, sign: float) -> torch.Tensor:
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, sign, _jacobsthal(q)
        return c

    if _is_prime(n - 1) and (n - 1) % 4 == 3:
        return torch.eye(n, dtype=torch.float64) + bordered(n - 1, -1.0)
    if n % 2 == 0 and _is_prime(n // 2 - 1) and (n // 2 - 1) % 4 == 1:
        c = bordered(n // 2 - 1, 1.0)
        one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        eye = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, one) + torch.kron(torch.eye(n // 2, dtype=torch.float64), eye)
    return None


def hadamard_matrix(n: int) -> torch.Tensor | None:
    """A normalized n x n Hadamard matrix (orthogonal, entries +-1/sqrt(n)), float64, or None where
    qtk builds none of that order: Sylvester's for a power of two, else Paley's of order m = n / 2^k
    (the smallest such m that Paley's constructions reach) Kronecker Sylvester's of 2^k. SmolLM2's
    576 = 36 x 16 (Paley II, q = 17); 896 = 28 x 32, 960 = 60 x 16, 1536 = 12 x 128, 3072, 5120."""
    if n >= 1 and not n & (n - 1):
        return sylvester(n)
    power = n & -n
    m = n // power
    while m <= n:
        h = paley(m)
        if h is not None:
            return torch.kron(h / m ** 0.5, sylvester(n // m))
        m *= 2
    return None


def block_size(n: int, cap: int = MAX_BLOCK) -> int:
    """The largest power of two that divides n, at most cap (1536 = 3 x 512 -> 512)."""
    return min(n & -n, cap)


def fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., n] times the block-diagonal normalized Sylvester matrix of size `block` (x H per block of
    the last dimension), in float32, returned in x's dtype.

    Sylvester's construction makes H a Kronecker product, H_ab = H_a (x) H_b (a, b powers of two), so
    with each block's row viewed as an a x b matrix X, x H is H_a X H_b: two small matmuls, a + b
    multiply-adds per element instead of a dense block's `block` (16 and 32 for 512): the fast
    transform's factorization, run by matmul kernels, which beat log2(block) torch passes of sums and
    differences several times over on a CPU; and differentiable, as calibration needs."""
    shape, dtype = x.shape, x.dtype
    if shape[-1] % block:
        raise ValueError(f"a Hadamard block of {block} does not divide the input's {shape[-1]} features")
    a = 1 << ((block.bit_length() - 1) // 2)  # block = a * b, a <= b
    h_a, h_b = _sylvester32(a, x.device), _sylvester32(block // a, x.device)
    y = x.reshape(-1, a, block // a).float()
    y = torch.matmul(h_a, torch.matmul(y, h_b))  # H_a is symmetric: H_a^T X H_b
    return y.reshape(shape).to(dtype)


@functools.lru_cache(maxsize=None)
def _sylvester32(n: int, device: torch.device) -> torch.Tensor:
    """sylvester(n) in float32 on `device`, built once per size and device."""
    return sylvester(n).float().to(device)


def _rotate_input(module: nn.Module, args: tuple) -> tuple:
    return (fwht(args[0], getattr(module, ATTRIBUTE)), *args[1:])


def attach(linear: nn.Module, block: int) -> nn.Module:
    """Make `linear` rotate its input by the block Hadamard before it multiplies (a forward pre-hook,
    so any module that replaces it must be handed on with `carry`)."""
    if getattr(linear, ATTRIBUTE, None) is None:
        linear._input_hadamard_hook = linear.register_forward_pre_hook(_rotate_input)
    setattr(linear, ATTRIBUTE, block)
    return linear


def detach(linear: nn.Module) -> None:
    """Undo `attach` (the weights are the caller's)."""
    if of(linear) is not None:
        linear._input_hadamard_hook.remove()
        del linear._input_hadamard_hook
        delattr(linear, ATTRIBUTE)


def of(module: nn.Module | None) -> int | None:
    """The block of `module`'s online input rotation, or None."""
    return getattr(module, ATTRIBUTE, None)


def carry(old: nn.Module, new: nn.Module) -> nn.Module:
    """`new` takes `old`'s place: it rotates its input as `old` did."""
    if of(old) is not None:
        attach(new, of(old))
    return new


def rotating(f, block: int | None):
    """f(x) with x rotated first, for a callable that bypasses the module (the runtime's kernels)."""
    if block is None or f is None:
        return f
    return lambda x: f(fwht(x, block))
