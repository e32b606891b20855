"""The FastAPI application: routes, authentication and OpenAI-shaped errors.

Every error, ours or unexpected, leaves as ``{"error": {"message", "type", "param", "code"}}``
with a meaningful status: 400 bad request (never 422), 401 bad key, 404 unknown model or route,
503 overloaded (with ``Retry-After``), 500 anything else. The server never dies of a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from foudre.engine.async_llm import AsyncLLM
from foudre.metrics.prometheus import CONTENT_TYPE, PrometheusMetrics
from foudre.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
)
from foudre.server.serving import OpenAIServing

logger = logging.getLogger("foudre.server")

M = TypeVar("M", bound=BaseModel)


def _error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _validation_error(errors: list[Any]) -> OpenAIError:
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg"))
    return OpenAIError(400, message, param=param)


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body validated as ``model``; 400 for malformed JSON or invalid fields."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(list(e.errors())) from None


class _CatchAll:
    """Turn any exception that escapes a route into a 500 in the OpenAI shape (or, once a
    response has started, just log it): the connection is answered and the server lives on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unexpected error on %s", scope.get("path"))
            if started:
                return
            err = OpenAIError(
                500, f"internal error: {type(exc).__name__}: {exc}", type="internal_server_error"
            )
            await _error_response(err)(scope, receive, send)


def build_app(
    llm: AsyncLLM,
    served_model_name: str,
    api_key: str | None = None,
    shutdown_engine: bool = True,
) -> FastAPI:
    """The OpenAI-compatible app over ``llm``.

    ``api_key``: when set, /v1/*, /tokenize and /detokenize require ``Authorization: Bearer
    <key>`` (/health and /metrics stay open). ``shutdown_engine``: stop ``llm`` when the app's
    lifespan ends.
    """
    serving = OpenAIServing(llm, served_model_name)
    prometheus = PrometheusMetrics(llm.metrics)
    llm.add_observer(prometheus.observe)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if shutdown_engine:
            await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="foudre", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.llm = llm
    app.state.serving = serving
    app.state.prometheus = prometheus

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = OpenAIError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    app.add_middleware(_CatchAll)

    async def authenticate(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise OpenAIError(
                401,
                "invalid or missing API key; send 'Authorization: Bearer <key>'",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    auth = [Depends(authenticate)]

    def respond(result: dict[str, Any] | AsyncIterator[str]) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(
            result,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        return respond(await serving.completions(req, request.receive))

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        return respond(await serving.chat(req, request.receive))

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "foudre",
            "root": llm.engine.model_name,
            "max_model_len": llm.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_running:
            return _error_response(
                OpenAIError(503, "the engine is not running", type="service_unavailable")
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prometheus.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await parse_body(request, TokenizeRequest)
        serving.check_model(req.model)
        tok = serving.tokenizer
        if tok is None:
            raise OpenAIError(400, "this server has no tokenizer")
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                text = tok.apply_chat_template(msgs)
            except Exception as e:
                raise OpenAIError(400, f"cannot apply the chat template: {e}", "messages") from e
            has_bos = bool(tok.bos_token) and text.startswith(tok.bos_token or "")
            ids = await serving.encode(text, req.add_special_tokens and not has_bos)
        else:
            ids = await serving.encode(req.prompt or "", req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await parse_body(request, DetokenizeRequest)
        serving.check_model(req.model)
        tok = serving.tokenizer
        if tok is None:
            raise OpenAIError(400, "this server has no tokenizer")
        vocab = tok.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(
                400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens"
            )
        return {"prompt": tok.decode(req.tokens)}

    return app
