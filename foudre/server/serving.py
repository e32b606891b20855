"""What every OpenAI protocol shares over ``AsyncLLM``: the served model, one request's
parameters and submission, errors mapped to OpenAI's, and a submitted request's stream run to
its end or sent as server-sent events.

Each protocol (``serving_completions.py``, ``serving_chat.py``) turns its request into a
``Submission`` and its outputs into its own response shape; everything between is here.

Text deltas come from the engine's detokenizer, which only releases valid UTF-8 and never a
partial stop string, so a stream never shows text that the final answer would not contain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Receive

from foudre.engine.async_llm import (
    AsyncLLM,
    EngineStoppedError,
    Prompt,
    QueueFullError,
    RequestStream,
    sequences_per_prompt,
)
from foudre.errors import InvalidParameterError, PromptTooLongError
from foudre.loading.tokenizer import InvalidTextError
from foudre.outputs import CompletionOutput, ErrorCode, RequestOutput
from foudre.sampling_params import BeamSearchParams, SamplingParams, StructuredOutput
from foudre.server.protocol import ChatMessage, OpenAIError, _SamplingFields, _SearchFields
from foudre.server.reasoning import ReasoningParser
from foudre.server.tools import PARSERS, template_messages
from foudre.server.workers import PoolFullError, WorkerPool

Json = dict[str, Any]

# no token is longer than this many characters in the vocabularies we serve, so a text longer
# than max_model_len * CHARS_PER_TOKEN cannot fit: it is refused without being tokenized
CHARS_PER_TOKEN = 32
DEFAULT_MAX_N = 16
# the API's names of the engine parameters a failed request's output blames (error_params)
_API_NAMES = {"structured_output": "the grammar (response_format, guided_*, tools)"}


def sse(obj: Json | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


def finite(x: float) -> float:
    """``x``, or -9999 for a log-probability JSON cannot carry (-inf)."""
    return x if math.isfinite(x) else -9999.0


def top_entries(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
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
class Submission:
    """One request of any protocol, as the engine takes it.

    ``prompt_param``: the API field that holds the prompt (``"prompt"``, ``"messages"``), which
    an error about the prompt names; ``rename``: other engine parameter names -> the API field
    that set them (``logprobs`` -> ``top_logprobs``)."""

    prompts: list[Prompt]
    params: SamplingParams | BeamSearchParams
    request_id: str
    prompt_param: str = "prompt"
    cache_salt: str | None = None
    rename: dict[str, str] = field(default_factory=dict)


def context_length_exceeded(limit: int, detail: str, param: str) -> OpenAIError:
    """The 400 of a request that does not fit the context, worded as OpenAI words it ("This
    model's maximum context length is N tokens. ..."): client libraries recognise the error
    by that sentence (``litellm``'s ``ContextWindowExceededError``), beside the code."""
    message = f"This model's maximum context length is {limit} tokens. {detail}"
    return OpenAIError(400, message, param=param, code="context_length_exceeded")


def invalid_parameter(
    e: InvalidParameterError, prompt_param: str = "prompt", rename: dict[str, str] | None = None
) -> OpenAIError:
    """The 400 of a parameter that ``SamplingParams`` or the engine refused, naming the API
    field (``context_length_exceeded`` for a prompt too long)."""
    if isinstance(e, PromptTooLongError):
        detail = (
            f"However, your {prompt_param} resulted in {e.num_tokens} tokens. Please reduce "
            f"the length of the {prompt_param}."
        )
        return context_length_exceeded(e.max_model_len, detail, prompt_param)
    rename = rename or {}
    name = prompt_param if e.param == "prompt" else rename.get(e.param, e.param)
    message = str(e)
    if "structured_output" in rename:  # an error naming the grammar names its API field
        message = message.replace("structured_output", rename["structured_output"])
    return OpenAIError(400, message, param=name)


@dataclass(slots=True)
class TokenUsage:
    """Token counts of a request: one prompt count per prompt, one output count per choice."""

    prompt: dict[int, int] = field(default_factory=dict)
    completion: dict[int, int] = field(default_factory=dict)

    def count(self, comp: CompletionOutput, prompt_len: int, n: int) -> None:
        """Record choice ``comp``'s tokens and its prompt's (``n`` choices per prompt)."""
        self.completion[comp.index] = len(comp.token_ids)
        self.prompt[comp.index // n] = prompt_len

    def as_dict(self) -> Json:
        p, c = sum(self.prompt.values()), sum(self.completion.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _failure_timeout(request_id: str) -> OpenAIError:
    return OpenAIError(
        408, f"request {request_id} ran past the server's request timeout", code="timeout"
    )


def _failure(out: RequestOutput, request_id: str) -> OpenAIError | None:
    """The error of an output that ended without an answer: a failed step (``error``). An
    abort is an answer: what was generated, with ``finish_reason "abort"`` (a shutdown's
    drain ran out of time; a client that disconnected hears nothing)."""
    reason = out.outputs[0].finish_reason
    if reason == "error" and out.error_code is ErrorCode.GRAMMAR_DEAD_END:
        # the allowed tokens began the grammar's output (else admission refused the request)
        # but cannot go on with it: the request's own conflict, a 400 naming its parameters
        named = [_API_NAMES.get(p, p) for p in out.error_params]
        return OpenAIError(
            400,
            f"request {request_id} stopped: {' and '.join(named)} conflict: the grammar admits "
            "none of the allowed tokens at this point of the output",
            param="allowed_token_ids" if "allowed_token_ids" in out.error_params else None,
            code="grammar_dead_end",
        )
    if reason == "error":
        return OpenAIError(
            500,
            f"request {request_id} failed in the engine: {out.error}",
            type="internal_server_error",
        )
    return None


class OpenAIServing:
    """What the OpenAI endpoints of one served model share: the engine, the tokenizer (off the
    event loop), one request's parameters, its submission and its stream.

    ``max_n``: the most choices (``n``) one request may ask for. ``request_timeout``: seconds
    after which a request is aborted (its blocks freed) and answered 408, or an error event.
    ``tool_call_parser``: how "auto" tool calls are read (``tools.PARSERS``; None: the one that
    fits the chat template). ``reasoning_parser``: how chat outputs are split into reasoning
    and answer (None: they are not).
    """

    def __init__(
        self,
        llm: AsyncLLM,
        model_name: str,
        max_n: int = DEFAULT_MAX_N,
        request_timeout: float | None = None,
        workers: WorkerPool | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: ReasoningParser | None = None,
    ) -> None:
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {PARSERS}, got {tool_call_parser!r}")
        if max_n < 1:
            raise ValueError(f"max_n must be positive, got {max_n}")
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {request_timeout}")
        self.llm = llm
        self.model_name = model_name
        self.tokenizer = llm.tokenizer
        self.max_n = max_n
        self.request_timeout = request_timeout
        self.max_prompt_chars = llm.max_model_len * CHARS_PER_TOKEN
        # every request the queue admits may wait to be tokenized, but no more
        self.workers = workers or WorkerPool(max_pending=max(64, llm.max_queue or 1024))
        self._pieces: dict[int, str] = {}
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        # the end of the reasoning as tokens: where an answer's grammar starts, and what
        # reasoning tokens are counted up to
        self.reasoning_end_ids: list[int] = []
        if reasoning_parser is not None and self.tokenizer is not None:
            marker = reasoning_parser.answer_marker
            self.reasoning_end_ids = self.tokenizer.encode(marker, add_special_tokens=False)

    def reasoning_tokens(self, token_ids: list[int], reasoning: str | None) -> int:
        """How many of an output's tokens are its reasoning: those up to the end of the
        reasoning (its marker included), all of them when the output stopped while reasoning,
        none without reasoning."""
        if not reasoning:
            return 0
        end = self.reasoning_end_ids
        for i in range(len(token_ids) - len(end) + 1):
            if end and token_ids[i : i + len(end)] == end:
                return i + len(end)
        return len(token_ids)

    def deadline(self) -> float | None:
        """The loop time at which a request arriving now is aborted (None: never)."""
        if self.request_timeout is None:
            return None
        return asyncio.get_running_loop().time() + self.request_timeout

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
        structured: StructuredOutput | None = None,
    ) -> SamplingParams:
        """``SamplingParams`` of a request; an invalid value is a 400 naming its field. A field
        the request leaves out (None) takes ``SamplingParams``' default."""
        if req.n > self.max_n:
            raise OpenAIError(400, f"n must be at most {self.max_n}, got {req.n}", param="n")
        logit_bias = None
        if req.logit_bias is not None:
            try:
                logit_bias = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError:
                raise OpenAIError(
                    400, "logit_bias keys must be token ids (integers)", param="logit_bias"
                ) from None
        optional: dict[str, Any] = {
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "repetition_penalty": req.repetition_penalty,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
        }
        given = {name: value for name, value in optional.items() if value is not None}
        try:
            return SamplingParams(
                n=req.n,
                **given,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                logit_bias=logit_bias,
                allowed_token_ids=req.allowed_token_ids,
                structured_output=structured,
            )
        except InvalidParameterError as e:
            raise invalid_parameter(e, rename=rename) from None

    def beam_search_params(
        self,
        req: _SearchFields,
        max_tokens: int | None,
        logprobs: str | None,
        structured: StructuredOutput | None,
    ) -> BeamSearchParams | None:
        """vLLM's ``use_beam_search``: ``best_of`` (or ``n``) beams, the ``n`` best returned
        (None without it); 400 naming the field for what beam search cannot do (a stream,
        log-probabilities: ``logprobs`` names the field that asked for them, a grammar)."""
        if not req.use_beam_search:
            return None
        width = req.best_of if req.best_of is not None else req.n
        if req.stream:
            message = "beam search returns its beams at the end: no stream"
            raise OpenAIError(400, message, param="stream")
        if width > self.max_n:
            raise OpenAIError(400, f"best_of (beams) must be at most {self.max_n}", param="best_of")
        if req.n > width:
            message = f"n ({req.n}) exceeds the number of beams ({width})"
            raise OpenAIError(400, message, param="n")
        if logprobs is not None:
            message = "logprobs are not returned with beam search"
            raise OpenAIError(400, message, param=logprobs)
        if structured is not None:
            message = "beam search does not take a grammar (response_format, guided_*, tools)"
            raise OpenAIError(400, message, param="use_beam_search")
        # max_tokens as sampling takes it: None (chat's default) runs until max_model_len
        given = {} if req.temperature is None else {"temperature": req.temperature}
        try:
            return BeamSearchParams(
                beam_width=width,
                max_tokens=max_tokens,
                length_penalty=req.length_penalty,
                early_stopping=req.early_stopping,
                ignore_eos=req.ignore_eos,
                **given,
            )
        except InvalidParameterError as e:
            raise invalid_parameter(e) from None

    def with_best_of(self, req: _SearchFields, params: SamplingParams) -> SamplingParams:
        """``params`` sampling ``req.best_of`` and keeping the ``n`` most likely; 400 naming
        ``best_of`` past ``max_n``, below ``n``, or with a stream that would show the others."""
        if req.best_of is None:
            return params
        if req.best_of > self.max_n:
            raise OpenAIError(400, f"best_of must be at most {self.max_n}", param="best_of")
        if req.stream and req.best_of > req.n:
            raise OpenAIError(400, "best_of > n cannot stream", param="best_of")
        try:
            return dataclasses.replace(params, best_of=req.best_of)
        except InvalidParameterError as e:
            raise invalid_parameter(e) from None

    async def collect_beams(
        self,
        stream: RequestStream,
        receive: Receive,
        search: BeamSearchParams,
        n: int,
        deadline: float | None,
    ) -> tuple[dict[int, CompletionOutput], TokenUsage]:
        """Run a beam search per prompt to its end: the ``n`` best beams of each, by choice
        index (prompt ``p``'s at ``p * n`` on), and the usage of those beams."""
        width = search.beam_width
        finals, usage = await self.collect(stream, receive, width, deadline)
        beams: dict[int, CompletionOutput] = {}
        usage.completion.clear()  # the returned beams' tokens, as for any choice
        for index in sorted(finals):
            prompt, rank = divmod(index, width)
            if rank < n:
                beams[prompt * n + rank] = finals[index]
                usage.completion[prompt * n + rank] = len(finals[index].token_ids)
        return beams, usage

    def check_room(self, prompt_lens: list[int], max_tokens: int | None) -> None:
        """400 naming ``max_tokens`` when a prompt leaves no room for ``max_tokens`` more tokens
        within ``max_model_len``, as OpenAI's API refuses it (the engine alone would stop at
        ``max_model_len``). From the first prompt over ``max_model_len`` on, nothing is checked:
        the engine refuses that prompt when it is submitted."""
        limit = self.llm.max_model_len
        if max_tokens is None:
            return
        for prompt_len in prompt_lens:
            if prompt_len > limit:
                return
            if prompt_len + max_tokens > limit:
                detail = (
                    f"However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in "
                    f"the prompt, {max_tokens} in the completion: max_tokens). Please reduce "
                    "the length of the prompt or of the completion."
                )
                raise context_length_exceeded(limit, detail, "max_tokens")

    async def submit(self, sub: Submission) -> RequestStream:
        """The stream of ``sub`` once the engine has accepted it; 400 for what the engine
        refuses (a prompt too long, out of the vocabulary, a parameter it cannot serve), 503
        when its queue is full or it is stopping."""
        queue_limit = self.llm.max_queue
        total = sequences_per_prompt(sub.params) * len(sub.prompts)
        if queue_limit is not None and total > queue_limit:
            raise OpenAIError(
                400,
                f"the request asks for {total} sequences; this server holds at most "
                f"{queue_limit} at once",
                param="n",
            )
        try:
            return await self.llm.add_requests(
                sub.prompts, sub.params, sub.request_id, sub.cache_salt
            )
        except InvalidParameterError as e:
            raise invalid_parameter(e, sub.prompt_param, sub.rename) from None
        except ValueError as e:  # text the tokenizer refuses
            raise OpenAIError(400, str(e), param=sub.prompt_param) from None
        except QueueFullError as e:
            raise OpenAIError(
                503, str(e), type="server_overloaded", headers={"Retry-After": "1"}
            ) from None
        except EngineStoppedError as e:
            raise OpenAIError(
                503, str(e), type="service_unavailable", headers={"Retry-After": "1"}
            ) from None

    def check_text(self, text: str, param: str) -> None:
        """400 for a text that cannot fit ``max_model_len`` whatever its tokens (before any
        tokenization, whose cost grows with the text)."""
        if len(text) > self.max_prompt_chars:
            detail = (
                f"However, your {param} has {len(text)} characters, and at most "
                f"{self.max_prompt_chars} can fit. Please reduce the length of the {param}."
            )
            raise context_length_exceeded(self.llm.max_model_len, detail, param)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the worker pool; 503 when it is full."""
        try:
            return await self.workers.run(fn, *args)
        except PoolFullError as e:
            raise OpenAIError(
                503,
                f"too many requests are being tokenized: {e}",
                type="server_overloaded",
                headers={"Retry-After": "1"},
            ) from None

    async def encode(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        """Token ids of ``text``, computed off the event loop after the length check."""
        tok = self.tokenizer
        if tok is None:
            raise OpenAIError(400, "this server has no tokenizer; send token ids", param=param)
        self.check_text(text, param)
        try:
            ids: list[int] = await self.off_loop(tok.encode, text, add_special_tokens)
        except InvalidTextError as e:
            raise OpenAIError(400, f"{param}: {e}", param=param) from None
        return ids

    async def collect(
        self, stream: RequestStream, receive: Receive, n: int, deadline: float | None = None
    ) -> tuple[dict[int, CompletionOutput], TokenUsage]:
        """Run ``stream`` to its end (aborting it if the client leaves or the deadline passes);
        final outputs by choice index, and the usage (``n`` choices per prompt)."""
        finals: dict[int, CompletionOutput] = {}
        usage = TokenUsage()
        async with aclosing(self._request_outputs(stream, receive, deadline)) as outs:
            async for out in outs:
                for comp in out.outputs if out.finished else []:  # a beam search: every one
                    finals[comp.index] = comp
                    usage.count(comp, len(out.prompt_token_ids), n)
        return finals, usage

    async def outputs(
        self,
        stream: RequestStream,
        receive: Receive,
        n: int,
        usage: TokenUsage,
        deadline: float | None = None,
    ) -> AsyncGenerator[CompletionOutput, None]:
        """Each output of ``stream`` as it comes (``usage`` kept up to date; ``n`` choices per
        prompt), ending with the request; ``OpenAIError`` for a request that fails or times
        out. One that a shutdown cuts ends like any other, with ``finish_reason "abort"``. The
        request is aborted when the client disconnects or the iterator is closed."""
        async with aclosing(self._request_outputs(stream, receive, deadline)) as outs:
            async for out in outs:
                comp = out.outputs[0]
                usage.count(comp, len(out.prompt_token_ids), n)
                yield comp

    async def _request_outputs(
        self, stream: RequestStream, receive: Receive, deadline: float | None
    ) -> AsyncGenerator[RequestOutput, None]:
        """``stream``'s outputs, a failed or timed-out request raised as ``OpenAIError``; the
        request is aborted when the client disconnects, the deadline passes or this ends."""
        watcher = asyncio.create_task(_watch_disconnect(receive, stream))
        try:
            async with asyncio.timeout_at(deadline):
                async for out in stream:
                    if out.finished:
                        error = _failure(out, stream.request_id)
                        if error is not None:
                            raise error
                    yield out
        except TimeoutError:
            raise _failure_timeout(stream.request_id) from None
        except RuntimeError as e:  # the engine thread failed
            raise OpenAIError(
                500, f"request {stream.request_id}: {e}", type="internal_server_error"
            ) from None
        finally:
            watcher.cancel()
            stream.abort()

    async def stream_sse(
        self,
        stream: RequestStream,
        receive: Receive,
        n: int,
        prelude: list[Json],
        chunk: Callable[[CompletionOutput], Json | None],
        usage_chunk: Callable[[Json], Json] | None,
        deadline: float | None = None,
    ) -> AsyncIterator[str]:
        """The SSE body: ``prelude``, one chunk per useful output, the usage chunk, ``[DONE]``.
        A request that fails or times out ends with an error event (then ``[DONE]``) instead
        of a finish reason; one that a shutdown cuts ends like any other, its last chunk with
        ``finish_reason "abort"``. The request is aborted when the client disconnects or the
        body iterator is closed."""
        usage = TokenUsage()
        try:
            for obj in prelude:
                yield sse(obj)
            try:
                async with aclosing(self.outputs(stream, receive, n, usage, deadline)) as outputs:
                    async for comp in outputs:
                        piece = chunk(comp)
                        if piece is not None:
                            yield sse(piece)
            except OpenAIError as error:
                yield sse(error.body())
            else:
                if usage_chunk is not None:
                    yield sse(usage_chunk(usage.as_dict()))
            yield sse("[DONE]")
        finally:
            stream.abort()

    async def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[Json] | None,
        add_special_tokens: bool = True,
    ) -> list[int]:
        """The token ids of a conversation as the model sees it: the messages (with their tool
        calls and tool results) and the tools through the chat template, then encoded (no
        second BOS when the template wrote one). What chat generates from and ``/tokenize``
        counts are the same ids."""
        ids, _ = await self.chat_prompt_text(
            messages, add_generation_prompt, tools, add_special_tokens
        )
        return ids

    async def chat_prompt_text(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[Json] | None,
        add_special_tokens: bool = True,
    ) -> tuple[list[int], str]:
        """``chat_prompt``'s token ids and the rendered text they encode."""
        tok = self.tokenizer
        if tok is None:
            raise OpenAIError(400, "chat needs a tokenizer; this server has none")
        rendered_messages = template_messages(messages)
        self.check_text("".join(m["content"] for m in rendered_messages), "messages")
        rendered = await self.render_chat(rendered_messages, add_generation_prompt, tools)
        has_bos = bool(tok.bos_token) and rendered.startswith(tok.bos_token or "")
        ids = await self.encode(rendered, add_special_tokens and not has_bos, "messages")
        return ids, rendered

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template applied to ``messages`` (and ``tools``), off the event loop; 400 if
        it fails. A model without a template whose reasoning format renders its own prompts
        (harmony) gets that rendering."""
        tok = self.tokenizer
        if tok is None:
            raise OpenAIError(400, "chat needs a tokenizer; this server has none")
        parser = self.reasoning_parser
        template = tok.apply_chat_template

        def render(*args: Any) -> str:
            own = parser.render(*args) if parser is not None and not tok.has_chat_template else None
            return own if own is not None else template(*args)

        try:
            rendered: str = await self.off_loop(render, messages, add_generation_prompt, tools)
        except OpenAIError:
            raise
        except Exception as e:  # jinja2.TemplateError, or a template bug
            message = f"cannot apply the chat template: {e}"
            raise OpenAIError(400, message, param="messages") from None
        return rendered
