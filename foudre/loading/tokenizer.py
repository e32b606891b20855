"""Tokenizers behind one interface: Hugging Face ``tokenizer.json``, sentencepiece, llama2.c.

Every tokenizer also renders chat prompts: with the model's Jinja chat template when it has
one, else with the plain fallback format of ``Tokenizer.apply_chat_template``.
"""

from __future__ import annotations

import json
import re
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from foudre.loading.errors import ModelLoadError

_BYTE_PIECE = re.compile(rb"^<0x([0-9A-Fa-f]{2})>$")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class InvalidTextError(ValueError):
    """Text that no tokenizer can encode: it holds a lone UTF-16 surrogate, not valid Unicode.

    Such strings come from JSON escapes like ``"\\ud800"``; every ``Tokenizer.encode`` rejects
    them with this error rather than failing (or not) inside its library.
    """


def _raise_template_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _decoder_types(decoder: Any) -> set[str]:
    """The types of a ``tokenizer.json`` decoder and of every step of a ``Sequence`` one."""
    if not isinstance(decoder, dict):
        return set()
    found = {str(decoder.get("type"))}
    for step in decoder.get("decoders") or ():
        found |= _decoder_types(step)
    return found


def _write_tokenizer_config(directory: Path, values: dict[str, Any]) -> None:
    import json

    config = {k: v for k, v in values.items() if v is not None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


class Tokenizer(ABC):
    """Text <-> token ids, special ids, and chat prompt rendering.

    ``chat_template`` is a Jinja source in Hugging Face's convention, or None.
    """

    def __init__(self, chat_template: str | None = None) -> None:
        self.chat_template = chat_template
        self._compiled_template: Any = None
        self._takes_tools: bool | None = None

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS first if the model wants it.

        Raises ``InvalidTextError`` when ``text`` holds a lone surrogate (``_check_text``).
        """

    @staticmethod
    def _check_text(text: str) -> None:
        """Raise ``InvalidTextError`` if ``text`` holds a surrogate code point (U+D800-U+DFFF).

        Every ``encode`` calls this first, so all tokenizer classes reject the same inputs.
        """
        if text.isascii():  # O(1) in CPython: the common case costs nothing
            return
        found = _SURROGATE.search(text)
        if found is not None:
            raise InvalidTextError(
                f"text contains a lone surrogate (U+{ord(found.group()):04X} at index "
                f"{found.start()}) and is not valid Unicode"
            )

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD. Special tokens are dropped if asked.
        An id past the vocabulary (a model's padded rows: Phi-3's 32,064 over 32,011 pieces)
        decodes to empty text, as in llama.cpp and vLLM (``_known``)."""

    def _known(self, ids: Sequence[int]) -> Sequence[int]:
        """``ids`` without those outside ``0 .. vocab_size - 1``: a model whose vocabulary is
        padded past its tokenizer's can sample them, and they stand for no text."""
        n = self.vocab_size
        if not ids or (min(ids) >= 0 and max(ids) < n):
            return ids
        return [i for i in ids if 0 <= i < n]

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""

    @property
    @abstractmethod
    def bos_token_id(self) -> int | None: ...

    @property
    @abstractmethod
    def eos_token_id(self) -> int | None: ...

    @property
    @abstractmethod
    def all_special_ids(self) -> set[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` drops."""

    @property
    def bos_token(self) -> str | None:
        """The text of the BOS token (for chat templates), or None."""
        return None

    @property
    def eos_token(self) -> str | None:
        """The text of the EOS token (for chat templates), or None."""
        return None

    def token_bytes(self) -> list[bytes]:
        """What each token id adds to decoded text, as bytes (``vocab_size`` entries; empty for
        the special tokens that ``decode`` drops): the vocabulary a grammar is matched against
        in constrained decoding. This default decodes each token alone, exact for tokens that
        are whole characters; tokenizers with byte pieces override it."""
        special = self.all_special_ids
        return [
            b"" if i in special else self.decode([i], skip_special_tokens=False).encode()
            for i in range(self.vocab_size)
        ]

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    @property
    def chat_template_takes_tools(self) -> bool:
        """Whether the chat template renders tool definitions (it reads a ``tools`` variable,
        as Hugging Face's tool-calling templates do)."""
        if self.chat_template is None:
            return False
        if self._takes_tools is None:
            from jinja2 import meta
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            try:
                parsed = ImmutableSandboxedEnvironment().parse(self.chat_template)
                self._takes_tools = "tools" in meta.find_undeclared_variables(parsed)
            except Exception:  # a template that does not even parse takes nothing
                self._takes_tools = False
        return self._takes_tools

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``, and for tool calling
        ``tool_calls`` or ``tool_call_id``) as one prompt string.

        With a chat template: Hugging Face's rendering (sandboxed Jinja, ``trim_blocks`` and
        ``lstrip_blocks``, variables ``messages``, ``tools`` (OpenAI-style function
        definitions, or None), ``bos_token``, ``eos_token``, ``add_generation_prompt``, function
        ``raise_exception`` which raises ``jinja2.TemplateError``). Without one, the fallback
        format is one line ``"{role}: {content}\\n"`` per message, then ``"assistant:"`` when
        ``add_generation_prompt`` (tools are not shown). The result carries no BOS of its own
        unless the template writes one; encode it with ``add_special_tokens=False`` when it does.
        """
        if self.chat_template is None:
            lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return lines + ("assistant:" if add_generation_prompt else "")
        if self._compiled_template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = lambda x, indent=None: json.dumps(
                x, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = _raise_template_exception
            self._compiled_template = env.from_string(self.chat_template)
        return str(
            self._compiled_template.render(
                messages=messages,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                add_generation_prompt=add_generation_prompt,
            )
        )


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(config: dict[str, Any], directory: Path | None) -> str | None:
    """The template from ``chat_template.jinja`` (newer HF layout) or tokenizer_config.json."""
    if directory is not None and (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _read_tokenizer_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: invalid tokenizer config: {exc}", path) from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object", path)
    return data


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``) with its tokenizer_config.

    ``source`` is the ``tokenizer.json`` path, or a ``tokenizers.Tokenizer`` already built in
    memory (from GGUF metadata). BOS is added once when ``add_bos_token`` says so (or, absent
    that key, when the tokenizer.json post-processor adds it); never twice.
    """

    def __init__(self, source: Path | Any, config: dict[str, Any] | None = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        config = config or {}
        if isinstance(source, RustTokenizer):
            super().__init__(_chat_template(config, None))
            self._tok = source
        else:
            path = Path(source)
            super().__init__(_chat_template(config, path.parent))
            try:
                self._tok = RustTokenizer.from_file(str(path))
            except Exception as exc:  # tokenizers raises plain Exception for bad files
                raise ModelLoadError(f"{path}: cannot load tokenizer: {exc}", path) from exc
        self._bos_token = _token_text(config.get("bos_token"))
        self._eos_token = _token_text(config.get("eos_token"))
        self._bos_id = None if self._bos_token is None else self._tok.token_to_id(self._bos_token)
        self._eos_id = None if self._eos_token is None else self._tok.token_to_id(self._eos_token)
        with_special = self._tok.encode("a", add_special_tokens=True).ids
        without = self._tok.encode("a", add_special_tokens=False).ids
        self._post_adds_bos = (
            self._bos_id is not None
            and len(with_special) > len(without)
            and with_special[0] == self._bos_id
        )
        add_bos = config.get("add_bos_token")
        self._add_bos = self._post_adds_bos if add_bos is None else bool(add_bos)
        if self._add_bos and self._bos_id is None:
            self._add_bos = False
        self._special_ids = {
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        } | {i for i in (self._bos_id, self._eos_id) if i is not None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._check_text(text)
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._bos_id is not None:
            if self._add_bos and not self._post_adds_bos:
                ids.insert(0, self._bos_id)
            elif not self._add_bos and self._post_adds_bos and ids[:1] == [self._bos_id]:
                del ids[0]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = self._known(ids)
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_id

    @property
    def all_special_ids(self) -> set[int]:
        return set(self._special_ids)

    def token_bytes(self) -> list[bytes]:
        """Byte-level pieces (GPT-2, Llama 3, Qwen) mapped back to their bytes; sentencepiece
        style pieces with ``▁`` as a space and ``<0xNN>`` byte fallback; added tokens as their
        text (special ones empty); any other kind decoded token by token."""
        kinds = _decoder_types(json.loads(self._tok.to_str()).get("decoder"))
        added = self._tok.get_added_tokens_decoder()
        if not kinds & {"ByteLevel", "ByteFallback", "Metaspace", "Replace"}:
            out = super().token_bytes()
        else:
            out = [b""] * self.vocab_size
            table = _byte_level_table() if "ByteLevel" in kinds else {}
            for piece, i in self._tok.get_vocab(with_added_tokens=False).items():
                if i >= len(out):
                    continue
                if table and all(c in table for c in piece):
                    out[i] = bytes(table[c] for c in piece)
                elif m := _BYTE_PIECE.match(piece.encode()):
                    out[i] = bytes([int(m.group(1), 16)])
                else:
                    out[i] = piece.replace("\u2581", " ").encode()
        for i, token in added.items():
            if i < len(out):
                out[i] = b"" if token.special else token.content.encode()
        for i in self._special_ids:
            if i < len(out):
                out[i] = b""
        return out

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    def save(self, directory: Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
        self._tok.save(str(directory / "tokenizer.json"))
        _write_tokenizer_config(
            directory,
            {
                "bos_token": self._bos_token,
                "eos_token": self._eos_token,
                "add_bos_token": self._add_bos,
                "chat_template": self.chat_template,
            },
        )


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``.model`` (Llama 2 style): BOS added on encode unless told otherwise.

    ``source`` is the ``.model`` path, or the serialized model (``ModelProto`` bytes, as built
    from GGUF metadata). ``config`` may also carry ``bos_token_id`` / ``eos_token_id``, which
    then override the model's own. ``skip_special_tokens=False`` renders control tokens as their
    piece (``<s>``, ``</s>``).
    """

    def __init__(self, source: Path | bytes, config: dict[str, Any] | None = None) -> None:
        import sentencepiece

        config = config or {}
        self._sp = sentencepiece.SentencePieceProcessor()
        if isinstance(source, bytes):
            super().__init__(_chat_template(config, None))
            try:
                self._sp.LoadFromSerializedProto(source)
            except (OSError, RuntimeError) as exc:
                raise ModelLoadError(f"cannot build sentencepiece model: {exc}") from exc
        else:
            path = Path(source)
            super().__init__(_chat_template(config, path.parent))
            try:
                self._sp.Load(str(path))
            except (OSError, RuntimeError) as exc:
                raise ModelLoadError(
                    f"{path}: cannot load sentencepiece model: {exc}", path
                ) from exc
        bos = config.get("bos_token_id", self._sp.bos_id())
        eos = config.get("eos_token_id", self._sp.eos_id())
        self._bos_id = bos if isinstance(bos, int) and bos >= 0 else None
        self._eos_id = eos if isinstance(eos, int) and eos >= 0 else None
        add_bos = config.get("add_bos_token")
        self._add_bos = self._bos_id is not None and (add_bos is None or bool(add_bos))
        n = self._sp.get_piece_size()
        self._special_ids = {
            i for i in range(n) if self._sp.is_control(i) or self._sp.is_unknown(i)
        }

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._check_text(text)
        ids: list[int] = self._sp.encode(text)
        if add_special_tokens and self._add_bos and self._bos_id is not None:
            ids.insert(0, self._bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = self._known(ids)
        if skip_special_tokens:
            return str(self._sp.decode([i for i in ids if i not in self._special_ids]))
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if self._sp.is_control(i):
                parts.append(self._sp.decode(run))
                parts.append(self._sp.id_to_piece(i))
                run = []
            else:
                run.append(i)
        parts.append(self._sp.decode(run))
        return "".join(parts)

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_id

    @property
    def all_special_ids(self) -> set[int]:
        return set(self._special_ids)

    def token_bytes(self) -> list[bytes]:
        out = []
        for i in range(self.vocab_size):
            piece = str(self._sp.id_to_piece(i))
            if i in self._special_ids:
                out.append(b"")
            elif self._sp.is_byte(i) and (m := _BYTE_PIECE.match(piece.encode())):
                out.append(bytes([int(m.group(1), 16)]))
            else:
                out.append(piece.replace("\u2581", " ").encode())
        return out

    @property
    def bos_token(self) -> str | None:
        return None if self._bos_id is None else str(self._sp.id_to_piece(self._bos_id))

    @property
    def eos_token(self) -> str | None:
        return None if self._eos_id is None else str(self._sp.id_to_piece(self._eos_id))

    def save(self, directory: Path) -> None:
        """Write ``tokenizer.model`` and ``tokenizer_config.json`` into ``directory``."""
        (directory / "tokenizer.model").write_bytes(self._sp.serialized_model_proto())
        _write_tokenizer_config(
            directory,
            {
                "bos_token_id": self._bos_id,
                "eos_token_id": self._eos_id,
                "add_bos_token": self._add_bos,
                "chat_template": self.chat_template,
            },
        )


class Llama2cTokenizer(Tokenizer):
    """llama2.c's ``tokenizer.bin``, encoding and decoding exactly as ``run.c`` does.

    File: int32 max_token_length, then per token float32 score, int32 length, bytes. Ids 0, 1,
    2 are ``<unk>``, BOS, EOS; ``<0xNN>`` pieces are byte fallback.
    """

    UNK_ID = 0
    BOS_ID = 1
    EOS_ID = 2

    def __init__(self, path: Path) -> None:
        super().__init__(None)
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read tokenizer: {exc}", path) from exc
        pieces: list[bytes] = []
        scores: list[float] = []
        offset = 4
        try:
            while offset < len(data):
                score, length = struct.unpack_from("<fi", data, offset)
                offset += 8
                if length < 0 or offset + length > len(data):
                    raise struct.error(f"token {len(pieces)} has length {length}")
                pieces.append(data[offset : offset + length])
                scores.append(score)
                offset += length
        except struct.error as exc:
            raise ModelLoadError(
                f"{path}: corrupt or truncated llama2.c tokenizer at byte {offset}: {exc}", path
            ) from exc
        if len(pieces) <= self.EOS_ID:
            raise ModelLoadError(f"{path}: llama2.c tokenizer with {len(pieces)} tokens", path)
        self._pieces = pieces
        self._scores = scores
        self._lookup: dict[bytes, int] = {}
        for i, piece in enumerate(pieces):
            self._lookup.setdefault(piece, i)
        self._bytes: list[bytes] = []  # what each id decodes to, byte fallback resolved
        for piece in pieces:
            m = _BYTE_PIECE.match(piece)
            self._bytes.append(bytes([int(m.group(1), 16)]) if m else piece)
        # Each id's rank among the distinct scores, best first (equal scores share a rank), or
        # None when run.c never merges into it: its score is not above run.c's floor, -1e10.
        usable = sorted({s for s in scores if s > -1e10}, reverse=True)
        rank_of = {s: r for r, s in enumerate(usable)}
        self._ranks: list[int | None] = [rank_of[s] if s > -1e10 else None for s in scores]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """run.c's encoding, in O(n log n) rather than its O(n^2) rescan per merge.

        The dummy space first, one id per character (UTF-8 byte fallback for characters not in
        the vocabulary), then, as long as some adjacent pair's concatenated pieces form a token
        scoring above -1e10, merge the best-scoring such pair, the leftmost on ties.
        """
        self._check_text(text)
        tokens = [self.BOS_ID] if add_special_tokens else []
        if text:
            tokens += self._merge(self._symbols(text))
        return tokens

    def _symbols(self, text: str) -> list[int]:
        """The ids before any merge: the dummy space, then each character or its UTF-8 bytes."""
        lookup = self._lookup
        ids = [lookup.get(b" ", 0x20 + 3)]  # run.c's dummy prefix
        known: dict[str, list[int]] = {}  # per distinct character: its ids
        for char in text:
            found = known.get(char)
            if found is None:
                utf8 = char.encode("utf-8")
                single = lookup.get(utf8)
                # byte fallback: <0x00> is id 3
                found = known[char] = [single] if single is not None else [b + 3 for b in utf8]
            ids += found
        return ids

    def _merge(self, ids: list[int]) -> list[int]:
        """Apply run.c's merges to ``ids`` (consumed) with a heap of candidate pairs.

        Symbols form a doubly linked list over the positions of ``ids``; a merge keeps the left
        symbol's position, so positions stay in text order. A candidate is the int
        ``(rank * span + left) * span + pushed``: the merged token's score rank (0 = best),
        the left symbol's position, then the merge count when it was pushed; the smallest
        key is thus the best score, leftmost on ties, exactly run.c's choice by full rescan.
        Candidates are invalidated lazily: one is stale, and dropped when popped, if either
        of its symbols changed (merged or was absorbed) after it was pushed.
        """
        from heapq import heapify, heappop, heappush

        n = len(ids)
        if n < 2:
            return ids
        pieces, lookup, ranks = self._pieces, self._lookup, self._ranks
        span = n + 1  # above every position and every merge count
        heap: list[int] = []
        pair_ranks: dict[tuple[int, int], int | None] = {}  # the text repeats its pairs
        for at in range(n - 1):
            pair = (ids[at], ids[at + 1])
            if pair in pair_ranks:
                rank = pair_ranks[pair]
            else:
                merged = lookup.get(pieces[pair[0]] + pieces[pair[1]])
                rank = pair_ranks[pair] = None if merged is None else ranks[merged]
            if rank is not None:
                heap.append((rank * span + at) * span)
        heapify(heap)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        changed = [0] * n  # merge count at a symbol's last change; span once absorbed
        merges = 0
        while heap:
            rest, pushed = divmod(heappop(heap), span)
            left = rest % span
            right = nxt[left]  # the candidate's right symbol, unless left changed since
            if changed[left] > pushed or right < 0 or changed[right] > pushed:
                continue
            merged = lookup[pieces[ids[left]] + pieces[ids[right]]]
            merges += 1
            ids[left] = merged
            changed[left] = merges
            changed[right] = span
            after = nxt[left] = nxt[right]
            if after >= 0:
                prv[after] = left
                candidate = lookup.get(pieces[merged] + pieces[ids[after]])
                if candidate is not None and (rank := ranks[candidate]) is not None:
                    heappush(heap, (rank * span + left) * span + merges)
            before = prv[left]
            if before >= 0:
                candidate = lookup.get(pieces[ids[before]] + pieces[merged])
                if candidate is not None and (rank := ranks[candidate]) is not None:
                    heappush(heap, (rank * span + before) * span + merges)
        out: list[int] = []
        at = 0  # position 0 is never absorbed: it has no left neighbour
        while at >= 0:
            out.append(ids[at])
            at = nxt[at]
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        prev = -1
        for i in self._known(ids):
            if not (skip_special_tokens and i in (self.UNK_ID, self.BOS_ID, self.EOS_ID)):
                if prev == self.BOS_ID and self._pieces[i].startswith(b" "):
                    out += self._pieces[i][1:]  # run.c strips the space after BOS
                else:
                    out += self._bytes[i]
            prev = i
        return out.decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS_ID

    @property
    def eos_token_id(self) -> int | None:
        return self.EOS_ID

    @property
    def all_special_ids(self) -> set[int]:
        return {self.UNK_ID, self.BOS_ID, self.EOS_ID}

    def token_bytes(self) -> list[bytes]:
        special = self.all_special_ids
        return [b"" if i in special else piece for i, piece in enumerate(self._bytes)]
