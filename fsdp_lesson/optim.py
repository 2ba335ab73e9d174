"""SGD and Adam on flat float32 arrays, in place, so they update a shard exactly like a full vector.

Both use the gradient array as scratch (it is rewritten by the next backward), so a step
allocates nothing: the memory ledger's accounting stays exact. Each numpy operation is one
pass over its arrays; Adam's update is sixteen of them, so over a 40 MB shard every pass goes
to memory and back. Adam therefore walks the arrays in blocks of BLOCK elements, whose later
passes find the block still in the core's cache (a quarter less time at 5 M parameters, the
same bits: every operation is elementwise). SGD's two passes gain nothing from it.
"""

from __future__ import annotations

import numpy as np

from .memory import MemoryLedger

BLOCK = 65_536  # elements: 256 KB per float32 array; Adam's four fill a 1 MB L2 cache


def blocks(size: int) -> list[slice]:
    """The slices that cut `size` elements into blocks of at most BLOCK."""
    return [slice(start, start + BLOCK) for start in range(0, size, BLOCK)]


def flush_subnormals(x: np.ndarray, scratch: np.ndarray) -> None:
    """Set float32 subnormals in x to zero, using `scratch` (same size) and allocating nothing.

    Adam's m for a parameter that gets no gradient decays as 0.9^t into subnormals after
    ~800 steps, and x86 computes on those about 100x slower (a 2x slower step here). This
    is what torch.set_flush_denormal does in hardware; here: a float32 is subnormal when
    its exponent bits are all zero, so multiply its bits by 0 then, else by 1.
    """
    bits, keep = x.view(np.int32), scratch.view(np.int32)
    np.bitwise_and(bits, 0x7F800000, out=keep)  # the exponent bits
    np.minimum(keep, 1, out=keep)  # 0 for zero and subnormals, 1 otherwise
    bits *= keep


class Optimizer:
    """What SGD and Adam share: t, the number of steps taken (one number, not per layer)."""

    t = 0

    def start_step(self) -> None:
        """Called once per step by the strategy, before it updates each layer."""
        self.t += 1


class SGD(Optimizer):
    """p -= lr * g: the C program's optimizer; it keeps no state."""

    name = "sgd"
    state_per_param = 0  # floats of optimizer state per parameter

    def __init__(self, lr: float = 0.1) -> None:
        self.lr = np.float32(lr)

    def init_state(self, numel: int, ledger: MemoryLedger, label: str) -> dict[str, np.ndarray]:
        return {}

    def update(self, p: np.ndarray, g: np.ndarray, state: dict) -> None:
        g *= self.lr
        p -= g


class Adam(Optimizer):
    """Adam (Kingma & Ba) with bias correction; state m and v: 8 bytes per parameter.

    The step count t lives on the optimizer, not in the per-layer state: it is one number.
    """

    name = "adam"
    state_per_param = 2

    def __init__(
        self, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8
    ) -> None:
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps

    def init_state(self, numel: int, ledger: MemoryLedger, label: str) -> dict[str, np.ndarray]:
        return {
            "m": ledger.alloc("optimizer", numel, f"{label}.adam_m"),
            "v": ledger.alloc("optimizer", numel, f"{label}.adam_v"),
        }

    def update(self, p: np.ndarray, g: np.ndarray, state: dict) -> None:
        # the bias corrections folded into two scalars (see update_block)
        correction = np.sqrt(1 - self.beta2**self.t)
        step_size = np.float32(self.lr * correction / (1 - self.beta1**self.t))
        eps = np.float32(self.eps * correction)
        for b in blocks(p.size):
            self.update_block(p[b], g[b], state["m"][b], state["v"][b], step_size, eps)

    def update_block(self, p, g, m, v, step_size: np.float32, eps: np.float32) -> None:
        """One block of the update, in place: m, v, then p (g is scratch)."""
        b1, b2 = np.float32(self.beta1), np.float32(self.beta2)
        m -= g  # m = b1*m + (1-b1)*g, written as b1*(m - g) + g to need no temporary
        m *= b1
        m += g
        g *= g  # g now holds g^2
        g *= np.float32(1) - b2  # v = b2*v + (1-b2)*g^2, the standard float32 form; the
        v *= b2  # rewrite b2*(v - g^2) + g^2 loses bits when g^2 >> v (tests/test_optim_flat.py:
        v += g  # after 200 steps its v is 7.3e-5 off float64's, relative, this form's 1.3e-5)
        # p -= lr * m_hat / (sqrt(v_hat) + eps) = step_size * m / (sqrt(v) + eps * correction)
        np.sqrt(v, out=g)
        g += eps
        np.divide(m, g, out=g)
        g *= step_size
        p -= g
        flush_subnormals(m, scratch=g)
        flush_subnormals(v, scratch=g)


def clip_coefficient(squares: float, max_norm: float, loss_scale: float = 1.0) -> float:
    """min(1, max_norm / (norm + 1e-6)), the norm the square root of `squares`, the sum of the
    whole model's squared gradient (torch.nn.utils.clip_grad_norm_; Strategy.clip_grads adds
    it up over the ranks that share the model out). `loss_scale`: fp16's gradients are still
    scaled by it."""
    return min(1.0, max_norm / (np.sqrt(squares) / loss_scale + 1e-6))


def squares(g: np.ndarray) -> float:
    """Σ g², accumulated in float64."""
    return float(np.einsum("i,i->", g, g, dtype=np.float64))


def make_optimizer(name: str, lr: float) -> SGD | Adam:
    return SGD(lr) if name == "sgd" else Adam(lr)
