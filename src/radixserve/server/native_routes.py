"""SGLang's native generation API: ``/generate`` (text or token ids, batches, streaming,
logprobs), shaped so that SGLang's frontend (``RuntimeEndpoint``) and SGLang's router work
unchanged. The operational routes are in :mod:`radixserve.server.ops_routes`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from radixserve.images import ImageInput
from radixserve.protocol.native import GenerateRequest, NativeItem
from radixserve.server.context import ServerContext
from radixserve.server.native_render import GenerateRender
from radixserve.server.pipeline import Choices
from radixserve.server.session_ids import request_session_id

__all__ = ["NativeRoutes"]


class NativeRoutes:
    """``/generate`` of one server."""

    def __init__(self, srv: ServerContext):
        self.srv = srv

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/generate", self.generate, methods=["POST"])

    async def generate(self, body: GenerateRequest, request: Request) -> Any:
        srv = self.srv
        srv.check_ready()
        srv.check_model(body.model)
        items = body.items(srv.limits)
        refs = body.image_refs(len(items))
        srv.check_images([r for item_refs in refs for r in item_refs], "image_data")
        choices, want_logprobs = Choices(), []
        for item in items:
            ids, images = await self._prompt(body, item, refs[item.index])
            sid = request_session_id(request, item.session_id, "session_params.id")
            for j in range(item.n):
                params = item.sampling_params(len(ids), j, srv.model.vocab_size)
                choices.add(ids, params, srv.label(item.prompt), images, item.rid if item.n == 1 else None, sid)
                want_logprobs.append(item.return_logprob)
        await srv.check_grammars([p for _, p in choices.items], prefix="sampling_params.")
        streams = srv.submit(request, choices, body.cache_salt, "gen-")
        names = [c or s.rid for c, s in zip(choices.client_rids, streams)]
        render = GenerateRender(srv.texts, streams, names, want_logprobs, body.return_text_in_logprobs,
                                body.is_batch(), srv.cfg.hide_cached_tokens)
        return await srv.respond(render, streams, request, body.stream)

    async def _prompt(self, body: GenerateRequest, item: NativeItem,
                      refs: list[tuple[str, str]]) -> tuple[list[int], list[ImageInput]]:
        """One prompt's ids (its image placeholders checked) and its images."""
        srv = self.srv
        field = "text" if body.text is not None else "input_ids"
        ids = await srv.encode(item.prompt, field)
        if srv.vision is not None:
            srv.vision.check_placeholders(ids, len(refs), f"{field}[{item.index}]" if body.is_batch() else field)
        return ids, await srv.load_images(refs, "image_data")
