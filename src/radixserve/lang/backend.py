"""Where a program's requests go: the in-process :class:`Engine`, or a server over HTTP.

Both backends offer the same four operations the interpreter needs — ``generate`` (one
completion, optionally streamed), ``prefill`` (a prefill-only request: the frontend hint
that puts a shared prefix into the radix tree before the branches arrive), ``select``
(score choices by prompt logprobs) and ``chat_format`` (role-block text) — and both are
safe to call from many program threads at once, because forks and ``run_batch`` issue
requests concurrently and the runtime only batches what arrives together.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from radixserve.protocol.native import ServedModelInfo
from radixserve.lang.chat import ChatFormat, engine_renderer, refusing_renderer, template_renderer
from radixserve.lang.ir import GenParams

DeltaFn = Callable[[str], None]


@dataclass
class GenResult:
    """One finished completion, as the interpreter stores it in ``s.get_meta_info(name)``."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class SelectResult:
    """Outcome of a ``select``: the winner and every choice's scores (same order as choices)."""

    choice: str
    index: int
    normalized_logprobs: list[float]  # mean logprob of each choice's tokens
    sum_logprobs: list[float]
    token_logprobs: list[list[float]]  # per choice, the logprob of each of its tokens
    cached_tokens: list[int] = field(default_factory=list)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pick_choice(choices: list[str], token_lps: list[list[float]], method: str,
                cached: list[int] | None = None) -> SelectResult:
    """Score each choice from its tokens' logprobs; ties go to the earlier choice. A choice whose
    text added no scorable token (cannot happen for non-empty choices after a non-empty prefix)
    scores ``-inf`` rather than a misleading 0."""
    sums = [sum(lps) if lps else -math.inf for lps in token_lps]
    norms = [sum(lps) / len(lps) if lps else -math.inf for lps in token_lps]
    scores = norms if method == "token_length_normalized" else sums
    best = max(range(len(choices)), key=lambda i: (scores[i], -i))
    return SelectResult(choices[best], best, norms, sums, token_lps, list(cached or []))


class Backend:
    """Interface of a program backend (subclass and implement the four operations)."""

    chat_format: ChatFormat

    def generate(self, prompt: str, params: GenParams, on_delta: DeltaFn | None = None) -> GenResult:
        raise NotImplementedError

    def prefill(self, prompt: str) -> GenResult:
        """Prefill-only request (max_tokens 0): the frontend hint."""
        raise NotImplementedError

    def select(self, prefix: str, choices: list[str], method: str, hint: bool) -> SelectResult:
        raise NotImplementedError

    def flush_cache(self) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def no_template_reason(model: str, remedy: str) -> str:
    return (f"{model} ships no chat template (a base model: it completes text and was never trained on "
            f"chat turns), so role blocks (system/user/assistant) cannot be rendered; {remedy}")


class EngineBackend(Backend):
    """Runs programs on an in-process :class:`~radixserve.Engine`. A program with forks issues
    requests from several threads, and the runtime only batches what arrives together, so the
    engine's core runs its loop on a thread of its own (the loop of the engine-core process,
    ``engine/loop.py``) and this backend talks to it through a blocking client: requests that arrive
    while a step runs join the next batch, which is how concurrent fork branches get batched together."""

    def __init__(self, engine: Any = None, chat_template: str | None = None, **engine_kwargs: Any):
        from radixserve.chat_template import load_chat_template
        from radixserve.engine.sync_client import SyncEngineClient
        from radixserve.engine.engine import Engine
        from radixserve.engine.launch import start_core_thread

        if engine is None or isinstance(engine, str):
            engine = Engine(engine or "smollm2-135m", **engine_kwargs)
        elif engine_kwargs:
            raise ValueError("engine options are only accepted together with a model name")
        self.engine = engine
        self.tokenizer = tok = engine.tokenizer
        # Role blocks use ``chat_template`` (a Jinja file or the text) when given, else the
        # model's own template; a model that ships none gets no stand-in (as the server).
        if chat_template:
            render = template_renderer(load_chat_template(chat_template), tok.bos_token or "", tok.eos_token or "")
        elif tok.chat_template_builtin:
            render = refusing_renderer(no_template_reason(engine.config.model, "pass chat_template=... to "
                                                          "EngineBackend"))
        else:
            render = engine_renderer(tok)
        self.chat_format = ChatFormat(render)
        self.client = SyncEngineClient(start_core_thread(engine.core), engine.tokenizer)
        self._closed = False

    def _submit(self, prompt: Any, params: Any, on_delta: DeltaFn | None = None) -> Future:
        from radixserve.engine.client import Submission

        if self._closed:
            raise RuntimeError("the engine backend is closed")
        ids = self.engine.encode(prompt)
        self.engine.core.validate(ids, params)  # bad input fails here, in the caller's thread
        self.engine.core.check_grammar(params)  # so does a grammar that cannot compile
        return self.client.submit(Submission(uuid.uuid4().hex, ids, params), on_delta)

    def _wait(self, fut: Future) -> Any:
        o = fut.result()
        if o.error or o.finish_reason == "abort":
            raise RuntimeError(f"request failed: {o.error or o.finish_reason}")
        return o

    def call(self, method: str, **args: Any) -> Any:
        """Run an engine utility ("stats", "flush_cache", "check_integrity") between steps."""
        if self._closed:
            raise RuntimeError("the engine backend is closed")
        return self.client.call(method, **args)

    @staticmethod
    def _result(o: Any) -> GenResult:
        return GenResult(o.text, o.prompt_tokens, len(o.token_ids), o.cached_tokens, o.finish_reason)

    def generate(self, prompt: str, params: GenParams, on_delta: DeltaFn | None = None) -> GenResult:
        from radixserve.sampling_params import SamplingParams

        sampling = SamplingParams(**params.to_dict())  # GenParams' fields are SamplingParams' names
        return self._result(self._wait(self._submit(prompt, sampling, on_delta)))

    def prefill(self, prompt: str | Sequence[int]) -> GenResult:
        from radixserve.sampling_params import SamplingParams

        return self._result(self._wait(self._submit(prompt, SamplingParams(max_tokens=0, temperature=0))))

    def select(self, prefix: str, choices: list[str], method: str, hint: bool) -> SelectResult:
        """Score ``prefix + choice`` for every choice in one batch of prefill-only requests. The
        choice's tokens are those after the common prefix of ``encode(prefix)`` and
        ``encode(prefix + choice)`` (a merge across the boundary moves the split left, so the
        merged token counts for the choice)."""
        from radixserve.sampling_params import SamplingParams

        # Raw text, as _submit's engine.encode sees it (BOS first where the model wants it).
        prefix_ids = self.tokenizer.encode_prompt(prefix) if prefix else []
        if hint and prefix_ids:
            self.prefill(prefix_ids)
        futs = []
        for c in choices:
            ids = self.tokenizer.encode_prompt(prefix + c)
            start = min(common_prefix_len(prefix_ids, ids), len(ids) - 1)
            futs.append(self._submit(ids, SamplingParams(max_tokens=0, temperature=0, logprob_start_len=start)))
        token_lps: list[list[float]] = []
        cached: list[int] = []
        for f in futs:
            o = self._wait(f)
            token_lps.append([lp for _, lp in (o.prompt_logprobs or []) if lp is not None])
            cached.append(o.cached_tokens)
        return pick_choice(choices, token_lps, method, cached)

    def flush_cache(self) -> bool:
        return bool(self.call("flush_cache"))

    def stats(self) -> dict[str, Any]:
        return dict(self.call("stats"))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.close()


class RuntimeEndpoint(Backend):
    """A running radixserve (or SGLang) server, over its native ``/generate`` API. Construction
    contacts ``GET /get_model_info`` so a wrong URL fails at once, with a ``ConnectionError`` that
    names it, instead of inside the first program. The chat template comes from
    ``chat_template=...``, else from the server's model info (``chat_template``: the one its chat
    API renders); a radixserve server reporting none (a base model) makes role blocks fail, a server
    that does not report one gets ChatML."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 chat_template: str | None = None, max_workers: int = 32):
        import httpx

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers,
                                    limits=httpx.Limits(max_connections=max_workers))
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="radixserve-lang-http")
        self.model_info = ServedModelInfo.parse(self._request("GET", "/get_model_info"))
        template = chat_template or self.model_info.chat_template
        if template is None and self.model_info.chat_template_builtin:
            name = self.model_info.served_model_name or self.base_url
            self.chat_format = ChatFormat(refusing_renderer(no_template_reason(
                name, "pass chat_template=... to RuntimeEndpoint or start the server with --chat-template")))
        else:
            self.chat_format = ChatFormat(template_renderer(template))

    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        import httpx

        try:
            r = self._client.request(method, path, json=body)
        except httpx.TransportError as e:
            raise ConnectionError(f"cannot reach the radixserve server at {self.base_url} ({e!r})") from e
        if r.status_code >= 400:
            raise RuntimeError(f"{self.base_url}{path} returned HTTP {r.status_code}: {r.text[:500]}")
        try:
            return r.json()
        except ValueError as e:
            raise RuntimeError(f"{self.base_url}{path} returned a non-JSON body: {r.text[:200]!r}") from e

    @staticmethod
    def _sampling(p: GenParams) -> dict[str, Any]:
        d = p.to_dict()
        if "max_tokens" in d:
            d["max_new_tokens"] = d.pop("max_tokens")
        return d

    @staticmethod
    def _result(d: dict[str, Any]) -> GenResult:
        m = d.get("meta_info", {})
        fr = m.get("finish_reason")
        if isinstance(fr, dict):  # SGLang reports {"type": "stop", "matched": ...}
            fr = fr.get("type")
        return GenResult(d.get("text", ""), int(m.get("prompt_tokens", 0)), int(m.get("completion_tokens", 0)),
                         int(m.get("cached_tokens", 0)), fr)

    def generate(self, prompt: str, params: GenParams, on_delta: DeltaFn | None = None) -> GenResult:
        body = {"text": prompt, "sampling_params": self._sampling(params)}
        if on_delta is None:
            return self._result(self._request("POST", "/generate", body))
        return self._stream(body, on_delta)

    def _stream(self, body: dict[str, Any], on_delta: DeltaFn) -> GenResult:
        """SSE streaming (``data: {...}`` chunks with cumulative text, SGLang's format); a
        server that answers with plain JSON is handled too (one chunk)."""
        import httpx

        body = {**body, "stream": True}
        last: dict[str, Any] = {}
        sent = ""
        try:
            with self._client.stream("POST", "/generate", json=body) as r:
                if r.status_code >= 400:
                    r.read()
                    raise RuntimeError(f"{self.base_url}/generate returned HTTP {r.status_code}: {r.text[:500]}")
                if "text/event-stream" not in r.headers.get("content-type", ""):
                    r.read()
                    last = r.json()
                else:
                    for line in r.iter_lines():
                        if not line.startswith("data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == "[DONE]":
                            break
                        last = json.loads(payload)
                        text = last.get("text", "")
                        if text.startswith(sent) and len(text) > len(sent):
                            on_delta(text[len(sent):])
                            sent = text
        except httpx.TransportError as e:
            raise ConnectionError(f"cannot reach the radixserve server at {self.base_url} ({e!r})") from e
        res = self._result(last)
        if res.text.startswith(sent) and len(res.text) > len(sent):
            on_delta(res.text[len(sent):])
        return res

    def prefill(self, prompt: str) -> GenResult:
        return self._result(self._request("POST", "/generate", {
            "text": prompt, "sampling_params": {"max_new_tokens": 0, "temperature": 0}}))

    def select(self, prefix: str, choices: list[str], method: str, hint: bool) -> SelectResult:
        """Score choices with prompt logprobs from the server, without a local tokenizer.

        The client cannot tokenize, so it learns the prefix's token count P from a prefill-only
        request for the prefix (so over HTTP that request is always sent: it doubles as the
        hint), then asks for the logprobs of ``prefix`` and of every ``prefix + choice`` from
        position ``P - window`` on. The token ids in those answers give the exact boundary
        (common prefix); the window widens if a merge reached further back. Only the window is
        recomputed: the rest of the prefix comes from the cache."""
        P = self.prefill(prefix).prompt_tokens if prefix else 0
        window = 8
        while True:
            start = max(P - window, 0)

            def score(text: str) -> dict[str, Any]:
                return self._request("POST", "/generate", {
                    "text": text, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                    "return_logprob": True, "logprob_start_len": start})

            futs = [self._pool.submit(score, prefix + c) for c in choices]
            tail = [int(e[1]) for e in score(prefix)["meta_info"]["input_token_logprobs"]] if prefix else []
            answers = [f.result() for f in futs]
            token_lps: list[list[float]] = []
            cached: list[int] = []
            retry = False
            for a in answers:
                entries = a["meta_info"]["input_token_logprobs"]
                k = common_prefix_len(tail, [int(e[1]) for e in entries])
                if k == 0 and start > 0:
                    retry = True
                    break
                k = min(k, len(entries) - 1)
                token_lps.append([float(e[0]) for e in entries[k:] if e[0] is not None])
                cached.append(int(a["meta_info"].get("cached_tokens", 0)))
            if not retry:
                return pick_choice(choices, token_lps, method, cached)
            window *= 4

    def flush_cache(self) -> bool:
        import httpx

        try:
            r = self._client.post("/flush_cache")
        except httpx.TransportError as e:
            raise ConnectionError(f"cannot reach the radixserve server at {self.base_url} ({e!r})") from e
        return r.status_code < 400

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._client.close()
