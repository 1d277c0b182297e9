"""The row-wise math between Gemma 3's linears: RMSNorms (with their residual adds), the
per-head q/k norms with RoPE, and the gated activation.

Two implementations with one interface, built once per packing of the model and told the
batch at the start of each forward (:meth:`EagerGemma3Ops.start`): :class:`EagerGemma3Ops`,
plain torch ops (the reference the kernels are tested against), and :class:`KernelGemma3Ops`,
the fused row-wise kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.kernels.library import Kernels
from radixserve.kernels.linear import Linears
from radixserve.kernels.operands import PackedWeight
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.model.arch.layers import RotaryTable, apply_rotary, rms_norm
from radixserve.model.model_config import ModelConfig

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda g: F.gelu(g, approximate="tanh"),
    "silu": F.silu,
}


class EagerGemma3Ops:
    """Gemma 3's row-wise ops in eager torch (float32 math, results in the asked dtype)."""

    def __init__(self, config: ModelConfig, act_dtype: torch.dtype, rotary: RotaryTable, rotary_local: RotaryTable):
        self.config = config
        self.rotary = {False: rotary, True: rotary_local}  # by ``local`` (the sliding layers')
        self.eps = config.rms_norm_eps
        self.nh, self.nkv, self.hd = config.num_heads, config.num_kv_heads, config.head_dim
        self.qk_width = (self.nh + self.nkv) * self.hd
        self.dtype = act_dtype  # what the linears take
        self.inter = config.intermediate_size
        self._act_fn = ACTIVATIONS[config.hidden_act]
        self._rope: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}

    def start(self, batch: ForwardBatch) -> None:
        """Take this forward's positions: cos/sin per table."""
        self._rope = {local: table.lookup(batch.positions) for local, table in self.rotary.items()}

    def norm(self, x: torch.Tensor, w: torch.Tensor, dt: torch.dtype, out: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x`` times ``w``, in ``dt`` (``out``: a buffer the kernels write)."""
        return rms_norm(x.float(), w, self.eps).to(dt)

    def add_norm(self, h: torch.Tensor, d: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``h += d`` (the float32 residual), then its RMSNorm in the linears' dtype."""
        h.add_(d)
        return rms_norm(h, w, self.eps).to(self.dtype)

    def qk_v(self, qkv: torch.Tensor, weight: torch.Tensor, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (q and k heads normed per head and rotated, v heads) of the fused projection."""
        t = qkv.shape[0]
        qk = rms_norm(qkv[:, : self.qk_width].float().view(t, self.nh + self.nkv, self.hd), weight, self.eps)
        v = qkv[:, self.qk_width :].float().view(t, self.nkv, self.hd)  # (the pool store wants k's dtype)
        return apply_rotary(qk, *self._rope[local]), v

    def act_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of the fused gate/up output, in place in its gate half."""
        return self._act_fn(gu[:, : self.inter]).mul_(gu[:, self.inter :])

    def gated(self, x: torch.Tensor, w: object, linear: Linears, fuse: bool) -> torch.Tensor:
        """``act(x Wg) * (x Wu)`` for the fused gate_up weight ``w``: the linear, then :meth:`act_mul`."""
        return self.act_mul(linear(x, w))


class KernelGemma3Ops(EagerGemma3Ops):
    """The same ops as the fused row-wise kernels (GeGLU fused too; another activation eager)."""

    def __init__(self, config: ModelConfig, act_dtype: torch.dtype, rotary: RotaryTable, rotary_local: RotaryTable,
                 kern: Kernels):
        super().__init__(config, act_dtype, rotary, rotary_local)
        self.kern = kern
        self.positions = torch.empty(0, dtype=torch.int64)
        #: cos/sin tables (whole, indexed by position in the kernels) per ``local``.
        self.tables: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        self._qkv_buf = torch.empty(0)

    def start(self, batch: ForwardBatch) -> None:
        positions = batch.positions
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        self.positions = positions
        self.tables = {local: (table.cos, table.sin) for local, table in self.rotary.items()}
        self._qkv_buf = torch.empty((positions.numel(), self.qk_width + self.nkv * self.hd), dtype=torch.float32)

    def norm(self, x: torch.Tensor, w: torch.Tensor, dt: torch.dtype, out: torch.Tensor) -> torch.Tensor:
        return self.kern.rms_norm(x if x.dtype == torch.float32 else x.float(), w, self.eps, dt, out=out)

    def add_norm(self, h: torch.Tensor, d: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.kern.add_rms_norm(h, d, w, self.eps, self.dtype, out=out)

    def qk_v(self, qkv: torch.Tensor, weight: torch.Tensor, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        t = qkv.shape[0]
        out = self.kern.qk_norm_rope(qkv, weight, self.eps, self.positions, *self.tables[local],
                                     self.nh + self.nkv, self.hd, out=self._qkv_buf)
        return (out[:, : self.qk_width].view(t, self.nh + self.nkv, self.hd),
                out[:, self.qk_width :].view(t, self.nkv, self.hd))

    def act_mul(self, gu: torch.Tensor) -> torch.Tensor:
        if self.config.hidden_act == "gelu_pytorch_tanh":
            return self.kern.gelu_tanh_mul(gu)
        return super().act_mul(gu)

    def gated(self, x: torch.Tensor, w: object, linear: Linears, fuse: bool) -> torch.Tensor:
        """On the kernels' GEMM, GeGLU in one pass where it can (:meth:`Kernels.gated_linear`,
        the same bits as the linear and then :meth:`act_mul`)."""
        if linear.ours and isinstance(w, PackedWeight) and self.config.hidden_act == "gelu_pytorch_tanh":
            return linear.kernels.gated_linear(x, w, "gelu_tanh", fuse=fuse)
        return super().gated(x, w, linear, fuse)
