"""Constrained decoding: each constrained request's grammar masks its logits before sampling.

A ``StructuredOutput`` (a JSON schema, a regex, a choice, an EBNF grammar) is compiled once per
vocabulary by ``GrammarCompiler`` (xgrammar: a pushdown automaton over bytes whose per-state
token masks are precomputed against the vocabulary), then each request gets its own
``GrammarMatcher``, the automaton's state after the tokens it has output::

    admission   GrammarCompiler.matcher(spec)        compiled grammar cached by spec
                (spec.starts_after: GatedMatcher, free until those tokens, then the grammar)
    each step   fill_masks(rows) -> GrammarMasks     one bitmask row per constrained logits row
                process_logits: GrammarMasks.apply   disallowed tokens -> -inf, in place, batched
    append      GrammarMatcher.accept(token)         the engine advances it with every token kept

Unconstrained rows cost nothing: ``fill_masks`` is only called when some row has a matcher.
Speculative verification masks draft position ``j`` with the state after drafts ``1..j-1``
(accepted temporarily, then rolled back), so the target's distribution at every position is
the constrained one and rejection sampling stays exact.

Everything here takes plain data (token bytes, stop ids): the engine, which owns the tokenizer,
builds the compiler. xgrammar is imported on first use, so that unconstrained serving never
loads it.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from foudre.errors import InvalidParameterError
from foudre.sampling_params import StructuredOutput
from foudre.structured.utf8 import valid_utf8

PARAM = "structured_output"
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept, least recently used evicted

# JSON Schema keywords that xgrammar would silently ignore: refused rather than unenforced
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "contentEncoding",
        "contentMediaType",
        "contentSchema",
        "$dynamicRef",
        "$recursiveRef",
    }
)
_ONE_SCHEMA = (
    *("items", "additionalItems", "additionalProperties", "contains", "propertyNames"),
    *("unevaluatedItems", "unevaluatedProperties"),
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_CONTROL = re.compile(rb"[\x00-\x1f]")
_XGR_PREFIX = re.compile(r"^(\[[\d:]+\] )?\S+\.(cc|h):\d+: (Check failed: .*? is false: )?")


def _subschemas(schema: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    for key in _ONE_SCHEMA:
        if isinstance(schema.get(key), dict):
            yield schema[key], f"{path}/{key}"
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield sub, f"{path}/{key}/{name}"
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield sub, f"{path}/{key}/{i}"


def unsupported_schema_features(schema: Any) -> list[str]:
    """What a JSON schema asks that constrained decoding cannot enforce, as ``"keyword at
    path"`` (empty when all of it can be): keywords xgrammar would ignore, ``uniqueItems``,
    ``multipleOf`` on non-integers, and references other than local JSON pointers."""
    found: list[str] = []
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in sorted(UNSUPPORTED_KEYWORDS & node.keys()):
            found.append(f"{key} at {path}")
        if node.get("uniqueItems") is True:
            found.append(f"uniqueItems at {path}")
        if "multipleOf" in node and node.get("type") != "integer":
            found.append(f"multipleOf on a non-integer at {path}")
        ref = node.get("$ref")
        if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
            found.append(f"$ref {ref!r} (only local '#/...' references) at {path}")
        stack.extend(_subschemas(node, path))
    return found


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def _message(error: Exception, limit: int = 300) -> str:
    """xgrammar's error text without its C++ location prefix, on one line, cut to ``limit``
    characters (some quote the whole schema)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = _XGR_PREFIX.sub("", first)
    return first if len(first) <= limit else first[: limit - 3] + "..."


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and no change) when the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar has accepted a stop token: nothing more may follow."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (bit ``t % 32`` of word
        ``t // 32`` set when token ``t`` is allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarCompiler:
    """Compiles ``StructuredOutput`` specs against one vocabulary, keeping the most recently
    used ``cache_size`` compiled grammars by ``spec.key()``.

    ``token_bytes[i]`` is what token ``i`` adds to the output text (empty for special tokens,
    which the grammar then never allows); ``stop_token_ids`` end a finished grammar;
    ``vocab_size`` is the width of the logits (at least ``len(token_bytes)``; ids past the
    tokenizer's are never allowed).
    """

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        stop_token_ids: Iterable[int],
        vocab_size: int,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        import xgrammar as xgr

        vocab = list(token_bytes[:vocab_size])
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))

        def compiler(tokens: list[bytes]) -> Any:
            info = xgr.TokenizerInfo(
                tokens, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
            )
            return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

        self._compiler = compiler(vocab)
        # JSON never holds a raw control character (U+0000-U+001F), but xgrammar's strings of
        # bounded length admit them: JSON grammars get a vocabulary without the tokens that
        # hold one (no multi-byte UTF-8 sequence contains such a byte)
        self._json_compiler = compiler([b"" if _CONTROL.search(t) else t for t in vocab])
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.cache_size = cache_size
        self.num_compiled = 0
        self.num_cache_hits = 0

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of ``spec`` (from the cache when it was compiled before).
        ``InvalidParameterError`` (param ``structured_output``) when it is invalid, asks what
        cannot be enforced, or admits no output at all."""
        key = spec.key()
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return compiled
        compiled = self._compile(spec)
        self.num_compiled += 1
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> Any:
        import xgrammar as xgr

        kind = spec.kind
        if kind == "json_schema":
            bad = unsupported_schema_features(spec.json_schema)
            if bad:
                raise InvalidParameterError(
                    PARAM, f"the JSON schema uses what cannot be enforced: {'; '.join(bad[:5])}"
                )
        # every grammar goes through its EBNF text, made to admit valid UTF-8 only (utf8.py)
        try:
            if kind in ("json_schema", "json_object"):
                schema = spec.json_schema if kind == "json_schema" else {"type": "object"}
                ebnf = str(
                    xgr.Grammar.from_json_schema(
                        json.dumps(schema), any_whitespace=False, strict_mode=kind == "json_schema"
                    )
                )
                compiled = self._json_compiler.compile_grammar(valid_utf8(ebnf))
            elif kind == "regex":
                ebnf = str(xgr.Grammar.from_regex(spec.regex or ""))
                compiled = self._compiler.compile_grammar(valid_utf8(ebnf))
            elif kind == "choice":
                compiled = self._compiler.compile_grammar(choice_grammar(spec.choice or []))
            else:
                compiled = self._compiler.compile_grammar(valid_utf8(spec.grammar or ""))
        except (RuntimeError, ValueError, TypeError) as e:
            what = "JSON schema" if kind in ("json_schema", "json_object") else kind
            raise InvalidParameterError(PARAM, f"invalid {what}: {_message(e)}") from None
        # a grammar whose language is empty allows no first token, not even a stop token
        bitmask = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        if not bitmask.any():
            raise InvalidParameterError(PARAM, f"the {kind} admits no output at all")
        return compiled

    def admits_first(
        self, spec: StructuredOutput, token_ids: Iterable[int], stop_token_ids: Sequence[int]
    ) -> bool:
        """Whether ``spec``'s grammar admits some of ``token_ids`` as its first token (with
        ``stop_token_ids`` the tokens that may end it): False when sampling only among
        ``token_ids`` could not even begin an output the grammar accepts."""
        bitmask = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        self.matcher(spec, stop_token_ids).fill(bitmask, 0)
        words = bitmask[0].tolist()
        return any(0 <= t < self.vocab_size and (words[t // 32] >> (t % 32)) & 1 for t in token_ids)

    def matcher(
        self, spec: StructuredOutput, stop_token_ids: Sequence[int] | None = None
    ) -> GrammarMatcher:
        """A new matcher at the start of ``spec``'s grammar; ``stop_token_ids`` (default: the
        compiler's) are the tokens that may end it."""
        import xgrammar as xgr

        compiled = self.compile(spec)
        stops = None if stop_token_ids is None else sorted(set(stop_token_ids))
        matcher = GrammarMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=stops))
        if spec.starts_after is None:
            return matcher
        return GatedMatcher(matcher, spec.starts_after, spec.opened_by)


class GatedMatcher(GrammarMatcher):
    """A grammar that starts after a trigger: every token is allowed until the output has
    written ``trigger`` (token ids, in a row), then ``inner`` constrains the rest. Rolling back
    past the trigger closes the gate again (speculative verification). With ``opener`` (a token
    id): the gate is closed only if the output begins with it (a model that may or may not
    think first); any other first token is the grammar's, which constrains the output from its
    start, the opener allowed beside it."""

    __slots__ = ("history", "opened_at", "opener", "trigger")

    def __init__(
        self, inner: GrammarMatcher, trigger: Sequence[int], opener: int | None = None
    ) -> None:
        super().__init__(inner._matcher)
        self.trigger = list(trigger)
        self.opener = opener
        self.history: list[int] = []  # every token accepted
        self.opened_at: int | None = None  # len(history) when the trigger completed

    def _undecided(self) -> bool:
        """Whether the first token will say if the output thinks first (then the gate)."""
        return self.opener is not None and not self.history and self.opened_at is None

    def accept(self, token_id: int) -> bool:
        if self._undecided() and token_id != self.opener:
            self.opened_at = 0  # no reasoning: the grammar from the output's first token
        if self.opened_at is None:
            self.history.append(token_id)
            if self.history[-len(self.trigger) :] == self.trigger:
                self.opened_at = len(self.history)
            return True
        if not super().accept(token_id):
            return False
        self.history.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        keep = len(self.history) - num_tokens
        if self.opened_at is not None:
            super().rollback(len(self.history) - max(keep, self.opened_at))
            if keep < self.opened_at or (keep == 0 and self.opener is not None):
                self.opened_at = None  # (back to the start: undecided again)
        del self.history[keep:]

    @property
    def is_terminated(self) -> bool:
        return self.opened_at is not None and bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._undecided():
            super().fill(bitmask, row)
            assert self.opener is not None
            word, bit = divmod(self.opener, 32)
            bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)  # (int32 words)
        elif self.opened_at is None:
            bitmask[row] = -1  # free: every token
        else:
            super().fill(bitmask, row)


@dataclass(slots=True)
class GrammarMasks:
    """The token bitmasks of one step's logits: ``bitmask[i]`` for logits row ``i`` (all
    ones where unconstrained), ``rows`` the constrained ones."""

    bitmask: torch.Tensor  # int32 [logits rows, ceil(vocab / 32)], on the CPU
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        """Set every logit that its row's grammar does not allow to ``-inf``, in place."""
        import xgrammar as xgr

        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=logits.shape[-1], indices=self.rows
        )

    def allows_only(self, row: int, token_ids: Sequence[int]) -> bool:
        """Whether the grammar allows nothing at logits row ``row`` but some of ``token_ids``
        (then the request must end: ``min_tokens`` cannot hold it back)."""
        words = self.bitmask[row].clone()
        for t in token_ids:
            words[t // 32] &= ~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF
        return not bool(words.any())


def fill_masks(
    rows: Sequence[tuple[GrammarMatcher | None, Sequence[int]]], vocab_size: int
) -> GrammarMasks | None:
    """The bitmasks of a step in which each request occupies ``len(drafts) + 1`` consecutive
    logits rows (its last computed position, then each draft's): ``rows`` gives per request its
    matcher (None: unconstrained) and its draft tokens (empty without speculation). Draft
    position ``j`` is masked with the grammar's state after drafts ``1..j-1``; the rows after a
    draft the grammar refuses stay unmasked (that draft is masked out, so verification rejects
    it and never draws from them). Every matcher is left where it was. None when no request is
    constrained."""
    if all(m is None for m, _ in rows):
        return None
    total = sum(len(drafts) + 1 for _, drafts in rows)
    bitmask = torch.full((total, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    constrained: list[int] = []
    start = 0
    for matcher, drafts in rows:
        if matcher is not None:
            accepted = 0
            for j in range(len(drafts) + 1):
                matcher.fill(bitmask, start + j)
                constrained.append(start + j)
                if j == len(drafts) or not matcher.accept(drafts[j]):
                    break
                accepted += 1
            matcher.rollback(accepted)
        start += len(drafts) + 1
    return GrammarMasks(bitmask, constrained)
