"""Completions and chat completions over ``AsyncLLM``: requests in, OpenAI-shaped dicts or SSE
streams out.

Text deltas come from the engine's detokenizer, which only releases valid UTF-8 and never a
partial stop string, so a stream never shows text that the final answer would not contain.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Receive

from foudre.engine.async_llm import (
    AsyncLLM,
    EngineStoppedError,
    Prompt,
    QueueFullError,
    RequestStream,
)
from foudre.errors import InvalidParameterError, PromptTooLongError
from foudre.outputs import CompletionOutput
from foudre.sampling_params import SamplingParams
from foudre.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    _SamplingFields,
)

Json = dict[str, Any]


def sse(obj: Json | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens of a step (the sampler gives the sampled one plus the top-n,
    so sorting and cutting drops the sampled one when it is not among them)."""
    if n <= 0:
        return []
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


async def _watch_disconnect(receive: Receive, stream: RequestStream) -> None:
    """Abort ``stream`` as soon as the client goes away (the body has been read already, so the
    next ASGI message can only be the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            stream.abort()
            return


@dataclass(slots=True)
class _Usage:
    """Token counts of a request: one prompt count per prompt, one output count per choice."""

    prompt: dict[int, int] = field(default_factory=dict)
    completion: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> Json:
        p, c = sum(self.prompt.values()), sum(self.completion.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class OpenAIServing:
    """The OpenAI endpoints' logic for one served model."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self.tokenizer = llm.tokenizer
        self._pieces: dict[int, str] = {}

    # -- shared helpers ------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def piece(self, token_id: int) -> str:
        """The text of one token, decoded on its own."""
        text = self._pieces.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"<{token_id}>"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._pieces[token_id] = text
        return text

    def sampling_params(
        self,
        req: _SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        rename: dict[str, str] | None = None,
    ) -> SamplingParams:
        """``SamplingParams`` of a request; an invalid value is a 400 naming its field."""

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        try:
            return SamplingParams(
                n=req.n,
                temperature=pick(req.temperature, 1.0),
                top_p=pick(req.top_p, 1.0),
                top_k=pick(req.top_k, 0),
                min_p=pick(req.min_p, 0.0),
                repetition_penalty=pick(req.repetition_penalty, 1.0),
                presence_penalty=pick(req.presence_penalty, 0.0),
                frequency_penalty=pick(req.frequency_penalty, 0.0),
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
            )
        except InvalidParameterError as e:
            param = (rename or {}).get(e.param, e.param)
            raise OpenAIError(400, str(e), param=param) from None

    async def submit(
        self, prompts: list[Prompt], params: SamplingParams, request_id: str, param: str
    ) -> RequestStream:
        try:
            return await self.llm.add_requests(prompts, params, request_id)
        except PromptTooLongError as e:
            raise OpenAIError(400, str(e), param=param, code="context_length_exceeded") from None
        except InvalidParameterError as e:
            name = param if e.param == "prompt" else e.param
            raise OpenAIError(400, str(e), param=name) from None
        except ValueError as e:  # text the tokenizer refuses
            raise OpenAIError(400, str(e), param=param) from None
        except QueueFullError as e:
            raise OpenAIError(
                503, str(e), type="server_overloaded", headers={"Retry-After": "1"}
            ) from None
        except EngineStoppedError as e:
            raise OpenAIError(503, str(e), type="service_unavailable") from None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, computed off the event loop."""
        tok = self.tokenizer
        if tok is None:
            raise OpenAIError(400, "this server has no tokenizer; send token ids")
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)

    async def collect(
        self, stream: RequestStream, receive: Receive, n: int
    ) -> tuple[dict[int, CompletionOutput], _Usage]:
        """Run ``stream`` to its end (aborting it if the client leaves); final outputs by choice
        index, and the usage (``n`` choices per prompt)."""
        finals: dict[int, CompletionOutput] = {}
        usage = _Usage()
        watcher = asyncio.create_task(_watch_disconnect(receive, stream))
        try:
            async for out in stream:
                if out.finished:
                    comp = out.outputs[0]
                    finals[comp.index] = comp
                    usage.completion[comp.index] = len(comp.token_ids)
                    usage.prompt[comp.index // n] = len(out.prompt_token_ids)
        except RuntimeError as e:  # the engine step failed
            raise OpenAIError(500, str(e), type="internal_server_error") from None
        finally:
            watcher.cancel()
            stream.abort()
        return finals, usage

    async def stream_sse(
        self,
        stream: RequestStream,
        receive: Receive,
        n: int,
        prelude: list[Json],
        chunk: Callable[[CompletionOutput], Json | None],
        usage_chunk: Callable[[Json], Json] | None,
    ) -> AsyncIterator[str]:
        """The SSE body: ``prelude``, one chunk per useful output, the usage chunk, ``[DONE]``.
        The request is aborted when the client disconnects or the body iterator is closed."""
        watcher = asyncio.create_task(_watch_disconnect(receive, stream))
        usage = _Usage()
        try:
            for obj in prelude:
                yield sse(obj)
            try:
                async for out in stream:
                    comp = out.outputs[0]
                    usage.completion[comp.index] = len(comp.token_ids)
                    usage.prompt[comp.index // n] = len(out.prompt_token_ids)
                    piece = chunk(comp)
                    if piece is not None:
                        yield sse(piece)
            except RuntimeError as e:
                yield sse(OpenAIError(500, str(e), type="internal_server_error").body())
            else:
                if usage_chunk is not None:
                    yield sse(usage_chunk(usage.as_dict()))
            yield sse("[DONE]")
        finally:
            watcher.cancel()
            stream.abort()

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(
        self, req: CompletionRequest, receive: Receive
    ) -> Json | AsyncIterator[str]:
        self.check_model(req.model)
        params = self.sampling_params(req, req.max_tokens, req.logprobs)
        raw = req.prompt
        items: list[str | list[int]]
        if isinstance(raw, str):
            items = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            items = [list(raw)]  # type: ignore[arg-type]
        else:
            items = list(raw)  # type: ignore[arg-type]
        if not items:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        prompts: list[Prompt] = []
        texts: list[str] = []
        for item in items:
            if isinstance(item, str):
                prompts.append(await self.encode(item) if self.tokenizer is not None else item)
                texts.append(item)
            else:
                prompts.append(list(item))
                texts.append(
                    self.tokenizer.decode(item) if req.echo and self.tokenizer is not None else ""
                )
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = await self.submit(prompts, params, rid, "prompt")
        n = params.n
        base: Json = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
        }
        want_lp = req.logprobs

        if not req.stream:
            finals, usage = await self.collect(stream, receive, params.n)
            choices = []
            for i in sorted(finals):
                comp = finals[i]
                prefix = texts[i // n] if req.echo else ""
                lp = None
                if want_lp is not None:
                    lp, _ = self._completion_logprobs(
                        comp.token_ids, comp.logprobs or [], want_lp, len(prefix)
                    )
                choices.append(
                    {
                        "index": i,
                        "text": prefix + comp.text,
                        "logprobs": lp,
                        "finish_reason": comp.finish_reason,
                        "stop_reason": comp.stop_reason,
                    }
                )
            return {**base, "choices": choices, "usage": usage.as_dict()}

        echoed: set[int] = set()
        offsets: dict[int, int] = {}

        def chunk(comp: CompletionOutput) -> Json | None:
            i = comp.index
            text = comp.delta_text
            if req.echo and i not in echoed:
                echoed.add(i)
                text = texts[i // n] + text
                offsets[i] = len(texts[i // n])
            lp = None
            if want_lp is not None and comp.delta_token_ids:
                k = len(comp.delta_token_ids)
                lp, offsets[i] = self._completion_logprobs(
                    comp.delta_token_ids, (comp.logprobs or [])[-k:], want_lp, offsets.get(i, 0)
                )
            if not text and lp is None and not comp.finished:
                return None
            choice = {
                "index": i,
                "text": text,
                "logprobs": lp,
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
            }
            return {**base, "choices": [choice]}

        def usage_chunk(usage: Json) -> Json:
            return {**base, "choices": [], "usage": usage}

        return self.stream_sse(
            stream, receive, n, [], chunk, usage_chunk if req.include_usage else None
        )

    def _completion_logprobs(
        self, token_ids: list[int], entries: list[dict[int, float]], top_n: int, offset: int
    ) -> tuple[Json, int]:
        """Legacy completions logprobs of ``token_ids``, text offsets starting at ``offset``;
        also returns the offset after the last token."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            text = self.piece(tid)
            tokens.append(text)
            token_logprobs.append(_finite(entry[tid]) if tid in entry else None)
            top_logprobs.append({self.piece(t): _finite(v) for t, v in _top(entry, top_n)})
            text_offset.append(offset)
            offset += len(text)
        lp = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }
        return lp, offset

    # -- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, receive: Receive) -> Json | AsyncIterator[str]:
        self.check_model(req.model)
        tok = self.tokenizer
        if tok is None:
            raise OpenAIError(400, "chat needs a tokenizer; this server has none")
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else (req.max_tokens)
        )
        params = self.sampling_params(req, max_tokens, top_n, rename={"logprobs": "top_logprobs"})
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            rendered = tok.apply_chat_template(messages, req.add_generation_prompt)
        except Exception as e:  # jinja2.TemplateError, or a template bug
            raise OpenAIError(400, f"cannot apply the chat template: {e}", "messages") from None
        bos = tok.bos_token
        has_bos = bool(bos) and rendered.startswith(bos or "")
        prompt_ids = await self.encode(rendered, add_special_tokens=not has_bos)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = await self.submit([prompt_ids], params, rid, "messages")
        base: Json = {"id": rid, "created": created, "model": self.model_name}

        if not req.stream:
            finals, usage = await self.collect(stream, receive, params.n)
            choices = []
            for i in sorted(finals):
                comp = finals[i]
                lp = None
                if top_n is not None:
                    lp = {
                        "content": self._chat_logprobs(comp.token_ids, comp.logprobs or [], top_n)
                    }
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": comp.text},
                        "logprobs": lp,
                        "finish_reason": comp.finish_reason,
                        "stop_reason": comp.stop_reason,
                    }
                )
            return {
                **base,
                "object": "chat.completion",
                "choices": choices,
                "usage": usage.as_dict(),
            }

        base = {**base, "object": "chat.completion.chunk"}
        prelude = [
            {
                **base,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for i in range(params.n)
        ]

        def chunk(comp: CompletionOutput) -> Json | None:
            lp = None
            if top_n is not None and comp.delta_token_ids:
                k = len(comp.delta_token_ids)
                entries = (comp.logprobs or [])[-k:]
                lp = {"content": self._chat_logprobs(comp.delta_token_ids, entries, top_n)}
            text = comp.delta_text
            if not text and lp is None and not comp.finished:
                return None
            delta = {"content": text} if text else {}
            choice = {
                "index": comp.index,
                "delta": delta,
                "logprobs": lp,
                "finish_reason": comp.finish_reason,
            }
            return {**base, "choices": [choice]}

        def usage_chunk(usage: Json) -> Json:
            return {**base, "choices": [], "usage": usage}

        return self.stream_sse(
            stream, receive, params.n, prelude, chunk, usage_chunk if req.include_usage else None
        )

    def _chat_logprobs(
        self, token_ids: list[int], entries: list[dict[int, float]], top_n: int
    ) -> list[Json]:
        content = []
        for tid, entry in zip(token_ids, entries):
            text = self.piece(tid)
            top = []
            for t, v in _top(entry, top_n):
                s = self.piece(t)
                top.append({"token": s, "logprob": _finite(v), "bytes": list(s.encode())})
            content.append(
                {
                    "token": text,
                    "logprob": _finite(entry.get(tid, -math.inf)),
                    "bytes": list(text.encode()),
                    "top_logprobs": top,
                }
            )
        return content
