"""The recurrent state of a hybrid model's Mamba layers: a pool of fixed-size slots.

A Mamba layer keeps no per-token K/V; after ``n`` tokens its whole memory of them is a conv
state (the last ``d_conv - 1`` inputs of its causal convolution) and an SSM state
(``heads x head_dim x d_state``). A slot of this pool holds both, for every Mamba layer, in
float32 whatever the weights' dtype: the state is a running product over every token seen,
and rounding it at each step would make the state after ``n`` tokens depend on how they were
split into steps.

A slot is always in exactly one place: the free list, one running request (the state it
advances step by step), or the prefix cache (a snapshot of some request's state after a
prefix, which later requests copy into their own slot and never write).

A speculative decoding step (``sched/speculation.py``) computes a request's last token and a
draft of ``k`` tokens as one extend, and only afterwards learns how many are kept. A
recurrent state cannot be cut back, so such a step does not write its slot: the model
*stages* what ends the step at any of its positions (:class:`StagedStates`), and the
scheduler *settles* it once it knows how many it keeps (:meth:`settle`). Until then the slot
keeps the state from before the step, so a failed step, or a request ending before its step
is applied, leaves the state its written tokens give. Knows nothing of requests or of the
tree: the scheduler and the cache decide who holds what.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["MambaStatePool", "StagedStates"]


class StagedStates(Protocol):
    """A slot's states after each position of a step, as the model staged them."""

    def keep(self, rows: int) -> None:
        """Write the state after the step's first ``rows`` positions into the slot."""


class MambaStatePool:
    """Conv and SSM states of ``num_layers`` Mamba layers in ``capacity`` slots, and their free list."""

    def __init__(self, num_layers: int, capacity: int, conv_dim: int, d_conv: int, num_heads: int,
                 head_dim: int, d_state: int, device: str | torch.device = "cpu") -> None:
        for name, v, low in (("num_layers", num_layers, 1), ("capacity", capacity, 1), ("conv_dim", conv_dim, 1),
                             ("d_conv", d_conv, 2), ("num_heads", num_heads, 1), ("head_dim", head_dim, 1),
                             ("d_state", d_state, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"MambaStatePool {name} must be an int >= {low}, got {v!r}")
        self.num_layers = num_layers
        self.capacity = capacity
        self.device = torch.device(device)
        # [layer, slot, d_conv - 1, conv_dim]: the conv's last inputs, oldest first.
        self.conv = torch.zeros((num_layers, capacity, d_conv - 1, conv_dim), dtype=torch.float32,
                                device=self.device)
        # [layer, slot, heads, head_dim, d_state]
        self.ssm = torch.zeros((num_layers, capacity, num_heads, head_dim, d_state), dtype=torch.float32,
                               device=self.device)
        self.reset()

    def reset(self) -> None:
        """Every slot free (the contents are left as they are: a slot is zeroed when taken)."""
        # Popped from the end: the lowest slots go first, so tests see stable numbers.
        self._free = list(range(self.capacity - 1, -1, -1))
        #: Slots whose step the model staged instead of writing (see the module docstring).
        self.staged: dict[int, StagedStates] = {}

    def stage(self, slot: int, states: StagedStates) -> None:
        """The model ran a step for ``slot`` without writing it: ``states`` can end the step
        at any of its positions (:meth:`settle`)."""
        self._check(slot)
        if slot in self.staged:
            raise RuntimeError(f"state slot {slot} already has a staged step that was never settled")
        self.staged[slot] = states

    def settle(self, slot: int, rows: int) -> None:
        """Slot ``slot`` becomes the state after the first ``rows`` positions of its staged step."""
        states = self.staged.pop(slot, None)
        if states is None:
            raise RuntimeError(f"state slot {slot} has no staged step to settle")
        states.keep(rows)

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one state (all layers) takes: what a snapshot costs."""
        per = self.conv[0, 0].numel() + self.ssm[0, 0].numel()
        return per * self.num_layers * self.conv.element_size()

    def alloc(self) -> int | None:
        """A free slot (its contents undefined until :meth:`zero` or :meth:`copy`), or None."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        """Give ``slot`` back; a step staged for it and never settled is dropped (its request
        ended before the step was applied, or the step failed)."""
        self._check(slot)
        self.staged.pop(slot, None)
        self._free.append(slot)

    def free_slot_set(self) -> set[int]:
        return set(self._free)

    def zero(self, slot: int) -> None:
        """The state before any token: what a request computing from position 0 starts from."""
        self._check(slot)
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Slot ``dst`` becomes a copy of slot ``src`` (every layer); the two stay independent."""
        self._check(src)
        self._check(dst)
        self.conv[:, dst].copy_(self.conv[:, src])
        self.ssm[:, dst].copy_(self.ssm[:, src])

    def _check(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.capacity:
            raise ValueError(f"state slot must be an int in [0, {self.capacity}), got {slot!r}")
