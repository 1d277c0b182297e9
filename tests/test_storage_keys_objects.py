"""Storage page keys (hash chain) and the object format (header, checks)."""

from __future__ import annotations

from array import array

import pytest
import torch

from radixserve.storage import (
    HEADER_SIZE,
    ModelFingerprint,
    ObjectError,
    decode_page,
    encode_page,
    encode_salt,
    page_keys,
)

FP = ModelFingerprint("m", "float32", 2, 2, 4, 4)


def packed(ids):
    return array("I", ids).tobytes()


# ---------------------------------------------------------------------- keys
def test_keys_chain_prefixes_and_separate_namespaces():
    a = page_keys(packed(range(12)), None, FP)
    assert len(a) == 3 and all(len(k) == 32 for k in a) and len(set(a)) == 3
    # A prefix has the same keys; a change in page 1 changes keys 1 and 2, not 0.
    assert page_keys(packed(range(9)), None, FP) == a[:2]
    b = page_keys(packed([0, 1, 2, 3, 4, 99, 6, 7, 8, 9, 10, 11]), None, FP)
    assert b[0] == a[0] and b[1] != a[1] and b[2] != a[2]  # page 2 differs via its parent
    assert page_keys(packed(range(12)), None, FP, num_pages=1) == a[:1]
    # Same tokens under another salt, model, dtype, shape or page size: unrelated keys.
    others = [
        page_keys(packed(range(12)), "tenant", FP),
        page_keys(packed(range(12)), "", FP),
        page_keys(packed(range(12)), None, ModelFingerprint("m2", "float32", 2, 2, 4, 4)),
        page_keys(packed(range(12)), None, ModelFingerprint("m", "bfloat16", 2, 2, 4, 4)),
        page_keys(packed(range(12)), None, ModelFingerprint("m", "float32", 3, 2, 4, 4)),
        page_keys(packed(range(12)), None, ModelFingerprint("m", "float32", 2, 2, 4, 4, "rev2")),
    ]
    for o in others:
        assert not set(o) & set(a)
    assert page_keys(packed(range(12)), None, ModelFingerprint("m", "float32", 2, 2, 4, 2))[0] not in a


def test_salt_encoding_is_unambiguous():
    vals = [None, "", "a", b"a", 1, "1", ("a", "b"), ("ab",), True, (None,)]
    enc = [encode_salt(v) for v in vals]
    assert len(set(enc)) == len(vals)


def test_keys_are_pinned():
    """Keys are a fixed function of their inputs (no per-process randomness such as Python's
    salted ``hash()``): servers and restarts must agree on them, and a change of the format
    would silently orphan every stored page. Change this value only with ``_DOMAIN``'s version."""
    key = page_keys(packed(range(8)), "x", FP)[1]
    assert key.hex() == "de101ea89bec911902de059fdfe121a68f07920994cb859833fe4d5301f518be"


def test_fingerprint_validation():
    with pytest.raises(ValueError, match="num_layers"):
        ModelFingerprint("m", "float32", 0, 2, 4, 4)
    with pytest.raises(ValueError, match="model"):
        ModelFingerprint("", "float32", 1, 2, 4, 4)
    with pytest.raises(ValueError, match="page_tokens"):
        ModelFingerprint("m", "float32", 1, 2, 4, True)


# ---------------------------------------------------------------------- objects
def _page(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(FP.page_shape, generator=g).to(dtype)


def test_round_trip_is_bit_identical():
    for dtype in (torch.float32, torch.bfloat16):
        fp = ModelFingerprint("m", str(dtype).removeprefix("torch."), 2, 2, 4, 4)
        data = _page(dtype)
        key = page_keys(packed(range(4)), None, fp)[0]
        blob = encode_page(key, fp, data, created=123.0)
        assert len(blob) == HEADER_SIZE + fp.page_nbytes
        page = decode_page(blob, key, fp)
        assert page.created == 123.0 and page.data.dtype == dtype
        assert torch.equal(page.data.view(torch.uint8), data.view(torch.uint8))


def test_every_damaged_or_foreign_object_is_refused_with_its_reason():
    data = _page()
    key = page_keys(packed(range(4)), None, FP)[0]
    blob = encode_page(key, FP, data)

    def reason(b, k=key, fp=FP):
        with pytest.raises(ObjectError) as ei:
            decode_page(b, k, fp)
        return ei.value.reason

    flipped = bytearray(blob)
    flipped[HEADER_SIZE + 17] ^= 0x01  # one bit of the payload
    assert reason(bytes(flipped)) == "corrupt"
    head = bytearray(blob)
    head[10] ^= 0x40  # inside the fingerprint field: header checksum catches it
    assert reason(bytes(head)) == "corrupt"
    assert reason(b"XXXX" + blob[4:]) == "corrupt"
    assert reason(blob[: HEADER_SIZE - 1]) == "truncated"
    assert reason(blob[:-1]) == "truncated"
    assert reason(blob + b"\0") == "corrupt"
    other = ModelFingerprint("other-model", "float32", 2, 2, 4, 4)
    assert reason(encode_page(key, other, data)) == "foreign"
    assert reason(blob, k=page_keys(packed(range(1, 5)), None, FP)[0]) == "foreign"
    with pytest.raises(ValueError, match="shape"):
        encode_page(key, FP, data[:, :, :2])
    with pytest.raises(ValueError, match="dtype"):
        encode_page(key, FP, data.to(torch.float16))
