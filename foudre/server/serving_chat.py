"""``/v1/chat/completions``: messages through the model's chat template, with tool calls,
structured output and OpenAI's chat logprobs."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import Receive

from foudre.engine.async_llm import RequestStream
from foudre.outputs import CompletionOutput
from foudre.sampling_params import BeamSearchParams, SamplingParams
from foudre.server.protocol import ChatCompletionRequest, OpenAIError
from foudre.server.serving import Json, OpenAIServing, Submission, finite, top_entries
from foudre.server.structured import structured_output
from foudre.server.tools import ToolPlan, ToolStreamer


@dataclass(slots=True)
class ChatRun:
    """One submitted chat request: its stream, and what reading its outputs needs (the tool
    plan, the sampling or beam parameters, the logprobs asked, the deadline)."""

    request_id: str
    stream: RequestStream
    plan: ToolPlan
    params: SamplingParams
    search: BeamSearchParams | None
    top_n: int | None
    deadline: float | None


class OpenAIServingChat:
    """The chat completions endpoint over the shared request handling of ``serving``."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def start(self, req: ChatCompletionRequest, id_prefix: str = "chatcmpl-") -> ChatRun:
        """``req`` checked and submitted (its id ``<id_prefix><hex>``): its stream and how to
        read its outputs. 400 naming the field for what is invalid; 503 when full."""
        serving = self.serving
        serving.check_model(req.model)
        tok = serving.tokenizer
        if tok is None:
            raise OpenAIError(400, "chat needs a tokenizer; this server has none")
        if req.top_logprobs is not None and not req.logprobs:
            message = "top_logprobs requires logprobs to be true"
            raise OpenAIError(400, message, param="top_logprobs")
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        plan = ToolPlan.of(req, tok, serving.tool_call_parser)
        params, search, rename = self._params(req, plan, top_n)
        deadline = serving.deadline()
        prompt_ids = await serving.chat_prompt(req.messages, req.add_generation_prompt, plan.tools)
        serving.check_room([len(prompt_ids)], params.max_tokens)
        rid = f"{id_prefix}{uuid.uuid4().hex}"
        asked = params if search is None else search
        sub = Submission([prompt_ids], asked, rid, "messages", req.cache_salt, rename)
        stream = await serving.submit(sub)
        return ChatRun(rid, stream, plan, params, search, top_n, deadline)

    async def create(
        self, req: ChatCompletionRequest, receive: Receive
    ) -> Json | AsyncIterator[str]:
        """The response to ``req``: a ``chat.completion`` dict, or its SSE stream."""
        serving = self.serving
        run = await self.start(req)
        params, search, plan, top_n = run.params, run.search, run.plan, run.top_n
        base: Json = {
            "id": run.request_id,
            "created": int(time.time()),
            "model": serving.model_name,
        }
        if not req.stream:
            if search is None:
                finals, usage = await serving.collect(run.stream, receive, params.n, run.deadline)
            else:
                finals, usage = await serving.collect_beams(
                    run.stream, receive, search, req.n, run.deadline
                )
            choices = [self._choice(finals[i], plan, top_n, i) for i in sorted(finals)]
            return {
                **base,
                "object": "chat.completion",
                "choices": choices,
                "usage": usage.as_dict(),
            }
        base = {**base, "object": "chat.completion.chunk"}
        chunks = _ChatChunks(base, plan, top_n, params.n, self)
        return serving.stream_sse(
            run.stream,
            receive,
            params.n,
            chunks.prelude(),
            chunks,
            chunks.usage if req.include_usage else None,
            run.deadline,
        )

    def _params(
        self, req: ChatCompletionRequest, plan: ToolPlan, top_n: int | None
    ) -> tuple[SamplingParams, BeamSearchParams | None, dict[str, str]]:
        """The request's sampling parameters (a forced tool call's grammar included; ``best_of``
        samples), its beam search (None without one) and the engine parameter names that map
        to other API fields."""
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        structured, field = structured_output(req)
        if plan.structured_output is not None:  # tool_choice "required" or a named function
            if structured is not None:
                raise OpenAIError(
                    400, f"{field} cannot be combined with a forced tool_choice", param=field
                )
            structured, field = plan.structured_output, "tools"
        rename = {"logprobs": "top_logprobs", "structured_output": field or "structured_output"}
        serving = self.serving
        params = serving.sampling_params(req, max_tokens, top_n, rename, structured)
        logprobs = "logprobs" if req.logprobs else None
        search = serving.beam_search_params(req, max_tokens, logprobs, structured)
        if search is None:
            params = serving.with_best_of(req, params)
        return params, search, rename

    def _choice(
        self, comp: CompletionOutput, plan: ToolPlan, top_n: int | None, index: int
    ) -> Json:
        lp = None
        if top_n is not None:
            lp = {"content": self.logprobs(comp.token_ids, comp.logprobs or [], top_n)}
        reply, called = plan.message(comp.text)
        return {
            "index": index,
            "message": reply,
            "logprobs": lp,
            "finish_reason": plan.finish_reason(comp.finish_reason, called),
            "stop_reason": comp.stop_reason,
        }

    def logprobs(
        self, token_ids: list[int], entries: list[dict[int, float]], top_n: int
    ) -> list[Json]:
        """OpenAI's chat ``logprobs.content`` of ``token_ids``."""
        piece = self.serving.piece
        content = []
        for tid, entry in zip(token_ids, entries):
            text = piece(tid)
            top = []
            for t, v in top_entries(entry, top_n):
                s = piece(t)
                top.append({"token": s, "logprob": finite(v), "bytes": list(s.encode())})
            content.append(
                {
                    "token": text,
                    "logprob": finite(entry.get(tid, -math.inf)),
                    "bytes": list(text.encode()),
                    "top_logprobs": top,
                }
            )
        return content


class _ChatChunks:
    """The chunks of one streamed chat completion: a role delta per choice first, then each
    output's delta (content held back while it may begin a tool call, calls once complete)."""

    def __init__(
        self, base: Json, plan: ToolPlan, top_n: int | None, n: int, chat: OpenAIServingChat
    ) -> None:
        self.base = base
        self.plan = plan
        self.top_n = top_n
        self.n = n
        self.chat = chat
        self.streamers: dict[int, ToolStreamer] = (
            {i: plan.streamer() for i in range(n)} if plan.parses else {}
        )

    def prelude(self) -> list[Json]:
        return [
            {
                **self.base,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for i in range(self.n)
        ]

    def __call__(self, comp: CompletionOutput) -> Json | None:
        lp = None
        if self.top_n is not None and comp.delta_token_ids:
            k = len(comp.delta_token_ids)
            entries = (comp.logprobs or [])[-k:]
            lp = {"content": self.chat.logprobs(comp.delta_token_ids, entries, self.top_n)}
        text = comp.delta_text
        delta: Json = {"content": text} if text else {}
        finish = comp.finish_reason
        streamer = self.streamers.get(comp.index)
        if streamer is not None:  # tool calls: content held back while it may be a call
            delta = streamer.step(text, comp.finished)
            if comp.finished:
                finish = self.plan.finish_reason(finish, streamer.num_calls > 0)
        if not delta and lp is None and not comp.finished:
            return None
        choice = {"index": comp.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {**self.base, "choices": [choice]}

    def usage(self, usage: Json) -> Json:
        return {**self.base, "choices": [], "usage": usage}
