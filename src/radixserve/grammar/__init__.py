"""Structured outputs: grammars (JSON schema, regex, EBNF/Lark) compiled by llguidance.

- :mod:`spec` — what a request asks for (:class:`GrammarSpec`), pure data, checked for size.
- :mod:`ll_tokenizer` — the model's vocabulary as llguidance sees it (token bytes + EOS).
- :mod:`compiler` — compilation off the engine loop (a thread pool), cached by grammar text;
  a grammar that cannot compile is a :class:`GrammarError` (a ``ValueError``).
- :mod:`matcher` — one request's live matcher: per-step constraint, accept, forced tokens.
- :mod:`mask` — applying a packed token bitmask to float32 logits.
- :mod:`tools` — OpenAI tool calls: the grammar built from tool schemas, and the parser.
"""

from radixserve.grammar.spec import GrammarSpec, GrammarError

__all__ = ["GrammarSpec", "GrammarError"]
