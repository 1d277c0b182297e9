"""The model's vocabulary as llguidance needs it, built once per tokenizer.

llguidance reads the vocabulary from a Hugging Face ``tokenizer.json`` (every tokenizer here
is a ``tokenizers.Tokenizer`` backend, GGUF-built ones included), so its forced tokens are
the model's own BPE tokenization of the forced text. The width is the model's vocabulary
(its logits), which may exceed the tokenizer's: the extra ids are never allowed.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import llguidance

_lock = threading.Lock()
_built: "weakref.WeakKeyDictionary[Any, dict[int, llguidance.LLTokenizer]]" = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """The :class:`llguidance.LLTokenizer` of ``tokenizer`` (a radixserve ``Tokenizer``) for a
    model with ``vocab_size`` logits; built once (it walks the whole vocabulary) and shared.

    EOS tokens are the tokenizer's stop tokens (EOS first): a grammar that may end allows them."""
    with _lock:
        per = _built.setdefault(tokenizer, {})
        got = per.get(vocab_size)
        if got is not None:
            return got
        eos = tokenizer.eos_token_id
        stops = sorted(int(t) for t in getattr(tokenizer, "stop_token_ids", ()) if int(t) < vocab_size)
        eos_ids = ([eos] if eos is not None and eos < vocab_size else []) + [t for t in stops if t != eos]
        per[vocab_size] = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=eos_ids or None,
                                                 n_vocab=max(vocab_size, tokenizer.vocab_size))
        return per[vocab_size]
