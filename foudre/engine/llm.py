"""``LLM``: the offline API. Give it prompts, get completions, in order."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

from foudre.config import EngineConfig
from foudre.engine.engine import LLMEngine
from foudre.errors import InvalidParameterError
from foudre.loading.tokenizer import Tokenizer
from foudre.outputs import BeamSearchOutput, BeamSequence, RequestOutput
from foudre.sampling_params import BeamSearchParams, SamplingParams

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

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (``tensor_parallel_size`` or
        ``pipeline_parallel_size`` above 1; nothing to do on one device). Idempotent."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of ``prompts``.

        A prompt is a string or a list of token ids. With ``n > 1`` the n samples of a prompt
        fork from one computation of it (sharing its blocks) and come back together in one
        ``RequestOutput``; with ``best_of``, the ``n`` best of ``best_of`` samples.
        """
        prompt_list = _prompt_list(prompts)
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
        final, groups = self._run(prompt_list, params_list, "gen")
        results = []
        for ids in groups:  # a prompt's samples, in one output
            samples = [final[rid].outputs[0] for rid in ids]
            results.append(dataclasses.replace(final[ids[0]], outputs=samples))
        return results

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search of every prompt (all in the continuous batch together); one
        ``BeamSearchOutput`` per prompt, in order, its ``beam_width`` sequences best first, as
        Hugging Face ``transformers``' ``generate(num_beams=...)`` ranks them."""
        prompt_list = _prompt_list(prompts)
        final, groups = self._run(prompt_list, [params] * len(prompt_list), "beam")
        results = []
        for [rid] in groups:
            out = final[rid]
            sequences = [
                BeamSequence(
                    c.token_ids,
                    c.text,
                    c.cumulative_logprob if c.cumulative_logprob is not None else -math.inf,
                    c.finish_reason or "abort",
                    c.score if c.score is not None else -math.inf,
                )
                for c in out.outputs
            ]
            results.append(BeamSearchOutput(rid, out.prompt, out.prompt_token_ids, sequences))
        return results

    def _run(
        self,
        prompts: Sequence[Prompt],
        params: Sequence[SamplingParams | BeamSearchParams],
        prefix: str,
    ) -> tuple[dict[str, RequestOutput], list[list[str]]]:
        """Queue one group per prompt, step until all are done; the final outputs by id and
        each group's output ids. Anything raised aborts what was queued."""
        engine = self.engine
        group_ids: list[str] = []
        groups: list[list[str]] = []
        engine.set_draining(True)  # every request is queued: batches need not wait
        try:
            for prompt, p in zip(prompts, params, strict=True):
                group_ids.append(f"{prefix}-{next(self._ids)}")
                groups.append(engine.add_group(group_ids[-1], [prompt], p, final_only=True))
            final: dict[str, RequestOutput] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for gid in group_ids:  # by group: beams and best_of samples run under other ids
                engine.abort_group(gid)
            raise
        finally:
            engine.set_draining(False)
        return final, groups

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Generate one completion of ``prompt``, yielding its text as it is produced (the
        pieces join to the final text). Closing the iterator early aborts the request."""
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidParameterError("n", f"stream() makes one completion; got n={params.n}")
        if params.num_samples != 1:  # the best one is known only once all have finished
            raise InvalidParameterError("best_of", "stream() cannot stream best_of samples")
        engine = self.engine
        gid = f"stream-{next(self._ids)}"
        [rid] = engine.add_group(gid, [prompt], params)
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
                engine.abort_group(gid)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or several, as a list."""
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
