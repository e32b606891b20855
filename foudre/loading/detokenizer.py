"""Incremental detokenization with stop strings, one ``IncrementalDetokenizer`` per request.

Token ids arrive a few at a time; text leaves as deltas that are safe to show::

    ids:   ... prompt ... | output ids decoded and released | window still held |
                     prefix_offset        read_offset                     len(ids)
    text:  released deltas | held: may end in a broken UTF-8 sequence, or may be the
                           |       beginning of a stop string

Each call decodes only the window ``ids[prefix_offset:]`` (the last released tokens, for
context, plus the new ones) and releases what follows the context's own text once that text no
longer ends with U+FFFD; this works for any tokenizer (byte fallback, byte-level BPE, llama2.c).
"""

from __future__ import annotations

from collections.abc import Sequence

from foudre.loading.tokenizer import Tokenizer

# Prompt tokens decoded as context for the first output tokens (as vLLM does).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's output ids into text deltas, and stops at stop strings.

    Guarantees, for a prompt that ends on a character boundary (any prompt from ``encode``):

    - ``text`` is the concatenation of every delta returned by ``add_tokens`` and ``flush``.
    - After ``flush``, ``text`` equals the output's text in the context of its prompt,
      ``decode(prompt + output)[len(decode(prompt)):]``, cut before the stop string that
      completes first in that text (or after it with ``include_stop_str_in_output``). With an
      empty prompt that is ``decode(output)``. The prompt's own text is never included.
    - A delta from ``add_tokens`` never ends inside a UTF-8 sequence (so it holds U+FFFD only
      where the final text does) and never holds any part of a stop string: the longest tail
      of the text that a stop string could begin with is held back until it is decided.
    - Work per call is proportional to the new tokens plus a few tokens of context, plus the
      held-back text, never to the whole output.

    Once a stop string is found, ``stopped_by`` names it and further tokens are ignored.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: str | Sequence[str] | None = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        self.stop = [s for s in stops if s]  # an empty stop string would stop at once
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped_by: str | None = None
        self._ids = list(prompt_ids)
        self._prefix_offset = max(len(self._ids) - _PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached
        self._held = ""  # decoded, but may be the start of a stop string
        self._parts: list[str] = []  # released deltas, joined when ``text`` is read

    @property
    def text(self) -> str:
        """The output text released so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append output ids; return the text they make releasable (often ``""``)."""
        if self.stopped_by is not None:
            return ""
        self._ids.extend(new_ids)
        return self._release(self._decode_window(final=False), final=False)

    def flush(self) -> str:
        """Release everything held back, for a request that ended without a stop string."""
        if self.stopped_by is not None:
            return ""
        return self._release(self._decode_window(final=True), final=True)

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self.skip_special_tokens
        )

    def _decode_window(self, final: bool) -> str:
        """The text of the ids after ``read_offset`` once it is complete UTF-8 (or ``final``)."""
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._ids))
        if not final and (len(window) <= len(self._prefix_text) or window.endswith("\ufffd")):
            return ""  # nothing new yet, or a character still incomplete
        new_text = window[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        return new_text

    def _release(self, new_text: str, final: bool) -> str:
        held = self._held + new_text
        delta = held
        self._held = ""
        if self.stop:
            # The stop string that completes first wins (then the one that starts first), so
            # the result does not depend on how the ids were split into calls.
            found: tuple[int, int, str] | None = None
            for s in self.stop:
                at = held.find(s)
                if at >= 0 and (found is None or (at + len(s), at) < found[:2]):
                    found = (at + len(s), at, s)
            if found is not None:
                end, at, self.stopped_by = found
                delta = held[: end if self.include_stop_str_in_output else at]
            elif not final:
                keep = max((_overlap(held, s) for s in self.stop), default=0)
                delta, self._held = held[: len(held) - keep], held[len(held) - keep :]
        if delta:
            self._parts.append(delta)
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest proper prefix of ``stop`` that ``text`` ends with."""
    for k in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
