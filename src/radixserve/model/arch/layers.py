"""The math of one decoder layer outside the attention and the linears: rotary embeddings and
RMSNorm, in their eager torch form.

The fused path (``kernels/csrc`` kernels) is tested against these; the eager path
("torch-eager") runs them directly. See :mod:`radixserve.model.arch.llama` for the numerics.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from radixserve.model.model_config import ModelConfig


class EmptyParams:
    """Uninitialised frozen parameters of one dtype and device, for a loader to fill."""

    def __init__(self, dtype: torch.dtype, device: str | torch.device):
        self.dtype, self.device = dtype, device

    def __call__(self, *shape: int, dt: torch.dtype | None = None) -> nn.Parameter:
        return nn.Parameter(torch.empty(shape, dtype=dt or self.dtype, device=self.device), requires_grad=False)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` float32, with optional scaling.

    Computed exactly as transformers does (same op order) so float32 logits match it to
    rounding. Supports no scaling, ``linear`` and Llama-3 (``llama3``) scaling.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(f"ModelConfig.rope_scaling type {rope_type!r} is not supported "
                     "(supported: default, linear, llama3)")


class RotaryTable:
    """Precomputed cos/sin ``[positions, head_dim // 2]`` float32, grown on demand.

    Grown lazily (doubling) rather than sized to ``max_position_embeddings`` up front, because
    Llama-3 style configs advertise 128k positions and the table would then cost far more
    memory than the short contexts we actually serve.
    """

    def __init__(self, config: ModelConfig, device: torch.device, initial: int = 4096):
        self.inv_freq = rope_inv_freq(config).to(device)
        self.device = device
        self.cos = torch.empty(0, device=device)
        self.sin = torch.empty(0, device=device)
        self._build(initial)

    def _build(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.int64, device=self.device).float()
        freqs = pos[:, None] * self.inv_freq[None, :]
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def ensure(self, max_pos: int) -> None:
        """Make the table cover positions ``< max_pos`` (host-side ints: no device sync)."""
        if max_pos > self.cos.shape[0]:
            n = self.cos.shape[0]
            while n < max_pos:
                n *= 2
            self._build(n)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x [T, heads, head_dim]`` float32 with ``cos/sin [T, head_dim/2]``.

    Rotate-half (first half paired with second half) is the Hugging Face layout the loaders
    produce; llama.cpp's interleaved layout is un-permuted at load time, not here.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    # Written into the two halves of one output (same operations, same rounding as
    # ``cat((x1*c - x2*s, x2*c + x1*s))``), sparing the cat version's four extra full-size
    # temporaries per layer, each of which pays page faults on its first touch.
    out = torch.empty_like(x)
    torch.mul(x1, c, out=out[..., :half]).sub_(x2 * s)
    torch.mul(x2, c, out=out[..., half:]).add_(x1 * s)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (``x`` and ``weight`` float32); caller casts for the next matmul."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
