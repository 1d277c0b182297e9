"""OpenAI API: ``/v1/completions``, ``/v1/chat/completions`` (SSE, n > 1, logprobs), ``/v1/models``.

Each handler runs the shared steps (:mod:`radixserve.server.pipeline`): the body's rules
(``protocol/``), tokenization or the chat template, the choices submitted, and the answer
written by a renderer (:mod:`radixserve.server.openai_render`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from radixserve.protocol.openai import ChatCompletionRequest, CompletionRequest
from radixserve.protocol.tool_plan import ToolPlan
from radixserve.server.context import ServerContext
from radixserve.server.openai_render import ChatRender, CompletionRender
from radixserve.server.pipeline import Choices
from radixserve.server.session_ids import request_session_id

__all__ = ["OpenAIRoutes"]


class OpenAIRoutes:
    """The OpenAI-compatible handlers of one server."""

    def __init__(self, srv: ServerContext):
        self.srv = srv

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/v1/models", self.list_models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])

    async def list_models(self) -> dict[str, Any]:
        srv = self.srv
        return {"object": "list", "data": [{
            "id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "radixserve",
            "root": srv.engine_model, "max_model_len": srv.max_context_len,
        }]}

    def _check(self, body: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> None:
        self.srv.check_ready()
        self.srv.check_model(body.model)
        body.check_limits(self.srv.limits, num_prompts)

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        srv = self.srv
        prompts = body.prompts()
        self._check(body, len(prompts))
        session = request_session_id(request, body.session_id)
        prediction = await srv.encode_prediction(body.prediction)
        params = [body.sampling_params(seed_offset=j, prediction=prediction) for j in range(body.n)]
        await srv.check_grammars(params, body.grammar_field())
        choices = Choices()
        for prompt in prompts:
            ids = await srv.encode(prompt, "prompt")
            if srv.vision is not None:  # no images here: "<image>" in the text cannot be served
                srv.vision.check_placeholders(ids, 0, "prompt")
            for p in params:
                choices.add(ids, p, srv.label(prompt), session_id=session)
        streams = srv.submit(request, choices, body.cache_salt, "cmpl-")
        return await srv.respond(CompletionRender(srv, body, streams, prompts), streams, request, body.stream)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        srv = self.srv
        self._check(body, 1)
        session = request_session_id(request, body.session_id)
        refs = body.image_refs()
        srv.check_images(refs, "messages")
        plan = body.tool_plan()
        msgs, ids, prompt_len = await self._chat_prompt(body, plan, len(refs))
        max_tokens = body.max_tokens_for(prompt_len, srv.max_context_len)
        prediction = await srv.encode_prediction(body.prediction)
        params = [body.sampling_params(max_tokens, seed_offset=j, plan=plan, prediction=prediction)
                  for j in range(body.n)]
        await srv.check_grammars(params, "tools" if plan is not None and plan.grammar else body.grammar_field())
        images = await srv.load_images(refs, "messages")
        choices = Choices()
        for p in params:
            choices.add(ids, p, srv.label(msgs[-1].get("content", "")), images, session_id=session)
        streams = srv.submit(request, choices, body.cache_salt, "chatcmpl-")
        return await srv.respond(ChatRender(srv, body, streams, plan), streams, request, body.stream)

    async def _chat_prompt(self, body: ChatCompletionRequest, plan: ToolPlan | None,
                           num_images: int) -> tuple[list[dict[str, Any]], list[int], int]:
        """The messages as the template sees them, the prompt's ids, and its length once
        the core expanded the image placeholders."""
        srv = self.srv
        vision = srv.vision
        msgs = body.template_messages(vision.image_token if vision is not None else None)
        text = await srv.chat_prompt(msgs, body.add_generation_prompt and not body.continue_final_message,
                                     tools=plan.openai_tools() if plan is not None else None)
        ids = await srv.encode(text, "messages", chat=True)
        if vision is None:
            return msgs, ids, len(ids)
        # Also without images: "<image>" typed as text would be a placeholder.
        vision.check_placeholders(ids, num_images, "messages")
        return msgs, ids, vision.prompt_len(ids, num_images)
