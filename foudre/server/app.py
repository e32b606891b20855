"""The FastAPI application: routes, authentication and OpenAI-shaped errors.

Every error, ours or unexpected, leaves as ``{"error": {"message", "type", "param", "code"}}``
with a meaningful status: 400 bad request (never 422), 401 bad key, 404 unknown model or route,
503 overloaded (with ``Retry-After``), 500 anything else; on Anthropic's /v1/messages routes
as ``{"type": "error", "error": {"type", "message"}}``. The server never dies of a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from foudre.engine.async_llm import AsyncLLM
from foudre.metrics.prometheus import CONTENT_TYPE, PrometheusMetrics
from foudre.native import huge_pages
from foudre.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeRequest,
    TokenizeResponse,
)
from foudre.server.protocol_anthropic import (
    AnthropicError,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
)
from foudre.server.protocol_responses import DeletedResponse, ResponseObject, ResponsesRequest
from foudre.server.reasoning import choose_reasoning_parser
from foudre.server.serving import DEFAULT_MAX_N, OpenAIServing
from foudre.server.serving_chat import OpenAIServingChat
from foudre.server.serving_completions import OpenAIServingCompletions
from foudre.server.serving_messages import AnthropicServingMessages
from foudre.server.serving_responses import (
    DEFAULT_STORE_BYTES,
    DEFAULT_STORE_SIZE,
    OpenAIServingResponses,
    ResponseStore,
)
from foudre.server.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("foudre.server")

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces
ANTHROPIC_ROUTES = "/v1/messages"  # this path and those under it answer in Anthropic's shape


def _error_response(err: OpenAIError, path: str = "") -> JSONResponse:
    """``err`` as a response, in the shape of the API that ``path`` belongs to."""
    err = _shaped_for(path, err)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _shaped_for(path: str, err: OpenAIError) -> OpenAIError:
    """``err`` in the shape its route's clients read: Anthropic's on /v1/messages and below
    (an unknown model, a wrong method, a malformed body, a server error alike), OpenAI's
    elsewhere."""
    if path == ANTHROPIC_ROUTES or path.startswith(ANTHROPIC_ROUTES + "/"):
        return AnthropicError.of(err)
    return err


def _validation_error(errors: list[Any]) -> OpenAIError:
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg"))
    return OpenAIError(400, message, param=param)


def check_json(data: Any) -> None:
    """400 for a body nested deeper than ``MAX_JSON_DEPTH`` or with a lone UTF-16 surrogate in
    any string (not valid Unicode: no tokenizer or response could carry it); ``param`` names
    the top-level field. Iterative: a deep body costs no recursion."""
    stack: list[tuple[Any, int, str | None]] = [(data, 1, None)]
    while stack:
        obj, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise OpenAIError(
                400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels", param=field
            )
        if isinstance(obj, dict):
            for key, value in obj.items():
                if _SURROGATE.search(key):
                    raise OpenAIError(400, "a JSON key contains a lone surrogate", param=field)
                stack.append((value, depth + 1, key if field is None else field))
        elif isinstance(obj, list):
            stack.extend((value, depth + 1, field) for value in obj)
        elif isinstance(obj, str) and _SURROGATE.search(obj):
            where = field or "body"
            raise OpenAIError(
                400,
                f"{where}: text contains a lone surrogate and is not valid Unicode",
                param=field,
            )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 past ``max_bytes`` (before reading it all when the
    client announces its length)."""
    announced = request.headers.get("content-length", "")
    if announced.isdigit() and int(announced) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:  # nobody will read the answer; not a server error
        raise OpenAIError(400, "the client disconnected while sending its request") from None
    return b"".join(chunks)


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")


async def parse_body(request: Request, model: type[M], max_bytes: int) -> M:
    """The JSON body validated as ``model``; 413 when too large, 400 for malformed JSON,
    nesting, lone surrogates or invalid fields."""
    raw = await read_body(request, max_bytes)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise OpenAIError(
            400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels"
        ) from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    check_json(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(list(e.errors())) from None


class _RequestId:
    """``X-Request-Id``: the client's (printable, at most 128 characters) or a new one, kept in
    ``request.state.request_id`` for logs and sent back on every response, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", ())).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


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
            rid = scope.get("state", {}).get("request_id")
            logger.exception("unexpected error on %s (request %s)", scope.get("path"), rid)
            if started:
                return
            err = OpenAIError(
                500,
                f"internal error (request {rid}): {type(exc).__name__}: {exc}",
                type="internal_server_error",
            )
            await _error_response(err, scope.get("path", ""))(scope, receive, send)


def build_app(
    llm: AsyncLLM,
    served_model_name: str,
    api_key: str | None = None,
    shutdown_engine: bool = True,
    max_n: int = DEFAULT_MAX_N,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    request_timeout: float | None = None,
    tool_call_parser: str | None = None,
    responses_store_size: int = DEFAULT_STORE_SIZE,
    responses_store_bytes: int = DEFAULT_STORE_BYTES,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``llm``.

    ``api_key``: when set, /v1/*, /tokenize and /detokenize require ``Authorization: Bearer
    <key>`` or ``x-api-key: <key>`` (/health and /metrics stay open). ``shutdown_engine``: stop
    ``llm`` when the app's lifespan ends. ``max_n``: most choices per request;
    ``max_request_bytes``: larger bodies get 413; ``request_timeout``: seconds before a request
    is aborted (408 or an error event);
    ``tool_call_parser``: how tool calls are read with ``tool_choice`` "auto" (None: detected);
    ``responses_store_size``, ``responses_store_bytes``: most responses, and most bytes of
    them, that /v1/responses keeps (least recently used evicted).
    ``reasoning_parser``: how chat outputs are split into reasoning and answer
    (``reasoning.REASONING_PARSERS``; "none": not split; None: detected from the chat
    template). ``ValueError`` for an unknown name.
    """
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be positive, got {max_request_bytes}")
    template = llm.tokenizer.chat_template if llm.tokenizer is not None else None
    reasoning, why = choose_reasoning_parser(reasoning_parser, template)
    (logger.warning if why.startswith("off:") else logger.info)("reasoning parser: %s", why)
    serving = OpenAIServing(
        llm,
        served_model_name,
        max_n,
        request_timeout,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning,
    )
    prometheus = PrometheusMetrics(llm.metrics)
    llm.add_observer(prometheus.observe)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        huge_pages.promote_later()  # the weights into 2 MiB pages while no request waits
        yield
        serving.workers.close()
        if shutdown_engine:
            await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="foudre", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.llm = llm
    app.state.serving = serving
    app.state.prometheus = prometheus
    app.state.reasoning_parser = why
    _add_error_handlers(app)
    app.add_middleware(_CatchAll)
    app.add_middleware(_RequestId)  # outermost: 500s from _CatchAll carry the id too
    auth = [Depends(_authenticator(api_key))]
    _add_generation_routes(app, serving, auth, max_request_bytes)
    store = ResponseStore(responses_store_size, responses_store_bytes)
    _add_responses_routes(app, serving, auth, max_request_bytes, store)
    _add_messages_routes(
        app, serving, [Depends(_authenticator(api_key, AnthropicError))], max_request_bytes
    )
    _add_model_routes(app, serving, prometheus, auth)
    _add_tokenization_routes(app, serving, auth, max_request_bytes)
    _declare_schemas(app, _REQUEST_BODIES, _RESPONSE_BODIES)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, raised by a route or by FastAPI itself, in the shape of its route's API
    (``_shaped_for``)."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(list(exc.errors())), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers) if exc.headers else None
        err = OpenAIError(exc.status_code, str(exc.detail), type=kind, headers=headers)
        return _error_response(err, request.url.path)


def _authenticator(
    api_key: str | None, error: type[OpenAIError] = OpenAIError
) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: 401 (an ``error``) unless the request carries ``Authorization:
    Bearer <api_key>`` or ``x-api-key: <api_key>`` (Anthropic's clients send the latter);
    every request passes when ``api_key`` is None."""

    async def authenticate(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise error(
                401,
                "invalid or missing API key; send 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>'",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    return authenticate


def _respond(result: dict[str, Any] | AsyncIterator[str]) -> Response:
    """A JSON body, or an SSE stream."""
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(
        result,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _add_generation_routes(
    app: FastAPI, serving: OpenAIServing, auth: list[Any], max_bytes: int
) -> None:
    """/v1/completions and /v1/chat/completions."""
    completion = OpenAIServingCompletions(serving)
    chat = OpenAIServingChat(serving)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest, max_bytes)
        return _respond(await completion.create(req, request.receive))

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest, max_bytes)
        return _respond(await chat.create(req, request.receive))


def _add_responses_routes(
    app: FastAPI, serving: OpenAIServing, auth: list[Any], max_bytes: int, store: ResponseStore
) -> None:
    """/v1/responses, and GET and DELETE /v1/responses/{response_id}."""
    responses = OpenAIServingResponses(OpenAIServingChat(serving), store)

    @app.post("/v1/responses", dependencies=auth)
    async def create_response(request: Request) -> Response:
        req = await parse_body(request, ResponsesRequest, max_bytes)
        return _respond(await responses.create(req, request.receive))

    @app.get("/v1/responses/{response_id}", dependencies=auth)
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}", dependencies=auth)
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)


def _add_messages_routes(
    app: FastAPI, serving: OpenAIServing, auth: list[Any], max_bytes: int
) -> None:
    """Anthropic's /v1/messages and /v1/messages/count_tokens (their errors, and those of any
    path under /v1/messages, in Anthropic's shape: ``_shaped_for``)."""
    messages = AnthropicServingMessages(OpenAIServingChat(serving))

    @app.post("/v1/messages", dependencies=auth)
    async def create_message(request: Request) -> Response:
        req = await parse_body(request, MessagesRequest, max_bytes)
        return _respond(await messages.create(req, request.receive))

    @app.post("/v1/messages/count_tokens", dependencies=auth)
    async def count_message_tokens(request: Request) -> dict[str, Any]:
        req = await parse_body(request, CountTokensRequest, max_bytes)
        return await messages.count_tokens(req)


def _add_model_routes(
    app: FastAPI, serving: OpenAIServing, prometheus: PrometheusMetrics, auth: list[Any]
) -> None:
    """/v1/models and /v1/models/{id} (authenticated); /health and /metrics (open)."""
    llm = serving.llm
    created = int(time.time())

    card = {
        "id": serving.model_name,
        "object": "model",
        "created": created,
        "owned_by": "foudre",
        "root": llm.engine.model_name,
        "max_model_len": llm.max_model_len,
    }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id)  # 404 model_not_found for any other id
        return card

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_running:
            return _error_response(
                OpenAIError(
                    503, "the engine is not running or cannot step", type="service_unavailable"
                )
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prometheus.render(), media_type=CONTENT_TYPE)


def _add_tokenization_routes(
    app: FastAPI, serving: OpenAIServing, auth: list[Any], max_bytes: int
) -> None:
    """/tokenize and /detokenize."""
    tokenization = OpenAIServingTokenization(serving)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await parse_body(request, TokenizeRequest, max_bytes)
        return await tokenization.tokenize(req)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await parse_body(request, DetokenizeRequest, max_bytes)
        return await tokenization.detokenize(req)


# the bodies the OpenAPI schema declares (the routes parse their own: see _declare_schemas)
_REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}
_RESPONSE_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/completions", "post"): CompletionResponse,
    ("/v1/chat/completions", "post"): ChatCompletionResponse,
    ("/tokenize", "post"): TokenizeResponse,
    ("/detokenize", "post"): DetokenizeResponse,
    ("/v1/models", "get"): ModelList,
    ("/v1/models/{model_id}", "get"): ModelCard,
    ("/health", "get"): HealthResponse,
    ("/v1/responses", "post"): ResponseObject,
    ("/v1/responses/{response_id}", "get"): ResponseObject,
    ("/v1/responses/{response_id}", "delete"): DeletedResponse,
    ("/v1/messages", "post"): MessagesResponse,
    ("/v1/messages/count_tokens", "post"): CountTokensResponse,
}


def _declare_schemas(
    app: FastAPI,
    requests: dict[str, type[BaseModel]],
    responses: dict[tuple[str, str], type[BaseModel]],
) -> None:
    """Declare the request and response bodies in the served OpenAPI schema (the routes parse
    their bodies themselves, to bound their size and depth, so FastAPI cannot see them)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        models: list[tuple[type[BaseModel], Any]] = [(m, "validation") for m in requests.values()]
        shown: list[type[BaseModel]] = [*responses.values(), ErrorResponse]
        models += [(m, "serialization") for m in shown]
        _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.get("$defs", {}))

        def ref(model: type[BaseModel]) -> dict[str, Any]:
            return {"$ref": f"#/components/schemas/{model.__name__}"}

        error = {
            "description": "an OpenAI-shaped error",
            "content": {"application/json": {"schema": ref(ErrorResponse)}},
        }
        for path, model in requests.items():
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref(model)}},
            }
        for (path, method), model in responses.items():
            content: dict[str, Any] = {"application/json": {"schema": ref(model)}}
            if path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
                content["text/event-stream"] = {"schema": {"type": "string"}}
            schema["paths"][path][method]["responses"] = {
                "200": {"description": "success", "content": content},
                "default": error,
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
