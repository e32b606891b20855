"""``LLM``: the offline API. Give it prompts, get completions, in order."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from foudre.config import EngineConfig
from foudre.engine.engine import LLMEngine
from foudre.errors import InvalidParameterError
from foudre.loading.tokenizer import Tokenizer
from foudre.outputs import RequestOutput
from foudre.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Offline generation over the continuous-batching engine.

    Every prompt is submitted at once and the engine steps until all are done, so they share
    batches exactly as concurrent server requests would.
    """

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: float | None = None,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        seed: int = 0,
        skip_tokenizer_init: bool = False,
        **kwargs: Any,
    ) -> None:
        unknown = set(kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        self.config = EngineConfig(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            max_model_len=max_model_len,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            seed=seed,
            skip_tokenizer_init=skip_tokenizer_init,
            **kwargs,
        )
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls(**dataclasses.asdict(config))

    def get_tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise ValueError("the tokenizer was not loaded (skip_tokenizer_init=True)")
        return self.engine.tokenizer

    def metrics(self) -> dict[str, Any]:
        return self.engine.metrics()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of ``prompts``.

        A prompt is a string or a list of token ids. With ``n > 1`` the n samples of a prompt
        share its cached prompt blocks and come back together in one ``RequestOutput``.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompt_list: list[Prompt] = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        engine = self.engine
        groups: list[list[str]] = []
        engine.set_draining(True)  # every request is queued: batches need not wait
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                groups.append(engine.add_group(f"gen-{next(self._ids)}", [prompt], params))
            final: dict[str, RequestOutput] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for ids in groups:
                for rid in ids:
                    engine.abort_request(rid)
            raise
        finally:
            engine.set_draining(False)
        results = []
        for ids in groups:
            first = final[ids[0]]
            first.outputs = [final[rid].outputs[0] for rid in ids]
            results.append(first)
        return results

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Generate one completion of ``prompt``, yielding its text as it is produced (the
        pieces join to the final text). Closing the iterator early aborts the request."""
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidParameterError("n", f"stream() makes one completion; got n={params.n}")
        engine = self.engine
        [rid] = engine.add_group(f"stream-{next(self._ids)}", [prompt], params)
        finished = False
        engine.set_draining(True)  # nothing else will arrive: a static batch need not wait
        try:
            while not finished:
                for out in engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        if out.outputs[0].delta_text:
                            yield out.outputs[0].delta_text
        finally:
            engine.set_draining(False)
            if not finished:
                engine.abort_request(rid)
