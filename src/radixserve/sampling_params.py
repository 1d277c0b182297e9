"""Per-request sampling options (OpenAI / SGLang style).

`SamplingParams` is part of the public API: the server builds one from a request body and
the engine carries it with the request. Validation lives here (ValueError naming the field,
never assert) so every entry point — HTTP, CLI, Python API — rejects bad input the same way
before a request ever reaches the scheduler. Bounds that need the model (token ids below the
vocabulary size, max_tokens within the context window) are checked by the engine, which
knows the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

from radixserve.grammar.spec import GrammarError, GrammarSpec, schema_text

# Below this temperature, dividing logits by T overflows float32 softmax for ordinary logit
# ranges; such rows are treated as greedy (same threshold as vLLM's _SAMPLING_EPS).
SAMPLING_EPS: float = 1e-5

MAX_TOP_LOGPROBS: int = 20
MAX_TOKEN_ID: int = 2**31 - 1  # no vocabulary is larger
MAX_TEMPERATURE: float = 100.0
MIN_REPETITION_PENALTY: float = 0.01
MAX_REPETITION_PENALTY: float = 100.0


def _check_int(name: str, value: object) -> int:
    # bool is a subclass of int; `max_tokens=True` is almost certainly a client bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"SamplingParams.{name} must be an int, got {value!r}")
    return value


def _check_float(name: str, value: object) -> float:
    # Ints are fine for float fields (temperature=1 is what JSON clients send).
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"SamplingParams.{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be finite, got {value!r}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"SamplingParams.{name} must be a bool, got {value!r}")
    return value


class _Rule(NamedTuple):
    """A numeric field's rule: its type's check, the range it must be in, that range in words."""

    name: str
    kind: Callable[[str, object], float]
    ok: Callable[[float], bool]
    expect: str
    optional: bool = False  # None is allowed (and kept)


# In the order they are checked (the first broken rule is the one reported).
_RULES_FIRST = (
    _Rule("max_tokens", _check_int, lambda v: v >= 0, ">= 0"),
    _Rule("temperature", _check_float, lambda v: 0 <= v <= MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE}]"),
    _Rule("top_p", _check_float, lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    _Rule("top_k", _check_int, lambda v: v >= -1, "-1 (off), 0 (off) or positive"),
    _Rule("min_p", _check_float, lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    # Near 0 (or huge), dividing/multiplying logits by it overflows float32 and the
    # probabilities turn into NaN.
    _Rule("repetition_penalty", _check_float,
          lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
          f"in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]"),
    _Rule("frequency_penalty", _check_float, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    _Rule("presence_penalty", _check_float, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    _Rule("seed", _check_int, lambda v: 0 <= v < 2**64, "in [0, 2**64)", optional=True),
)
_RULES_LAST = (
    _Rule("top_logprobs", _check_int, lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]"),
    _Rule("logprob_start_len", _check_int, lambda v: v >= -1, ">= -1 (-1 = no prompt logprobs)"),
)
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "logprobs", "prompt_logprobs")


@dataclass
class SamplingParams:
    """How to pick the tokens of one request and what to report back.

    Defaults follow the OpenAI API: temperature 1, no truncation, no penalties.

    - ``max_tokens``: tokens to generate; 0 means prefill only (e.g. prompt logprobs).
    - ``temperature``: 0 (anything below ``SAMPLING_EPS``) means greedy argmax.
    - ``top_k``: -1 or 0 disables; ``top_p`` in (0, 1]; ``min_p`` in [0, 1] relative to the
      most likely token.
    - ``repetition_penalty`` (HF semantics, over prompt + output tokens: positive logits are
      divided, negative ones multiplied); ``frequency_penalty`` / ``presence_penalty``
      (OpenAI semantics, over output tokens only) in [-2, 2].
    - ``seed``: a per-request generator makes the request reproducible independent of the
      rest of the batch.
    - ``stop`` / ``stop_token_ids``: strings / token ids that end generation (each normalized to
      a list); EOS ends it unless ``ignore_eos``; the stop text itself is left out unless
      ``include_stop_str_in_output``.
    - ``logprobs``: report the log-probability of each chosen token; ``top_logprobs``: also
      that many (0..20) most likely alternatives. ``prompt_logprobs`` / ``logprob_start_len``:
      report logprobs of prompt tokens from a position on (see ``prompt_logprob_start``).
    - ``json_schema`` (a JSON Schema, as JSON text or a dict), ``regex`` (matched whole),
      ``ebnf`` (GBNF or Lark): the output must match it (at most one of the three; SGLang's
      names). A grammar that reaches its end finishes the request with ``"stop"``.
    - ``prediction``: token ids the output is expected to contain (OpenAI's Predicted Outputs,
      tokenized): with speculative decoding on, a draft source beside the radix tree; it never
      changes the output, and without speculation it is ignored."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    logprob_start_len: int = -1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    prediction: list[int] | None = None

    def __post_init__(self) -> None:
        self._check_numbers(_RULES_FIRST)
        if self.top_k > MAX_TOKEN_ID:
            self.top_k = -1  # larger than any vocabulary: keeps every token, i.e. off
        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)
        for name in _BOOLS:
            _check_bool(name, getattr(self, name))
        self._check_numbers(_RULES_LAST)
        self._check_grammar()
        if self.prediction is not None:
            if not isinstance(self.prediction, (list, tuple)):  # an order, not a set
                raise ValueError(f"SamplingParams.prediction must be a list of token ids, got "
                                 f"{type(self.prediction).__name__}")
            self.prediction = self._normalize_token_ids("prediction", self.prediction) or None

    def _check_numbers(self, rules: tuple[_Rule, ...]) -> None:
        """Check (and normalize: an int temperature becomes a float) each rule's field."""
        for r in rules:
            v = getattr(self, r.name)
            if v is None and r.optional:
                continue
            v = r.kind(r.name, v)
            if not r.ok(v):
                raise ValueError(f"SamplingParams.{r.name} must be {r.expect}, got {v}")
            setattr(self, r.name, v)

    def _check_grammar(self) -> None:
        given = [n for n in ("json_schema", "regex", "ebnf") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"SamplingParams: give at most one of json_schema, regex and ebnf, got {given}")
        if self.json_schema is not None:
            self.json_schema = schema_text(self.json_schema, "SamplingParams.json_schema")
        self.grammar  # noqa: B018 - checks type, emptiness and size

    @property
    def grammar(self) -> GrammarSpec | None:
        """The grammar the output must match, or None (unconstrained)."""
        for kind in ("json_schema", "regex", "ebnf"):
            text = getattr(self, kind)
            if text is not None:
                if not isinstance(text, str):
                    raise GrammarError(f"SamplingParams.{kind} must be a string, got {type(text).__name__}", kind)
                try:
                    return GrammarSpec(kind, text)
                except GrammarError as e:
                    raise GrammarError(f"SamplingParams.{e}", kind) from None
        return None

    @staticmethod
    def _normalize_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"SamplingParams.stop must be a string or a list of strings, got {stop!r}")
        out: list[str] = []
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"SamplingParams.stop entries must be strings, got {s!r}")
            if s == "":
                # An empty stop string would match before the first token.
                raise ValueError("SamplingParams.stop entries must be non-empty strings")
            out.append(s)
        return out

    @staticmethod
    def _normalize_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple, set, frozenset)):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of ints, got {ids!r}")
        return SamplingParams._normalize_token_ids("stop_token_ids", ids)

    @staticmethod
    def _normalize_token_ids(name: str, ids: object) -> list[int]:
        if not isinstance(ids, (list, tuple, set, frozenset)):
            raise ValueError(f"SamplingParams.{name} must be a list of ints, got {type(ids).__name__}")
        out: list[int] = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
                raise ValueError(f"SamplingParams.{name} entries must be token ids (ints in [0, {MAX_TOKEN_ID}]), "
                                 f"got {t!r}")
            out.append(t)
        return out

    @property
    def is_greedy(self) -> bool:
        """True when the output is the argmax of the (penalized) logits. temperature below
        SAMPLING_EPS and top_k == 1 both leave exactly one candidate, so the sampler may skip the
        random draw (and the output is bit-reproducible)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must look at previous tokens for this request."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def prompt_logprob_start(self) -> int | None:
        """First prompt position whose logprob is reported, or None for none.
        ``logprob_start_len >= 0`` wins; otherwise ``prompt_logprobs=True`` means from 0. (Position 0
        has no logprob — nothing predicts it — so reporting starts at ``max(1, start)`` in practice;
        that is the runner's concern.)"""
        if self.logprob_start_len >= 0:
            return self.logprob_start_len
        return 0 if self.prompt_logprobs else None

    @property
    def wants_logprobs(self) -> bool:
        """Whether the sampler must compute per-token logprobs for this request."""
        return self.logprobs or self.top_logprobs > 0
