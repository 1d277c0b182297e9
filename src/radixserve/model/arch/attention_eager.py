"""The pure-torch attention backend (``"torch-eager"``).

It is the reference the kernels are tested against, and the path the default backend falls
back to for pools the kernels do not serve (other devices / dtypes, or no compiler).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from radixserve.memory.kv_pool import KVPool
from radixserve.model.arch.attention_base import AttentionBackend, check_batch
from radixserve.model.arch.forward_batch import ForwardBatch


@dataclass
class ExtendSeq:
    """One multi-token sequence of the batch (a prefill, or a prefill's tail)."""

    start: int  # first row of this sequence in the batch's T rows
    extend_len: int
    prefix_len: int
    # Head-major row index into the pool's ``[2, slots * kv_heads, D]`` view for the keys
    # key_start .. prefix_len + extend_len - 1 (None when prefix_len == 0: the new K/V are
    # used directly).
    rows: torch.Tensor | None
    # [extend_len, keys] bool, True = may attend (None when causal suffices); the keys are
    # positions key_start .. prefix_len + extend_len - 1.
    mask: torch.Tensor | None
    key_start: int = 0  # first key position read (> 0 under a sliding window)


@dataclass
class TorchAttentionMetadata:
    """Everything the eager path needs, built once per forward pass."""

    out_slots: torch.Tensor  # [T] slots that receive the new K/V
    num_tokens: int
    # Single-token sequences (decode), attended together in one batched pass.
    decode_rows: torch.Tensor | None  # [Bd] rows of those tokens in T (None if all rows, in order)
    decode_index: torch.Tensor | None  # [Bd, Lmax] slots, padded with kv_pool.pad_slot
    # The same, as head-major rows of the pool's [2, slots * kv_heads, D] view: [Bd*kv*Lmax].
    decode_rows_index: torch.Tensor | None
    # [Bd, 1, 1, Lmax] float32 additive mask (0 / -inf).
    decode_bias: torch.Tensor | None
    num_decode: int
    # Multi-token sequences, attended one by one (ragged prefill).
    extends: list[ExtendSeq]
    # What sliding-window variants are built from, and those built so far (window -> metadata).
    batch: ForwardBatch | None = None
    windows: dict[int, "TorchAttentionMetadata"] = field(default_factory=dict)


class EagerTorchAttentionBackend(AttentionBackend):
    """Pure-torch paged attention: gather K/V by slot index, then SDPA / batched matmul.

    Decode (sequences with one new token) runs as one batched attention over K/V gathered
    with a padded ``[B, Lmax]`` slot index built once per forward; padding points at the
    pool's scratch slot and is masked with ``-inf``. Multi-token sequences run one at a time
    through ``F.scaled_dot_product_attention``: without a prefix the fresh K/V are used
    directly with ``is_causal``; with a prefix the slots are gathered and a causal mask
    offset by the prefix length is applied. The reference for the kernels.

    A sliding window gets its own index set, built on the first layer that asks for it in a
    forward pass: only the window's slots are gathered (a decode row's last ``W``, a
    prefill's from its first new token's window on), and the mask also drops keys before
    each row's window.
    """

    name = "torch-eager"

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def uses_kernels(self) -> bool:
        return False

    # ------------------------------------------------------------------ prepare
    def prepare(self, batch: ForwardBatch, kv_pool: KVPool) -> TorchAttentionMetadata:
        check_batch(batch)
        return self._prepare(batch, kv_pool, 0)

    def _prepare(self, batch: ForwardBatch, kv_pool: KVPool, window: int) -> TorchAttentionMetadata:
        """The metadata of full causal attention (``window`` 0) or of a sliding window."""
        dev = self.device
        decode_seqs: list[int] = []
        decode_rows: list[int] = []
        extends: list[ExtendSeq] = []
        start = 0
        for i, (p, e) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
            if e == 1:
                decode_seqs.append(i)
                decode_rows.append(start)
            else:
                lo = max(0, p - window + 1) if window else 0  # first key any new row sees
                mask = None
                if p or (window and e > window):  # else causal alone (fresh K/V, no window)
                    q_pos = torch.arange(p, p + e, device=dev)
                    k_pos = torch.arange(lo, p + e, device=dev)
                    mask = k_pos[None, :] <= q_pos[:, None]
                    if window:
                        mask &= k_pos[None, :] > q_pos[:, None] - window
                if p == 0:  # attends over the fresh K/V
                    extends.append(ExtendSeq(start, e, 0, None, mask))
                else:
                    rows = _head_major_rows(batch.seq_slots[i][lo:].to(dev), kv_pool.num_kv_heads)
                    extends.append(ExtendSeq(start, e, p, rows, mask, key_start=lo))
            start += e

        decode_index = decode_bias = rows_t = rows_index = None
        if decode_seqs:
            # A decode row at position p reads keys max(0, p - window + 1) .. p.
            firsts = [max(0, batch.prefix_lens[i] + 1 - window) if window else 0 for i in decode_seqs]
            lens = [batch.prefix_lens[i] + 1 - f for i, f in zip(decode_seqs, firsts)]
            lmax = max(lens)
            b = len(decode_seqs)
            decode_index = torch.nn.utils.rnn.pad_sequence(
                [batch.seq_slots[i][f:].to(dev) for i, f in zip(decode_seqs, firsts)], batch_first=True,
                padding_value=kv_pool.pad_slot)
            lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
            rows_index = _head_major_rows(decode_index, kv_pool.num_kv_heads)
            valid = torch.arange(lmax, device=dev)[None, :] < lens_t[:, None]
            decode_bias = torch.zeros((b, 1, 1, lmax), dtype=torch.float32, device=dev)
            decode_bias.masked_fill_(~valid[:, None, None, :], float("-inf"))
            if b != start:  # mixed batch: decode rows are a subset of T
                rows_t = torch.tensor(decode_rows, dtype=torch.int64, device=dev)
        return TorchAttentionMetadata(out_slots=batch.out_slots.to(dev), num_tokens=start, decode_rows=rows_t,
                                      decode_index=decode_index, decode_rows_index=rows_index,
                                      decode_bias=decode_bias, num_decode=len(decode_seqs), extends=extends,
                                      batch=batch)

    def _windowed(self, metadata: TorchAttentionMetadata, kv_pool: KVPool,
                  window: int) -> TorchAttentionMetadata:
        """``metadata`` for a sliding window of ``window`` keys (built once per forward)."""
        batch = metadata.batch
        if window <= 0 or batch is None:
            return metadata
        if all(p + e <= window for p, e in zip(batch.prefix_lens, batch.extend_lens)):
            return metadata  # the window covers every sequence: full causal attention
        meta = metadata.windows.get(window)
        if meta is None:
            meta = metadata.windows[window] = self._prepare(batch, kv_pool, window)
        return meta

    # ------------------------------------------------------------------ forward
    def forward(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, layer_id: int, kv_pool: KVPool,
                metadata: TorchAttentionMetadata, *, window: int = 0, scale: float | None = None) -> torch.Tensor:
        t, num_heads, head_dim = q.shape
        num_kv = k_new.shape[1]
        metadata = self._windowed(metadata, kv_pool, window)
        decode_scale = head_dim**-0.5 if scale is None else scale
        kv_layer = kv_pool.kv[layer_id]  # [2, capacity + 1, kv_heads, row]
        # One index_copy_ writes K and V of every new token.
        stored = kv_pool.encode(torch.stack((k_new, v_new)))
        kv_layer.index_copy_(1, metadata.out_slots, stored)
        # Attend over exactly what the pool holds (rounded to its dtype, or quantized), so a
        # prefix read back from the cache later gives the same result as computing it now.
        kv_new = kv_pool.decode(stored)
        k_new, v_new = kv_new[0], kv_new[1]
        q = q.float()

        if metadata.num_decode == t and not metadata.extends:
            return self._decode(q, kv_pool, kv_layer, metadata, decode_scale).reshape(t, num_heads * head_dim)

        out = torch.empty((t, num_heads, head_dim), dtype=torch.float32, device=q.device)
        if metadata.num_decode:
            rows = metadata.decode_rows
            out.index_copy_(0, rows, self._decode(q.index_select(0, rows), kv_pool, kv_layer, metadata,
                                                  decode_scale))
        gqa = num_heads != num_kv
        for seq in metadata.extends:
            s, e = seq.start, seq.extend_len
            qs = q[s : s + e].transpose(0, 1).unsqueeze(0)  # [1, H, E, D]
            if seq.rows is None:
                ks = k_new[s : s + e].transpose(0, 1).unsqueeze(0)
                vs = v_new[s : s + e].transpose(0, 1).unsqueeze(0)
            else:
                n = seq.prefix_len + e - seq.key_start
                ks, vs = self._gather(kv_pool, kv_layer, seq.rows).view(2, 1, num_kv, n, head_dim)
            # No mask: fresh K/V without a window, causal alone (a gathered prefix always has one).
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seq.mask, is_causal=seq.mask is None,
                                               scale=scale, enable_gqa=gqa)
            out[s : s + e] = o[0].transpose(0, 1)
        return out.reshape(t, num_heads * head_dim)

    def _gather(self, kv_pool: KVPool, kv_layer: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """K and V rows of one layer, head-major, float32: ``[2, len(rows), D]``.

        One ``index_select`` into a buffer the backend keeps across layers and forward passes:
        a fresh multi-MB tensor per layer would pay page faults on every first touch. The
        buffer is only valid until the next call (the next layer), which is all attention needs.
        """
        two, slots, num_kv, row = kv_layer.shape
        src = kv_layer.view(two, slots * num_kv, row)
        n = rows.numel()
        buf = self._buffer("gather", (2, n, row), kv_layer.dtype, kv_layer.device)
        torch.index_select(src, 1, rows, out=buf)
        if buf.dtype == torch.float32:
            return buf
        if kv_pool.quantized:
            return kv_pool.decode(buf)
        return self._buffer("gather32", (2, n, row), torch.float32, kv_layer.device).copy_(buf)

    def _buffer(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(numel, 2 * buf.numel() if buf is not None else 0),
                              dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)

    def _decode(self, q: torch.Tensor, kv_pool: KVPool, kv_layer: torch.Tensor, metadata: TorchAttentionMetadata,
                scale: float) -> torch.Tensor:
        """Batched single-query attention over padded gathered K/V: ``[B, H, D]`` out.

        K/V are gathered straight into head-major ``[B, kv_heads, Lmax, D]`` (the row index is
        built once per forward), so both matmuls run on contiguous operands. Query heads are
        grouped per KV head, so GQA never materialises repeated K/V.
        """
        b, num_heads, head_dim = q.shape
        num_kv = kv_layer.shape[2]
        lmax = metadata.decode_index.shape[1]
        kv = self._gather(kv_pool, kv_layer, metadata.decode_rows_index).view(2, b, num_kv, lmax, head_dim)
        group = num_heads // num_kv
        qg = q.reshape(b * num_kv, group, head_dim) * scale
        k = kv[0].view(b * num_kv, lmax, head_dim)
        v = kv[1].view(b * num_kv, lmax, head_dim)
        scores = torch.bmm(qg, k.transpose(1, 2)).view(b, num_kv, group, lmax)
        probs = torch.softmax(scores + metadata.decode_bias, dim=-1)
        out = torch.bmm(probs.view(b * num_kv, group, lmax), v)
        return out.view(b, num_heads, head_dim)


def _head_major_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows ``slot * kv_heads + h`` ordered ``[..., kv_heads, len]`` for a ``[..., len]`` slot index.

    Rows of the pool viewed as ``[2, slots * kv_heads, head_dim]``: gathering them yields K/V
    already in the ``[..., kv_heads, len, head_dim]`` layout attention wants.
    """
    heads = torch.arange(num_kv_heads, device=slots.device)
    rows = slots.unsqueeze(-2) * num_kv_heads + heads[:, None]
    return rows.reshape(-1)
