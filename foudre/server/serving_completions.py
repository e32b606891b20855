"""``/v1/completions``: one or more prompts (text or token ids) continued, with ``n`` /
``best_of`` samples or vLLM's beam search, legacy logprobs and ``echo``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.types import Receive

from foudre.engine.async_llm import Prompt, RequestStream
from foudre.outputs import CompletionOutput
from foudre.sampling_params import BeamSearchParams, SamplingParams
from foudre.server.protocol import CompletionRequest
from foudre.server.serving import (
    Json,
    OpenAIServing,
    Submission,
    finite,
    top_entries,
)
from foudre.server.structured import structured_output


class OpenAIServingCompletions:
    """The completions endpoint over the shared request handling of ``serving``."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: CompletionRequest, receive: Receive) -> Json | AsyncIterator[str]:
        """The response to ``req``: a ``text_completion`` dict, or its SSE stream."""
        serving = self.serving
        serving.check_model(req.model)
        params, search, rename = self._params(req)
        deadline = serving.deadline()
        prompts, texts = await self._prompts(req)
        serving.check_room([len(p) for p in prompts if isinstance(p, list)], params.max_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        asked = params if search is None else search
        sub = Submission(prompts, asked, rid, "prompt", req.cache_salt, rename)
        stream = await serving.submit(sub)
        echoed = await self._echoed(req, prompts, texts, stream)
        if search is not None:
            return await self._beam_search(req, stream, echoed, search, rid, receive, deadline)
        base: Json = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": serving.model_name,
        }
        if not req.stream:
            finals, usage = await serving.collect(stream, receive, params.n, deadline)
            choices = [self._choice(req, finals[i], echoed[i // params.n]) for i in sorted(finals)]
            return {**base, "choices": choices, "usage": usage.as_dict()}
        return self._stream(req, stream, receive, params.n, echoed, base, deadline)

    def _params(
        self, req: CompletionRequest
    ) -> tuple[SamplingParams, BeamSearchParams | None, dict[str, str]]:
        """The request's sampling parameters, its beam search (None without one) and the
        engine parameter names that map to other API fields."""
        serving = self.serving
        structured, field = structured_output(req)
        rename = {"structured_output": field or "structured_output"}
        params = serving.sampling_params(req, req.max_tokens, req.logprobs, rename, structured)
        logprobs = "logprobs" if req.logprobs is not None else None
        search = serving.beam_search_params(req, req.max_tokens, logprobs, structured)
        if search is None:
            params = serving.with_best_of(req, params)
        return params, search, rename

    async def _prompts(self, req: CompletionRequest) -> tuple[list[Prompt], list[str | None]]:
        """The prompts as the engine takes them (token ids, or text without a tokenizer), and
        the text of each given as text (None for token ids). The engine checks them: not
        empty, in the vocabulary, within ``max_model_len``."""
        serving = self.serving
        raw = req.prompt
        items: list[str | list[int]]
        if isinstance(raw, str):
            items = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            items = [list(raw)]  # type: ignore[arg-type]
        else:
            items = list(raw)  # type: ignore[arg-type]
        prompts: list[Prompt] = []
        texts: list[str | None] = []
        for item in items:
            if isinstance(item, str):
                texts.append(item)
                if serving.tokenizer is None:
                    serving.check_text(item, "prompt")
                    prompts.append(item)
                else:
                    prompts.append(await serving.encode(item))
            else:
                texts.append(None)
                prompts.append(list(item))
        return prompts, texts

    async def _echoed(
        self,
        req: CompletionRequest,
        prompts: list[Prompt],
        texts: list[str | None],
        stream: RequestStream,
    ) -> list[str]:
        """What ``echo`` puts before each prompt's choices ("" without it): the prompt's text,
        token ids decoded once the engine has accepted them (ids outside the vocabulary are
        refused there, not decoded here)."""
        tok = self.serving.tokenizer
        if not req.echo:
            return [""] * len(prompts)
        echoed = []
        try:
            for prompt, text in zip(prompts, texts):
                if text is None and tok is not None and isinstance(prompt, list):
                    text = await self.serving.off_loop(tok.decode, prompt)
                echoed.append(text or "")
        except BaseException:
            stream.abort()
            raise
        return echoed

    def _choice(self, req: CompletionRequest, comp: CompletionOutput, prefix: str) -> Json:
        lp = None
        if req.logprobs is not None:
            lp, _ = self._logprobs(comp.token_ids, comp.logprobs or [], req.logprobs, len(prefix))
        return {
            "index": comp.index,
            "text": prefix + comp.text,
            "logprobs": lp,
            "finish_reason": comp.finish_reason,
            "stop_reason": comp.stop_reason,
        }

    def _stream(
        self,
        req: CompletionRequest,
        stream: RequestStream,
        receive: Receive,
        n: int,
        echoed: list[str],
        base: Json,
        deadline: float | None,
    ) -> AsyncIterator[str]:
        """The SSE body: each choice's deltas (its prompt first with ``echo``)."""
        started: set[int] = set()
        offsets: dict[int, int] = {}
        want_lp = req.logprobs

        def chunk(comp: CompletionOutput) -> Json | None:
            i = comp.index
            text = comp.delta_text
            if req.echo and i not in started:
                started.add(i)
                text = echoed[i // n] + text
                offsets[i] = len(echoed[i // n])
            lp = None
            if want_lp is not None and comp.delta_token_ids:
                k = len(comp.delta_token_ids)
                lp, offsets[i] = self._logprobs(
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

        return self.serving.stream_sse(
            stream, receive, n, [], chunk, usage_chunk if req.include_usage else None, deadline
        )

    async def _beam_search(
        self,
        req: CompletionRequest,
        stream: RequestStream,
        echoed: list[str],
        search: BeamSearchParams,
        rid: str,
        receive: Receive,
        deadline: float | None,
    ) -> Json:
        """A beam search per prompt; the ``n`` best beams of each are its choices."""
        serving = self.serving
        beams, usage = await serving.collect_beams(stream, receive, search, req.n, deadline)
        choices = [
            {
                "index": index,
                "text": echoed[index // req.n] + comp.text,
                "logprobs": None,
                "finish_reason": comp.finish_reason,
                "stop_reason": None,
            }
            for index, comp in beams.items()
        ]
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": serving.model_name,
            "choices": choices,
            "usage": usage.as_dict(),
        }

    def _logprobs(
        self, token_ids: list[int], entries: list[dict[int, float]], top_n: int, offset: int
    ) -> tuple[Json, int]:
        """Legacy completions logprobs of ``token_ids``, text offsets starting at ``offset``;
        also returns the offset after the last token."""
        piece = self.serving.piece
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            text = piece(tid)
            tokens.append(text)
            token_logprobs.append(finite(entry[tid]) if tid in entry else None)
            top_logprobs.append({piece(t): finite(v) for t, v in top_entries(entry, top_n)})
            text_offset.append(offset)
            offset += len(text)
        lp = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }
        return lp, offset
