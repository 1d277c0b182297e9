"""Text <-> token ids, and chat messages -> prompt text, for the models we load.

We wrap the Rust ``tokenizers`` library rather than re-implement BPE: it is the same engine
Hugging Face uses, so ids match the reference exactly once the pieces (vocab, merges,
pre-tokenizer, special tokens) are assembled the way the model was trained. A GGUF file
carries no ``tokenizer.json``, only llama.cpp's metadata, so :meth:`Tokenizer.from_spec`
rebuilds the pipeline from a :class:`TokenizerSpec` (:mod:`radixserve.model.tokenization.gguf_tokenizer`);
an HF folder has a ``tokenizer.json`` that :meth:`Tokenizer.from_hf_dir` loads as is.

Chat templates are Jinja, rendered in a sandbox (they come from model files, i.e. untrusted
input) with the same environment options transformers uses, so prompts match
``apply_chat_template`` byte for byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import tokenizers

from radixserve.chat_template import render_chat
from radixserve.model.load_error import ModelLoadError
# TokenizerSpec: public here too (the GGUF loader and users build tokenizers from it).
from radixserve.model.tokenization.gguf_tokenizer import TokenizerSpec, build_backend

# Tokens that end an assistant turn in the chat formats we know; any that exist in the vocab
# become stop tokens next to eos, because many models' eos is *not* the end-of-turn marker.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>")

# Gemma 3's chat template (google/gemma-3-*-it tokenizer_config.json), for GGUFs without one:
# a system message is folded into the first user turn, "assistant" is spelled "model".
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

# Above this many characters, encode through the GIL-releasing batch path.
_NOGIL_CHARS = 2048

def _post_processor_adds(backend: tokenizers.Tokenizer, bos_token_id: int) -> bool:
    """Whether the backend's post-processor (tokenizer.json) puts ``bos_token_id`` first."""
    try:
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
    except Exception:  # the Rust side raises a bare Exception
        return False
    return len(full) > len(plain) and full[0] == bos_token_id and (not plain or plain[0] != bos_token_id)


class Tokenizer:
    """Encode/decode, stop tokens and chat template of one model."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None = None, chat_template_builtin: bool = False, add_bos_token: bool = False,
                 extra_stop_token_ids: Iterable[int] = (), spec: TokenizerSpec | None = None,
                 prompt_bos: bool | None = None):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        # Whether chat prompts are rendered with a template of ours rather than the model's
        # (Gemma 3's for a GGUF without one; ChatML when there is none at all): a model that
        # ships no template is most likely a base model, which completes text rather than
        # answering chat turns, so callers choosing a default (radixserve generate) ask this.
        self.chat_template_builtin = bool(chat_template_builtin) or chat_template is None
        # Whether encode(add_special_tokens=True) must prepend BOS itself: GGUF-built
        # backends have no post-processor, tokenizer.json ones may (then this is False).
        self.add_bos_token = add_bos_token
        # Whether a raw (non-chat) prompt starts with BOS (encode_prompt): the GGUF's
        # add_bos_token, else what the caller read (tokenizer_config's add_bos_token), else
        # whether tokenizer.json's post-processor puts BOS first.
        if bos_token_id is None:
            prompt_bos = False
        elif add_bos_token:
            prompt_bos = True
        elif prompt_bos is None:
            prompt_bos = _post_processor_adds(backend, bos_token_id)
        self.prompt_bos: bool = bool(prompt_bos)
        self.spec = spec
        stops = {int(i) for i in extra_stop_token_ids}
        stops.update(i for i in (eos_token_id, *map(backend.token_to_id, _END_OF_TURN_TOKENS)) if i is not None)
        self.stop_token_ids: set[int] = stops

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_spec(cls, spec: TokenizerSpec) -> "Tokenizer":
        """Rebuild a tokenizer from GGUF-style metadata."""
        return cls(build_backend(spec), bos_token_id=spec.bos_token_id, eos_token_id=spec.eos_token_id,
                   chat_template=spec.chat_template, chat_template_builtin=spec.chat_template_builtin,
                   add_bos_token=spec.add_bos_token, spec=spec)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``,
        ``generation_config.json`` when present) from a Hugging Face model folder."""
        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise ModelLoadError(tj, "missing tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(tj)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ModelLoadError(tj, f"cannot parse tokenizer.json ({e})") from e
        cfg = read_json_object(os.path.join(path, "tokenizer_config.json")) or {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        if template is None:
            ct = read_json_object(os.path.join(path, "chat_template.json")) or {}
            template = ct.get("chat_template")

        def special_id(key: str) -> int | None:
            v = cfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            return backend.token_to_id(v) if isinstance(v, str) else None

        gen = read_json_object(os.path.join(path, "generation_config.json")) or {}
        model_cfg = read_json_object(os.path.join(path, "config.json")) or {}
        eos = special_id("eos_token")
        extra: list[int] = []
        for src in (gen, model_cfg):
            v = src.get("eos_token_id")
            ids = v if isinstance(v, list) else [v] if isinstance(v, int) else []
            extra.extend(ids)
            if eos is None and ids:
                eos = ids[0]
        bos = special_id("bos_token")
        if bos is None and isinstance(model_cfg.get("bos_token_id"), int):
            bos = model_cfg["bos_token_id"]
        # add_bos_token False: tokenizer.json's post-processor adds BOS if the model wants it.
        return cls(backend, bos_token_id=bos, eos_token_id=eos, chat_template=template, add_bos_token=False,
                   extra_stop_token_ids=extra,
                   prompt_bos=cfg.get("add_bos_token") if isinstance(cfg.get("add_bos_token"), bool) else None)

    # ---- ids <-> text ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (e.g. to ``.save()`` a tokenizer.json)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are
        always recognised; ``add_special_tokens`` only controls BOS/post-processing."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        if len(text) > _NOGIL_CHARS:
            # encode_batch releases the GIL (encode does not): a long prompt tokenized on a
            # worker thread must not stall the server's event loop.
            ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw (non-chat) prompt: ``encode(text)``, after BOS when the model's
        tokenizer wants one (:attr:`prompt_bos`: Gemma's does, SmolLM2's does not) and the
        text does not start with it already. A chat prompt is ``encode(rendered)`` instead:
        the template writes BOS itself."""
        ids = self.encode(text)
        if self.prompt_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._backend.id_to_token(int(i))

    def token_to_id(self, s: str) -> int | None:
        return self._backend.token_to_id(s)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    # ---- chat -----------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render the model's chat template (ChatML if it has none) to prompt text; extra
        keyword arguments are passed to the template (e.g. ``tools=...``)."""
        return render_chat(self.chat_template, messages, add_generation_prompt,
                           bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_id}, stops={sorted(self.stop_token_ids)})")


def read_json_object(path: str) -> dict | None:
    """A JSON object from ``path``; None when the file is absent, ModelLoadError when unreadable."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data
