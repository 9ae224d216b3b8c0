"""The routes around generation: models, liveness and readiness, version, tokenize/detokenize,
metrics. Shapes follow vLLM's server (`vllm/entrypoints/serve/*`, `openai/models`)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.gateway.body_parsing import DetokenizeBody, Route, TokenizeBody
from services.gateway.errors import ApiError, bad_request
from services.gateway.metrics import CONTENT_TYPE
from services.gateway.service import GatewayService
from services.gateway.tokenizer import PromptError


def corral_version() -> str:
    try:
        return importlib.metadata.version("corral")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class InfoRoutes:
    def __init__(self, service: GatewayService) -> None:
        self.service = service
        self.config = service.config
        # Names a request's `model` may use: the served name, and the model directory as given or resolved.
        self.model_names = {self.config.model_name, self.config.model_dir, str(Path(self.config.model_dir).resolve())}

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.config.model_name, "object": "model", "created": self.service.started_at, "owned_by": "corral",
            "root": self.config.model_dir, "parent": None, "max_model_len": self.service.max_model_len,
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        """`client.models.retrieve(id)`: the card, or an OpenAI-shaped 404."""
        self.check_model(request.path_params["model"])
        return JSONResponse(self._card())

    def _state(self) -> dict[str, Any]:
        return {"gateway_id": self.config.gateway_id, "connected": self.service.connected,
                "instances": self.service.instances.alive_count()}

    async def health(self, request: Request) -> Response:
        """Liveness: 200 while the process serves HTTP, whatever the cluster behind it is doing
        (the body says what it is doing, for people)."""
        return JSONResponse({"status": "ok", **self._state()})

    async def ready(self, request: Request) -> Response:
        """Readiness: 200 only when connected to NATS with at least one live instance, so that a
        probe does not send traffic to a gateway that would answer every request with a 503."""
        body = self._state()
        instances = body["instances"]
        if not self.service.connected:
            return JSONResponse({"status": "not connected to NATS", **body}, status_code=503)
        if instances == 0:
            return JSONResponse({"status": "no live instance", **body}, status_code=503)
        return JSONResponse({"status": "ready", **body})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": corral_version()})

    async def metrics(self, request: Request) -> Response:
        return Response(self.service.metrics.render(), media_type=CONTENT_TYPE)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a completion prompt or chat messages → {count, max_model_len, tokens, token_strs}.
        A prompt too large to fit the context is refused before it is tokenized (its answer, a
        list of every token, would cost the event loop as much as its tokenization)."""
        body = await self._body(request, Route.TOKENIZE)
        assert isinstance(body, TokenizeBody)
        tokenizer = self.service.tokenizer
        try:
            if body.messages is not None:
                ids = await tokenizer.apply_chat_template_async(body.messages, body.add_generation_prompt,
                                                                body.continue_final_message)
            else:
                assert body.prompt is not None
                ids = await tokenizer.encode_async(body.prompt, body.add_special_tokens)
        except PromptError as exc:
            raise bad_request(str(exc), "messages") from None
        strs = tokenizer.token_strings(ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.service.max_model_len, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: {tokens} → {prompt}."""
        body = await self._body(request, Route.DETOKENIZE)
        assert isinstance(body, DetokenizeBody)
        return JSONResponse({"prompt": await self.service.tokenizer.decode_async(body.tokens)})

    async def _body(self, request: Request, route: Route) -> TokenizeBody | DetokenizeBody:
        """The route's typed body (parsed off the event loop when large); its model checked
        first, then what body_parsing refused (as the checks ran in that order inline)."""
        body = await self.service.body_workers.parse(route, await request.body(), self.service.model_limits())
        assert isinstance(body, (TokenizeBody, DetokenizeBody))
        self.check_model(body.model)
        if body.refusal is not None:
            raise body.refusal.error()
        return body
