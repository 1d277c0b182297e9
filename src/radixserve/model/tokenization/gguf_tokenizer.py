"""A ``tokenizers`` pipeline rebuilt from a GGUF file's tokenizer metadata.

A GGUF file carries no ``tokenizer.json``, only llama.cpp's metadata (``tokenizer.ggml.*``,
held here as a :class:`TokenizerSpec`), so the pipeline (vocab, merges, pre-tokenizer,
special tokens) is assembled the way the model was trained: BPE only reproduces the
reference ids when every piece matches. Two GGUF tokenizer models are supported: ``gpt2``
(byte-level BPE with merges: SmolLM2, Llama 3, Qwen2) and ``llama`` (SentencePiece BPE with
byte fallback) for the Gemma family, built exactly as transformers' GGUF converter builds
``GemmaTokenizer``: the file has no merges, so they are recovered from the vocabulary,
ranked by token position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

# llama.cpp token types (``tokenizer.ggml.token_type``).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Architectures whose SentencePiece ("llama") GGUF vocabulary is built the Gemma way.
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")

# Pre-tokenizer split regexes keyed by llama.cpp's ``tokenizer.ggml.pre``: BPE merges only
# reproduce the reference ids if the text is cut into words the same way as in training.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS: dict[str, str] = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map; byte-level vocabularies are spelled in it."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


@dataclass
class TokenizerSpec:
    """A tokenizer as llama.cpp stores it in GGUF metadata (``tokenizer.ggml.*``).

    ``tokens`` are spelled in the byte-level alphabet for ``model == "gpt2"`` and with ``▁``
    for spaces (SentencePiece) for ``model == "llama"``; ``token_types`` uses llama.cpp's codes
    (1 normal, 3 control, 4 user-defined, 6 byte, ...). ``arch`` is the GGUF's
    ``general.architecture`` for a SentencePiece vocabulary (how it is assembled depends on
    it), None for byte-level BPE. ``chat_template_builtin``: ``chat_template`` is radixserve's
    stand-in for an architecture's template, not the file's (a base model's GGUF ships none).
    """

    tokens: list[str]
    merges: list[str]  # "left right" pairs, best first
    token_types: list[int] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    model: str = "gpt2"
    pre: str | None = None
    chat_template: str | None = None
    chat_template_builtin: bool = False
    add_bos_token: bool = False
    scores: list[float] | None = None  # SentencePiece piece scores (unused for Gemma)
    arch: str | None = None

    def __post_init__(self) -> None:
        if self.token_types is not None and len(self.token_types) != len(self.tokens):
            raise ValueError(f"token_types has {len(self.token_types)} entries for {len(self.tokens)} tokens")
        if self.scores is not None and len(self.scores) != len(self.tokens):
            raise ValueError(f"scores has {len(self.scores)} entries for {len(self.tokens)} tokens")
        for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < len(self.tokens):
                raise ValueError(f"{name} {v} is outside the vocabulary of {len(self.tokens)}")


def _build_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        # SmolLM2's tokenizer.json: every digit is its own word, then GPT-2's byte-level regex
        # (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM is the same split: "\p{N}" first).
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = _PRE_SPLITS.get(pre or "")
    if split is not None:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # "gpt2", "default", unknown or absent: GPT-2's own regex inside ByteLevel.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _gemma_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The BPE merges a merge-less Gemma vocabulary implies, in transformers' order.

    transformers (``generate_merges`` with ``-position`` as the score) takes every split of
    every token into two tokens, ranked by the merged token's position, then by the longer
    left part: one pass in position order yields that order without a sort of 500k pairs.
    """
    merges: list[tuple[str, str]] = []
    append = merges.append
    for tok in sorted(vocab, key=vocab.__getitem__):
        for i in range(len(tok) - 1, 0, -1):
            left = tok[:i]
            if left in vocab:
                right = tok[i:]
                if right in vocab:
                    append((left, right))
    return merges


def _build_gemma_backend(spec: TokenizerSpec) -> tokenizers.Tokenizer:
    """Gemma's SentencePiece BPE as ``GemmaTokenizer`` over a GGUF vocabulary: spaces are
    ``▁`` (a normalizer), no pre-tokenizer split, byte fallback for unseen characters."""
    # A token of only whitespace containing a space ("  ") is stored with real spaces;
    # the normalizer turns every space into "▁", so it is looked up as "▁▁" (transformers'
    # gemma_tokenizer does the same respelling).
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in spec.tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = spec.tokens[spec.unk_token_id] if spec.unk_token_id is not None else "<unk>"
    bpe = models.BPE(vocab=vocab, merges=_gemma_merges(vocab), unk_token=unk, fuse_unk=True,
                     byte_fallback=True, dropout=None)
    tok = tokenizers.Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # User-defined tokens whose file spelling is not in the vocabulary (the respelled "  ")
    # are left out, as transformers leaves them out.
    _add_typed_tokens(tok, spec, lambda t: True, vocab.__contains__)
    return tok


def _add_typed_tokens(tok: tokenizers.Tokenizer, spec: TokenizerSpec, control_ok: Callable[[str], bool],
                      user_ok: Callable[[str], bool]) -> None:
    """``spec``'s control tokens as special tokens and its user-defined ones ("\n\n",
    "<table>", ...) as added tokens, matched whole in the raw text as in llama.cpp; each only
    where ``control_ok`` / ``user_ok`` accepts it."""
    typed = list(zip(spec.tokens, spec.token_types or []))
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in typed if ty == TOKEN_TYPE_CONTROL and control_ok(t)]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in typed if ty == TOKEN_TYPE_USER_DEFINED and user_ok(t)]
    if user:
        tok.add_tokens(user)


def build_backend(spec: TokenizerSpec) -> tokenizers.Tokenizer:
    """The ``tokenizers`` pipeline of ``spec``; ValueError for a tokenizer model we do not build."""
    if spec.model == "llama":
        if spec.arch in _GEMMA_ARCHS:
            return _build_gemma_backend(spec)
        raise ValueError(f"SentencePiece ('llama') GGUF tokenizers are supported for {', '.join(_GEMMA_ARCHS)} "
                         f"only, not for architecture {spec.arch!r}")
    if spec.model != "gpt2":
        raise ValueError(f"tokenizer model {spec.model!r} is not supported (byte-level BPE 'gpt2', or "
                         f"SentencePiece 'llama' for Gemma)")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(spec.tokens):
        # A token outside the byte alphabet (some converters store control tokens raw) is
        # respelled byte by byte, as transformers' GGUF converter does.
        key = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(key, i)
    merges = []
    for m in spec.merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"malformed merge {m!r} (expected 'left right')")
        merges.append((left, right))
    # No unk token: in byte-level BPE every byte has a token, so nothing is ever unknown.
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = _build_pre_tokenizer(spec.pre)
    tok.decoder = decoders.ByteLevel()
    _add_typed_tokens(tok, spec, lambda t: set(t) <= alphabet, lambda t: True)
    return tok
