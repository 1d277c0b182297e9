"""Hugging Face-named weights as a model's loader reads them.

Strict on purpose: a missing name, a wrong shape or a tensor nobody read is a ValueError at
load time rather than garbage text at serving time. Shared by every decoder's loader.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn


class HFWeights:
    """Hugging Face-named tensors read by a model's loader: strict about names and shapes,
    and about leftovers (:meth:`check_all_used`)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], device: torch.device, used: set[str] | None = None):
        self.state_dict = state_dict
        self.device = device
        self.used: set[str] = set() if used is None else used  # names read (a caller's set to share it)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.state_dict:
            raise ValueError(f"state dict is missing {name!r}")
        t = self.state_dict[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"state dict {name!r} has shape {tuple(t.shape)}, expected {shape}")
        self.used.add(name)
        return t

    def put(self, param: nn.Parameter, value: torch.Tensor) -> None:
        param.data = value.to(device=self.device, dtype=param.dtype).contiguous()

    def check_all_used(self) -> None:
        """ValueError naming keys nobody read (``rotary_emb.inv_freq`` buffers excepted)."""
        unexpected = [
            k for k in self.state_dict if k not in self.used and not k.endswith("rotary_emb.inv_freq")
        ]
        if unexpected:
            raise ValueError(
                f"state dict has {len(unexpected)} unexpected keys, e.g. {unexpected[:5]}"
            )
