"""The byte format of one stored KV page: a fixed header, then the page's tensor.

Storage is shared and outlives the process that wrote it, so every read is checked before a
single byte reaches the KV pool. The header says what the object claims to be; the reader
compares that with what it asked for::

    magic  "RXKV"     4s   not one of ours -> corrupt
    version           H    unknown format -> foreign
    flags             H    reserved, 0
    kv_dtype         16s   the KV dtype of the payload (float32, bfloat16, int8, fp8_e4m3),
                           ASCII, NUL-padded; another one -> foreign
    fingerprint      32s   another model/dtype/shape/page size -> foreign
    key              32s   stored under a key that is not its own -> foreign
    tokens            I    tokens in the page (the fingerprint's page size)
    created           d    unix time of the write (age of L3 content at a hit)
    payload_len       Q    bytes after the header
    payload_crc32     I    CRC-32 of the payload -> corrupt on mismatch
    header_crc32      I    CRC-32 of the header bytes before it -> corrupt on mismatch

The payload is page-first: ``[layers, 2, tokens, kv_heads, row]`` in the pool's format, C
order: all layers' K and V of the page in one object (one read per page, whatever the layer
count). A row is ``head_dim`` values, or for a quantized KV dtype ``head_dim`` codes and the
row's float32 scale (``radixserve.memory.quant``): scales travel inside their rows, and a
decoded quantized page whose scales are not finite and positive is corrupt. CRC-32 guards
against corruption and truncation (zlib's runs at memory speed and releases the GIL), not
against a writer forging objects: that is what the keys are for (an attacker who can write
to the store can only write under keys it can compute, i.e. for prompts it knows, for the
model and tenant named in the fingerprint and salt).
"""

from __future__ import annotations

import struct
import time
import zlib
from typing import NamedTuple

import torch

from .keys import KEY_BYTES, ModelFingerprint

__all__ = ["encode_page", "decode_page", "ObjectError", "DecodedPage", "HEADER_SIZE", "MAGIC"]

MAGIC = b"RXKV"
VERSION = 2
_DTYPE_BYTES = 16
_HEAD = struct.Struct(f"<4sHH{_DTYPE_BYTES}s{KEY_BYTES}s{KEY_BYTES}sIdQI")  # all fields but header_crc32
_CRC = struct.Struct("<I")
HEADER_SIZE = _HEAD.size + _CRC.size


class ObjectError(Exception):
    """A stored object that must not be used; ``reason`` is "corrupt", "truncated" or "foreign"."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class DecodedPage(NamedTuple):
    data: torch.Tensor  # [layers, 2, tokens, kv_heads, row]
    created: float  # unix time the page was written


def encode_page(key: bytes, fingerprint: ModelFingerprint, data: torch.Tensor, created: float | None = None) -> bytes:
    """The stored form of page ``key`` holding ``data`` (shape ``fingerprint.page_shape``)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
    if tuple(data.shape) != fingerprint.page_shape:
        raise ValueError(f"data must have shape {fingerprint.page_shape}, got {tuple(data.shape)}")
    if data.dtype != fingerprint.storage_dtype:
        raise ValueError(f"data must have dtype {fingerprint.storage_dtype} (KV dtype {fingerprint.dtype}), "
                         f"got {data.dtype}")
    if data.device.type != "cpu" or not data.is_contiguous():
        data = data.detach().cpu().contiguous()
    payload = data.view(torch.uint8).numpy().tobytes()
    head = _HEAD.pack(MAGIC, VERSION, 0, fingerprint.dtype.encode("ascii"), fingerprint.digest, key,
                      fingerprint.page_tokens, time.time() if created is None else created, len(payload),
                      zlib.crc32(payload))
    return b"".join((head, _CRC.pack(zlib.crc32(head)), payload))


def decode_page(blob: bytes, key: bytes, fingerprint: ModelFingerprint) -> DecodedPage:
    """The page in ``blob`` if it is exactly what was asked for, else ObjectError."""
    if len(blob) < HEADER_SIZE:
        raise ObjectError("truncated", f"{len(blob)} bytes, shorter than the header")
    head = memoryview(blob)[: _HEAD.size]
    magic, version, _flags, kv_dtype, fp, okey, tokens, created, plen, pcrc = _HEAD.unpack(head)
    if magic != MAGIC:
        raise ObjectError("corrupt", "bad magic")
    if version != VERSION:  # before the checksum: another version's header has another layout
        raise ObjectError("foreign", f"format version {version}")
    (hcrc,) = _CRC.unpack_from(blob, _HEAD.size)
    if zlib.crc32(head) != hcrc:
        raise ObjectError("corrupt", "header checksum mismatch")
    kv_dtype = kv_dtype.rstrip(b"\0").decode("ascii", "replace")
    if kv_dtype != fingerprint.dtype:
        raise ObjectError("foreign", f"written with KV dtype {kv_dtype}, expected {fingerprint.dtype}")
    if fp != fingerprint.digest:
        raise ObjectError("foreign", "written for another model fingerprint")
    if okey != key:
        raise ObjectError("foreign", "object stored under a key that is not its own")
    want = fingerprint.page_nbytes
    if tokens != fingerprint.page_tokens or plen != want:
        raise ObjectError("corrupt", f"header says {tokens} tokens / {plen} bytes, expected {want}")
    have = len(blob) - HEADER_SIZE
    if have < plen:
        raise ObjectError("truncated", f"payload has {have} of {plen} bytes")
    if have > plen:
        raise ObjectError("corrupt", f"{have - plen} bytes after the payload")
    payload = memoryview(blob)[HEADER_SIZE:]
    if zlib.crc32(payload) != pcrc:
        raise ObjectError("corrupt", "payload checksum mismatch")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    data = raw.view(fingerprint.storage_dtype).view(fingerprint.page_shape)
    if fingerprint.row_dim != fingerprint.head_dim:  # quantized rows: codes, then the scale
        scales = data[..., fingerprint.head_dim :].clone(memory_format=torch.contiguous_format).view(torch.float32)
        if not bool(((scales > 0) & torch.isfinite(scales)).all()):
            raise ObjectError("corrupt", "a KV scale is not finite and positive")
    return DecodedPage(data, created)
