"""A tiny byte-level BPE tokenizer trained at import-free speed on a fixed corpus: the
tokenizer of the ``tiny-random`` test model (vocabulary of any size >= 256 + specials)."""

from __future__ import annotations

import itertools
from collections import Counter

from tokenizers import pre_tokenizers

from radixserve.chat_template import CHATML_TEMPLATE
from radixserve.model.tokenization.gguf_tokenizer import TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TokenizerSpec, bytes_to_unicode
from radixserve.model.tokenization.tokenizer import Tokenizer

_TINY_CORPUS = """
The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of
France is Paris. A radix tree stores shared prefixes once; every request that shares a prompt
prefix reuses the cached keys and values instead of computing them again. Hello, world! How are
you today? I am fine, thank you. def main(): return sum(range(10)) if x else None
import torch; for i in range(3): print(i) # comments and code
The scheduler orders the waiting queue so that requests with the longest cached prefix run
first, which raises the hit rate of the cache and the throughput of the engine.
system user assistant model token tokens prompt answer question language serving runtime
"""

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_level_spec(vocab_size: int = 512, corpus: str = _TINY_CORPUS) -> TokenizerSpec:
    """A deterministic byte-level BPE vocabulary of exactly ``vocab_size`` tokens.

    Layout mirrors SmolLM2: ids 0..2 are ``<|endoftext|>``, ``<|im_start|>`` (bos),
    ``<|im_end|>`` (eos), then the 256 byte tokens, then merges learned greedily on a small
    fixed corpus. Used by the tiny random model so tests exercise the real GGUF tokenizer
    path (specials, merges, chat template) without a real model.
    """
    n_special = len(TINY_SPECIAL_TOKENS)
    if vocab_size < n_special + 256:
        raise ValueError(f"vocab_size must be >= {n_special + 256}, got {vocab_size}")
    vocab = _MergeVocab(list(TINY_SPECIAL_TOKENS))
    vocab.learn(corpus, vocab_size)
    vocab.pad(vocab_size)
    tokens, merges = vocab.tokens, vocab.merges
    types = [TOKEN_TYPE_CONTROL] * n_special + [TOKEN_TYPE_NORMAL] * (len(tokens) - n_special)
    return TokenizerSpec(
        tokens=tokens,
        merges=merges,
        token_types=types,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        model="gpt2",
        pre="gpt2",
        chat_template=CHATML_TEMPLATE,
        add_bos_token=False,
    )


class _MergeVocab:
    """A byte-level BPE vocabulary being grown: tokens (specials, the 256 bytes, then one per
    merge) and the merges in the order they were learned."""

    def __init__(self, specials: list[str]):
        self.spelling = bytes_to_unicode()
        self.tokens = specials + [self.spelling[b] for b in range(256)]
        self.in_vocab = set(self.tokens)
        self.merges: list[str] = []

    def _add(self, a: str, b: str) -> None:
        self.merges.append(f"{a} {b}")
        self.tokens.append(a + b)
        self.in_vocab.add(a + b)

    def learn(self, corpus: str, vocab_size: int) -> None:
        """Merges learned greedily on ``corpus`` (most frequent pair first, ties by the pair)
        until the vocabulary has ``vocab_size`` tokens or the corpus has no new pair."""
        words = Counter(
            w for w, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(corpus)
        )
        seqs = {w: list(w) for w in words}
        while len(self.tokens) < vocab_size:
            pairs: Counter[tuple[str, str]] = Counter()
            for w, count in words.items():
                s = seqs[w]
                for a, b in zip(s, s[1:]):
                    pairs[(a, b)] += count
            best = next((p for p, _ in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
                         if p[0] + p[1] not in self.in_vocab), None)
            if best is None:
                return
            self._add(*best)
            seqs = {w: _merged(s, *best) for w, s in seqs.items()}

    def pad(self, vocab_size: int) -> None:
        """Corpus exhausted: merges of byte pairs (letters first) until the size is exact."""
        letters = [self.spelling[ord(" ")]] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
        all_bytes = [self.spelling[b] for b in range(256)]
        for a, b in itertools.chain(itertools.product(letters, letters), itertools.product(all_bytes, all_bytes)):
            if len(self.tokens) >= vocab_size:
                break
            if a + b not in self.in_vocab:
                self._add(a, b)


def _merged(s: list[str], a: str, b: str) -> list[str]:
    """``s`` with every adjacent (a, b) joined, left to right."""
    i, out = 0, []
    while i < len(s):
        if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(s[i])
            i += 1
    return out


def tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """The tokenizer of the tiny random model (see :func:`byte_level_spec`)."""
    return Tokenizer.from_spec(byte_level_spec(vocab_size))

