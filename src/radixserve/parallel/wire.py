"""The per-step message from rank 0 to the other ranks: a ForwardBatch as int64 tensors.

Every step is two broadcasts: a fixed-size header (which operation, the step number, the
sizes) and, for a forward, one int64 payload holding the whole scheduling decision:

    prefix_lens[B] extend_lens[B] logit_flags[B] input_ids[T] positions[T] out_slots[T] seq_slots[S]

(``logit_flags``: bit 0 = needs logits, bit 1 = wants every position's logits; ``seq_slots``
concatenated, ``S = sum(prefix_lens) + T``). Nothing else crosses: token ids, positions and
slot indices are all a rank needs to run the same forward on its shard.

:class:`BatchDigest` folds what each rank's forward consumed into a running hash; equal
digests after N steps mean every rank wrote the same tokens' K/V into the same slots and
read the same slots, in the same order, at every step.
"""

from __future__ import annotations

import hashlib

import torch

from radixserve.model.arch.forward_batch import ForwardBatch

OP_FORWARD, OP_CHECK, OP_SHUTDOWN = 1, 2, 3
HEADER_LEN = 8  # op, step, payload length, B, T, S, flags, (spare)
FLAG_SKIP_LOGITS = 1  # workers compute no logits (the lm_head runs on rank 0 alone)


def header(op: int, step: int, payload_len: int = 0, b: int = 0, t: int = 0, s: int = 0,
           flags: int = 0) -> torch.Tensor:
    return torch.tensor([op, step, payload_len, b, t, s, flags, 0], dtype=torch.int64)


def encode_forward(fb: ForwardBatch, step: int, flags: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a forward step; CPU int64 tensors."""
    b = fb.num_seqs
    need = fb.need_logits or [True] * b
    want = fb.return_all_logits or [False] * b
    meta = torch.tensor(list(fb.prefix_lens) + list(fb.extend_lens)
                        + [int(n) | (2 if w else 0) for n, w in zip(need, want)], dtype=torch.int64)
    slots = fb.seq_slots[0] if b == 1 else torch.cat(fb.seq_slots)
    parts = [meta, fb.input_ids, fb.positions, fb.out_slots, slots]
    payload = torch.cat([p.to(device="cpu", dtype=torch.int64).reshape(-1) for p in parts])
    t = int(fb.input_ids.numel())
    return header(OP_FORWARD, step, int(payload.numel()), b, t, int(slots.numel()), flags), payload


def decode_forward(hdr: list[int], payload: torch.Tensor, device: torch.device) -> ForwardBatch:
    """The ForwardBatch a header and payload describe (tensors on ``device``)."""
    _, _, n, b, t, s, flags, _ = hdr
    if payload.numel() != n or n != 3 * b + 3 * t + s:
        raise ValueError(f"step payload has {payload.numel()} entries, header says {n} "
                         f"(B={b}, T={t}, S={s})")
    meta = payload[: 3 * b].tolist()
    prefix, extend, lflags = meta[:b], meta[b : 2 * b], meta[2 * b :]
    o = 3 * b
    input_ids, positions, out_slots = (payload[o + i * t : o + (i + 1) * t].to(device) for i in range(3))
    slots = payload[o + 3 * t :].to(device)
    seq_slots = list(torch.split(slots, [p + e for p, e in zip(prefix, extend)]))
    skip = bool(flags & FLAG_SKIP_LOGITS)
    return ForwardBatch(input_ids=input_ids, positions=positions, out_slots=out_slots, seq_slots=seq_slots,
                        prefix_lens=prefix, extend_lens=extend,
                        return_all_logits=[bool(f & 2) and not skip for f in lflags],
                        need_logits=[bool(f & 1) and not skip for f in lflags])


class BatchDigest:
    """A running hash of what every step's forward consumed: the step number, the lengths,
    token ids, positions and slots of a payload (not the logit flags, which may differ by
    rank). Rank 0 hashes the payload it sends; a worker re-packs the ForwardBatch it
    decoded and hashes that, so the check covers the decoding too."""

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=8)
        self.steps = 0

    def update(self, step: int, payload: torch.Tensor, num_seqs: int) -> None:
        self.steps += 1
        arr = payload.contiguous().numpy()
        self._h.update(step.to_bytes(8, "little", signed=True))
        self._h.update(arr[: 2 * num_seqs])
        self._h.update(arr[3 * num_seqs :])

    def value(self) -> int:
        """The digest as a signed 64-bit int (what the ranks all-gather)."""
        return int.from_bytes(self._h.digest(), "little", signed=True)
