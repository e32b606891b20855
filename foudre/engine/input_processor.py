"""The input processor: a prompt and its parameters become requests once, here. Every check that
needs the model (token ids in the vocabulary, the prompt within ``max_model_len``, ``n`` and
beams within the batch and the KV cache, grammars that compile against the vocabulary) is made in
this one place, for the Python API, the CLI and every server route alike; what parameters can
check alone, ``SamplingParams`` checks at construction. ``n`` / ``best_of`` samples and beam
searches are planned here too: the requests of one prompt, and the ids their outputs carry."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from foudre.engine.beam import BeamSearch
from foudre.engine.request import Cohort, Request
from foudre.engine.tracked import BestOf, Tracked
from foudre.errors import InvalidParameterError, PromptTooLongError
from foudre.loading.detokenizer import IncrementalDetokenizer
from foudre.loading.tokenizer import Tokenizer
from foudre.sampling_params import BeamSearchParams, BeamStepParams, SamplingParams
from foudre.structured.grammar import GrammarCompiler

FLOAT32_MAX = 3.4028234663852886e38  # sampling parameters become float32 tensors
Prompt = str | list[int]
Encoded = tuple[list[int], str | None]  # a prompt's token ids, and its text when it had one
Plan = tuple[list[Tracked], list[str]]  # a prompt's requests (the first forks the others), ids


@dataclass
class Limits:
    """What the model and the engine's configuration allow a request."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_blocks: int
    speculative: bool  # a proposer drafts (beam search does not run with it)


class InputProcessor:
    def __init__(
        self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], limits: Limits
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.limits = limits
        self._grammar_compiler: GrammarCompiler | None = None  # built on first use

    def encode(self, prompt: Prompt) -> Encoded:
        """Token ids of ``prompt`` (encoded when text), validated: not empty, in the vocabulary,
        within ``max_model_len`` (``InvalidParameterError`` / ``PromptTooLongError``)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameterError(
                    "prompt", "text prompts need a tokenizer (skip_tokenizer_init=True)"
                )
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
        if not ids:
            raise InvalidParameterError("prompt", "prompt must not be empty")
        vocab = self.limits.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameterError(
                "prompt", f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        if len(ids) > self.limits.max_model_len:
            raise PromptTooLongError(len(ids), self.limits.max_model_len)
        return ids, text

    def check(self, params: SamplingParams) -> None:
        """What ``SamplingParams`` cannot check alone: floats within float32 (what the step's
        tensors hold), token ids and ``top_k`` against the model's vocabulary (so that no
        request can make a step index out of range), and its
        grammar, compiled (and cached) now or refused, with ``allowed_token_ids`` that leave
        it a first token (a grammar that the allowed tokens cannot begin would sample from
        nothing at the first step)."""
        for name in ("temperature", "repetition_penalty"):  # the only unbounded ones
            if getattr(params, name) > FLOAT32_MAX:  # a step's float32 tensors cannot hold it
                raise InvalidParameterError(name, f"{name} must be at most {FLOAT32_MAX:.4g}")
        vocab = self.limits.vocab_size
        if params.top_k > vocab:
            raise InvalidParameterError(
                "top_k", f"top_k must be -1, 0 or at most the vocabulary size {vocab}"
            )
        for name, token in params.token_ids_in_use():
            if token >= vocab:
                raise InvalidParameterError(
                    name, f"{name} names token id {token}, outside the vocabulary [0, {vocab})"
                )
        spec = params.structured_output
        if spec is not None:
            self.grammars().compile(spec)
            allowed = params.allowed_token_ids
            stops = sorted({*self.eos_token_ids, *params.stop_token_ids})
            if allowed is not None and not self.grammars().admits_first(spec, allowed, stops):
                raise InvalidParameterError(
                    "allowed_token_ids",
                    "allowed_token_ids and structured_output conflict: none of the allowed "
                    "tokens can begin an output that the structured_output grammar accepts",
                )

    def grammars(self) -> GrammarCompiler:
        """The compiler of structured outputs for this model's vocabulary, built on first use
        (it loads the grammar engine and reads every token's bytes)."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise InvalidParameterError(
                    "structured_output",
                    "structured output needs the tokenizer (skip_tokenizer_init=True)",
                )
            self._grammar_compiler = GrammarCompiler(
                self.tokenizer.token_bytes(), self.eos_token_ids, self.limits.vocab_size
            )
        return self._grammar_compiler

    def plan(
        self,
        group_id: str,
        prompts: list[Prompt],
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None,
        cache_salt: str | None,
    ) -> list[Plan]:
        """Every prompt encoded and checked, then its requests: ``n`` (or ``best_of``) samples,
        or one beam search. Nothing is queued: a refusal leaves no trace."""
        if not prompts:
            raise InvalidParameterError("prompt", "prompt must not be empty")
        encoded = [self.encode(p) for p in prompts]
        if isinstance(params, BeamSearchParams):
            return self._plan_beams(group_id, encoded, params, arrival_time, cache_salt)
        self.check(params)
        return self._plan_samples(group_id, encoded, params, arrival_time, cache_salt)

    def _plan_samples(
        self,
        group_id: str,
        encoded: list[Encoded],
        params: SamplingParams,
        arrival_time: float | None,
        cache_salt: str | None,
    ) -> list[Plan]:
        """Per prompt: its samples (the first is the one the others fork from) and the ids its
        outputs carry. Every child's parameters are checked (seeds) before anything is queued."""
        n, samples = params.n, params.num_samples
        if samples > self.limits.max_num_seqs:  # the samples of a prompt run together
            name = "n" if params.best_of is None else "best_of"
            raise InvalidParameterError(
                name, f"{name} {samples} exceeds max_num_seqs {self.limits.max_num_seqs}"
            )
        total = len(encoded) * n
        plans = []
        for p, (ids, text) in enumerate(encoded):
            visible = [group_id if total == 1 else f"{group_id}-{p * n + j}" for j in range(n)]
            best_of = None
            base = params
            if samples > n:
                best_of = BestOf(visible, p * n, samples, params.logprobs is not None)
                if params.logprobs is None:  # ranking needs each token's log-probability
                    base = dataclasses.replace(params, logprobs=0)
            tracked = []
            for j in range(samples):
                child = base
                if samples > 1 and params.seed is not None:
                    child = dataclasses.replace(base, seed=params.seed + j)
                rid = visible[j] if best_of is None else f"{group_id}~{p * samples + j}"
                t = self.make(ids, text, child, rid, arrival_time, p * n + j, group_id, cache_salt)
                t.best_of = best_of
                tracked.append(t)
            plans.append((tracked, visible))
        return plans

    def _plan_beams(
        self,
        group_id: str,
        encoded: list[Encoded],
        params: BeamSearchParams,
        arrival_time: float | None,
        cache_salt: str | None,
    ) -> list[Plan]:
        lim = self.limits
        if lim.speculative:
            raise InvalidParameterError(
                "beam_width", "beam search does not run with speculative decoding"
            )
        if params.beam_width > lim.max_num_seqs:
            raise InvalidParameterError(
                "beam_width",
                f"beam_width {params.beam_width} exceeds max_num_seqs {lim.max_num_seqs}",
            )
        plans = []
        for p, (ids, text) in enumerate(encoded):
            room = lim.max_model_len - len(ids)
            if room < 1:
                raise PromptTooLongError(len(ids) + 1, lim.max_model_len)
            budget = room if params.max_tokens is None else min(params.max_tokens, room)
            # the beams may diverge from the first token: each may need its own blocks
            length = len(ids) + budget
            worst = params.beam_width * -(-length // lim.block_size)
            if worst > lim.num_blocks:
                raise InvalidParameterError(
                    "beam_width",
                    f"{params.beam_width} beams of {length} tokens may need {worst} KV blocks; "
                    f"the cache has {lim.num_blocks}",
                )
            vid = group_id if len(encoded) == 1 else f"{group_id}-{p}"
            cohort = Cohort(seats=params.beam_width)
            search = BeamSearch(vid, p, params, self.eos_token_ids, budget, cohort)
            sampling = BeamStepParams(
                temperature=0.0,
                max_tokens=None,
                ignore_eos=True,
                logprobs=search.num_candidates,
            )
            t = self.make(ids, text, sampling, f"{vid}:0", arrival_time, p, group_id, cache_salt)
            t.beam = search
            t.request.cohort = cohort
            cohort.members.append(t.request)
            search.scores[t.request.request_id] = 0.0
            plans.append(([t], [vid]))
        return plans

    def make(
        self,
        prompt_ids: list[int],
        text: str | None,
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None,
        index: int,
        group_id: str | None,
        cache_salt: str | None,
    ) -> Tracked:
        """A request and its companions (grammar matcher, detokenizer), not queued yet."""
        req = Request(
            request_id,
            prompt_ids,
            params,
            self.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            cache_salt=cache_salt,
        )
        if params.structured_output is not None:  # each sample walks the grammar on its own
            stops = {*self.eos_token_ids, *params.stop_token_ids}
            req.grammar = self.grammars().matcher(params.structured_output, sorted(stops))
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
        return Tracked(req, text, detok, index, group_id)
