"""The routes around generation: models, liveness and readiness, version, tokenize/detokenize,
metrics. Shapes follow vLLM's server (`vllm/entrypoints/serve/*`, `openai/models`)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.gateway.errors import ApiError, bad_request, read_json
from services.gateway.metrics import CONTENT_TYPE
from services.gateway.protocol import _Body, parse_messages
from services.gateway.service import GatewayService
from services.gateway.tokenizer import PromptError, refuse_unfit_prompt


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
        body = _Body(await read_json(request))
        self.check_model(body.string("model"))
        tokenizer = self.service.tokenizer
        try:
            if body.raw("messages") is not None:
                if body.boolean("add_generation_prompt", True) and body.boolean("continue_final_message"):
                    raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
                messages = parse_messages(body.raw("messages"))
                refuse_unfit_prompt(None, messages, tokenizer, self.service.max_model_len, "messages")
                ids = await tokenizer.apply_chat_template_async(
                    messages, body.boolean("add_generation_prompt", True), body.boolean("continue_final_message"))
            else:
                prompt = body.string("prompt")
                if prompt is None:
                    raise bad_request("`prompt` (a string) or `messages` is required", "prompt")
                refuse_unfit_prompt(prompt, None, tokenizer, self.service.max_model_len, "prompt")
                ids = await tokenizer.encode_async(prompt, body.boolean("add_special_tokens", True))
        except PromptError as exc:
            raise bad_request(str(exc), "messages") from None
        strs = tokenizer.token_strings(ids) if body.boolean("return_token_strs") else None
        return JSONResponse({"count": len(ids), "max_model_len": self.service.max_model_len, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: {tokens} → {prompt}."""
        body = _Body(await read_json(request))
        self.check_model(body.string("model"))
        tokens = body.raw("tokens")
        vocab = self.service.tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad_request("`tokens` must be a list of integers", "tokens")
        if any(not 0 <= t < vocab for t in tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return JSONResponse({"prompt": self.service.tokenizer.decode(tokens)})
