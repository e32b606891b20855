"""``/v1/chat/completions``: messages through the model's chat template, with tool calls,
structured output, reasoning output and OpenAI's chat logprobs.

With a reasoning parser, an output is split into ``reasoning_content`` (streamed as
``delta.reasoning_content``) and ``content``, the answer: tool calls are read from the answer
only (or, for harmony, from its own call messages), and a grammar (``response_format``, a
forced tool call) constrains the answer only, starting after the reasoning's end marker.
"""

from __future__ import annotations

import dataclasses
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
from foudre.server.reasoning import Parsed, ReasoningParser, ReasoningStreamer
from foudre.server.serving import Json, OpenAIServing, Submission, finite, top_entries
from foudre.server.structured import structured_output
from foudre.server.tools import ToolCallOut, ToolPlan, ToolStreamer


@dataclass(slots=True)
class ChatRun:
    """One submitted chat request: its stream, and what reading its outputs needs (the tool
    plan, the sampling or beam parameters, the logprobs asked, the deadline, the reasoning
    parser and the rendered prompt it reads the output after)."""

    request_id: str
    stream: RequestStream
    plan: ToolPlan
    params: SamplingParams
    search: BeamSearchParams | None
    top_n: int | None
    deadline: float | None
    reasoning: ReasoningParser | None = None
    prompt_text: str = ""

    @property
    def own_calls(self) -> bool:
        """The reasoning format carries its own tool calls, and "auto" calls are read."""
        parser = self.reasoning
        return parser is not None and parser.reads_tool_calls and self.plan.mode == "auto"

    def answer(self, text: str) -> tuple[str | None, str | None, list[ToolCallOut]]:
        """A complete output's reasoning (None without), answer text and tool calls."""
        if self.reasoning is None:
            content, calls = self.plan.parse(text)
            return None, content, calls
        parsed = self.reasoning.parse(text, self.prompt_text)
        reasoning = parsed.reasoning or None
        if self.own_calls:
            calls = parsed.calls if self.plan.parallel else parsed.calls[:1]
            return reasoning, parsed.content or None, calls
        if not parsed.content:  # stopped while reasoning: no answer, no call
            return reasoning, None, []
        content, calls = self.plan.parse(parsed.content)
        return reasoning, content, calls

    def message(self, text: str) -> tuple[Json, bool]:
        """The assistant message of a complete output, and whether it holds calls."""
        reasoning, content, calls = self.answer(text)
        message: Json = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.as_json() for c in calls]
        return message, bool(calls)

    def streamer(self) -> ChoiceStreamer | None:
        """A streamer of one choice's deltas (None when text deltas pass as they are)."""
        if self.reasoning is None and not self.plan.parses:
            return None
        return ChoiceStreamer(self)


class ChoiceStreamer:
    """One choice's text deltas in, chat deltas out: ``reasoning_content`` as the reasoning
    parser releases it, the answer through the tool streamer (content held back while it may
    begin a call), or a harmony output's own calls once complete."""

    def __init__(self, run: ChatRun) -> None:
        parser = run.reasoning
        self.reasoning: ReasoningStreamer | None = (
            None if parser is None else parser.streamer(run.prompt_text)
        )
        self.own_calls = run.own_calls
        self.parallel = run.plan.parallel
        self.tools: ToolStreamer | None = (
            run.plan.streamer() if run.plan.parses and not self.own_calls else None
        )
        self.num_calls = 0

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def step(self, text: str, finished: bool) -> Json:
        parsed = Parsed(content=text)
        if self.reasoning is not None:
            parsed = self.reasoning.step(text, finished)
        delta: Json = {}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if self.tools is not None:
            delta.update(self.tools.step(parsed.content, finished))
            self.num_calls = self.tools.num_calls
        elif parsed.content:
            delta["content"] = parsed.content
        calls = parsed.calls if self.own_calls else []
        if calls and not self.parallel:
            calls = calls[: max(0, 1 - self.num_calls)]
        if calls:
            delta["tool_calls"] = [c.as_json(self.num_calls + i) for i, c in enumerate(calls)]
            self.num_calls += len(calls)
        return delta


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
        parser = serving.reasoning_parser
        if parser is not None and parser.reads_tool_calls and plan.mode in ("required", "named"):
            # (a forced call is a grammar on the answer; harmony's calls are their own channel)
            message = (
                f"tool_choice {req.tool_choice!r} is not supported with the {parser.name} "
                "reasoning format, whose model writes its calls on their own channel: use "
                "tool_choice 'auto'"
            )
            raise OpenAIError(400, message, param="tool_choice")
        params, search, rename = self._params(req, plan, top_n)
        deadline = serving.deadline()
        prompt_ids, prompt_text = await serving.chat_prompt_text(
            req.messages, req.add_generation_prompt, plan.tools
        )
        params = self._for_reasoning(params, prompt_text)
        serving.check_room([len(prompt_ids)], params.max_tokens)
        rid = f"{id_prefix}{uuid.uuid4().hex}"
        asked = params if search is None else search
        sub = Submission([prompt_ids], asked, rid, "messages", req.cache_salt, rename)
        stream = await serving.submit(sub)
        return ChatRun(rid, stream, plan, params, search, top_n, deadline, parser, prompt_text)

    def _for_reasoning(self, params: SamplingParams, prompt_text: str) -> SamplingParams:
        """``params`` for a thinking model: its grammar starting after the reasoning's end
        marker (unless the prompt already ended the reasoning), its special tokens kept in the
        text when they are the format's markers."""
        parser = self.serving.reasoning_parser
        if parser is None:
            return params
        changes: dict[str, object] = {}
        spec, end = params.structured_output, self.serving.reasoning_end_ids
        if spec is not None and end and not parser.reasoning_ended(prompt_text):
            # an output that may be all answer (no opening marker): the grammar from its first
            # token unless it opens the reasoning (a one-token marker; else the gate as is)
            opener, tok = parser.opening_marker(prompt_text), self.serving.tokenizer
            ids = tok.encode(opener, add_special_tokens=False) if opener and tok else []
            opened_by = ids[0] if len(ids) == 1 else None
            changes["structured_output"] = dataclasses.replace(
                spec, starts_after=end, opened_by=opened_by
            )
        if not parser.skip_special_tokens:
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params  # type: ignore[arg-type]

    async def create(
        self, req: ChatCompletionRequest, receive: Receive
    ) -> Json | AsyncIterator[str]:
        """The response to ``req``: a ``chat.completion`` dict, or its SSE stream."""
        serving = self.serving
        run = await self.start(req)
        params, search = run.params, run.search
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
            choices = [self._choice(finals[i], run, i) for i in sorted(finals)]
            counts = usage.as_dict()
            if run.reasoning is not None:
                thought = sum(
                    serving.reasoning_tokens(
                        finals[c["index"]].token_ids, c["message"].get("reasoning_content")
                    )
                    for c in choices
                )
                counts["completion_tokens_details"] = {"reasoning_tokens": thought}
            return {
                **base,
                "object": "chat.completion",
                "choices": choices,
                "usage": counts,
            }
        base = {**base, "object": "chat.completion.chunk"}
        chunks = _ChatChunks(base, run, params.n, self)
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

    def _choice(self, comp: CompletionOutput, run: ChatRun, index: int) -> Json:
        lp = None
        if run.top_n is not None:
            lp = {"content": self.logprobs(comp.token_ids, comp.logprobs or [], run.top_n)}
        reply, called = run.message(comp.text)
        return {
            "index": index,
            "message": reply,
            "logprobs": lp,
            "finish_reason": run.plan.finish_reason(comp.finish_reason, called),
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
    output's delta (reasoning apart, content held back while it may begin a tool call, calls
    once complete)."""

    def __init__(self, base: Json, run: ChatRun, n: int, chat: OpenAIServingChat) -> None:
        self.base = base
        self.plan = run.plan
        self.top_n = run.top_n
        self.n = n
        self.chat = chat
        self.streamers: dict[int, ChoiceStreamer] = {}
        for i in range(n):
            streamer = run.streamer()
            if streamer is not None:
                self.streamers[i] = streamer
        self.reasoning = run.reasoning is not None
        self.thought: dict[int, tuple[list[int], str]] = {}  # token ids, reasoning, by choice

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
        if streamer is not None:  # reasoning apart; content held back while it may be a call
            delta = streamer.step(text, comp.finished)
            if comp.finished:
                finish = self.plan.finish_reason(finish, streamer.called)
        if self.reasoning:
            _, reasoning = self.thought.get(comp.index, ([], ""))
            reasoning += delta.get("reasoning_content", "")
            self.thought[comp.index] = (comp.token_ids, reasoning)
        if not delta and lp is None and not comp.finished:
            return None
        choice = {"index": comp.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {**self.base, "choices": [choice]}

    def usage(self, usage: Json) -> Json:
        if self.reasoning:
            count = self.chat.serving.reasoning_tokens
            thought = sum(count(ids, text) for ids, text in self.thought.values())
            usage = {**usage, "completion_tokens_details": {"reasoning_tokens": thought}}
        return {**self.base, "choices": [], "usage": usage}
