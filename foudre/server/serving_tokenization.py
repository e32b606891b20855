"""``/tokenize`` and ``/detokenize`` (vLLM's): the served tokenizer, with the chat template
for messages."""

from __future__ import annotations

from foudre.loading.tokenizer import Tokenizer
from foudre.server.protocol import DetokenizeRequest, OpenAIError, TokenizeRequest
from foudre.server.serving import Json, OpenAIServing


class OpenAIServingTokenization:
    """Token ids of a prompt or of chat messages, and the text of token ids."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _tokenizer(self, model: str | None) -> Tokenizer:
        self.serving.check_model(model)
        tok = self.serving.tokenizer
        if tok is None:
            raise OpenAIError(400, "this server has no tokenizer")
        return tok

    async def tokenize(self, req: TokenizeRequest) -> Json:
        """The ids of ``req.prompt``, or of ``req.messages`` (and ``req.tools``) through the chat
        template, the same ids a chat completion of them is given."""
        serving = self.serving
        self._tokenizer(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = await serving.chat_prompt(
                req.messages, req.add_generation_prompt, tools, req.add_special_tokens
            )
        else:
            ids = await serving.encode(req.prompt or "", req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": serving.llm.max_model_len}

    async def detokenize(self, req: DetokenizeRequest) -> Json:
        """The text of ``req.tokens``; 400 for an id outside the tokenizer's vocabulary."""
        tok = self._tokenizer(req.model)
        vocab = tok.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(
                400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens"
            )
        return {"prompt": await self.serving.off_loop(tok.decode, req.tokens)}
