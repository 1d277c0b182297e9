"""Req.cache_key: the packed ids the scheduler hands the prefix cache must track fill_ids."""

from __future__ import annotations

from array import array

from radixserve.cache import RadixCache
from radixserve.request import Req
from radixserve.sampling_params import SamplingParams


def test_cache_key_follows_fill_ids_as_outputs_grow():
    req = Req(rid="r", prompt_ids=[5, 70000, 2**32 - 1], params=SamplingParams(max_tokens=8))
    assert req.cache_key().tolist() == req.fill_ids
    for tok in (9, 0, 123456):
        req.output_ids.append(tok)
        key = req.cache_key()
        assert isinstance(key, array) and key.typecode == "I"
        assert key.tolist() == req.fill_ids and req.num_fill == len(req.fill_ids)
    for end in range(0, req.num_fill + 2):
        assert req.cache_key(end).tolist() == req.fill_ids[:end]
    # A slice is a copy: the caller may keep it while the request keeps growing.
    head = req.cache_key(2)
    req.output_ids.append(7)
    assert head.tolist() == req.fill_ids[:2] and req.cache_key().tolist() == req.fill_ids


def test_packed_and_list_queries_are_interchangeable():
    cache = RadixCache(page_size=2)
    ids = [1, 2, 3, 4, 2**31, 6]
    cache.insert(array("I", ids), list(range(100, 106)))
    assert cache.match_prefix(ids).length == 6
    assert cache.match_prefix(array("I", ids[:5])).length == 4
    assert cache.insert(ids + [9, 9], list(range(200, 208))) == 6
    # Other array typecodes are read as plain sequences.
    assert cache.match_prefix(array("q", ids)).indices.tolist() == list(range(100, 106))
    cache.check_integrity()
