"""Grammars that only admit valid UTF-8.

xgrammar matches a character class against UTF-8 bytes, and it decodes the code points
U+D800-U+DFFF (UTF-16 surrogates) like any other: a class such as JSON's string character
``[^"\\\r\n]`` or a regex's ``.`` then admits ``ED A0 80`` to ``ED BF BF``, which is not UTF-8.
A string sampled through such bytes decodes to U+FFFD replacement characters (and breaks the
``maxLength`` that counted one character for three). Overlong forms and code points past
U+10FFFF are refused by xgrammar already; surrogates are the one gap.

``valid_utf8(ebnf)`` closes it: every character class of an EBNF grammar, and of the regexes it
embeds (``Regex("...")``, as JSON schemas' ``pattern`` and ``format`` compile), leaves out the
surrogates. A negated class gets them added to what it excludes; a positive range over them is
split around them; a regex's ``.`` becomes every code point but them.
"""

from __future__ import annotations

import json
import re

SURROGATES = (0xD800, 0xDFFF)
_NOT_SURROGATE = r"\ud800-\udfff"
_ANY_BUT_SURROGATE = r"[^\ud800-\udfff]"

# in an EBNF text: an embedded regex, a string literal (left alone), or a character class
_EBNF_PART = re.compile(
    r'(?P<regex>Regex\(\s*"(?P<body>(?:\\.|[^"\\])*)")'
    r'|(?P<string>"(?:\\.|[^"\\])*")'
    r"|(?P<cls>\[(?:\\.|[^\]\\])*\])"
)
# in a regex: an escape, a character class, or a dot
_REGEX_PART = re.compile(r"(?P<escape>\\.)|(?P<cls>\[\^?\]?(?:\\.|[^\]\\])*\])|(?P<dot>\.)")
# one item of a class: an escape (\xHH, \uHHHH, \UHHHHHHHH, \n, \], ...) or one character
_ITEM = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)|[^\\]", re.DOTALL)
_SIMPLE_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "0": 0x00, "f": 0x0C, "v": 0x0B}


def _code_point(item: str) -> int | None:
    """The code point of one class item (None for a class escape such as ``\\d``)."""
    if not item.startswith("\\"):
        return ord(item)
    kind = item[1]
    if kind in "xuU" and len(item) > 2:
        return int(item[2:], 16)
    if kind in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[kind]
    if kind.isalnum():  # \d, \w, \s, ...: a set, not one code point
        return None
    return ord(kind)


def _class_items(body: str) -> str:
    """A positive class body without the surrogates: a range over them is split around them,
    a lone surrogate dropped."""
    items = _ITEM.findall(body)
    out: list[str] = []
    i = 0
    low, high = SURROGATES
    while i < len(items):
        first = items[i]
        if i + 2 < len(items) and items[i + 1] == "-":
            last = items[i + 2]
            a, b = _code_point(first), _code_point(last)
            i += 3
            if a is None or b is None or b < low or a > high:
                out.append(f"{first}-{last}")
                continue
            if a < low:
                out.append(f"{first}-\\ud7ff")
            if b > high:
                out.append(f"\\ue000-{last}")
            continue
        point = _code_point(first)
        if point is None or not low <= point <= high:
            out.append(first)
        i += 1
    return "".join(out)


def _valid_class(cls: str) -> str:
    """One character class (``[...]`` or ``[^...]``) that admits no surrogate."""
    if cls.startswith("[^"):
        return f"[^{cls[2:-1]}{_NOT_SURROGATE}]"
    body = _class_items(cls[1:-1])
    return f"[{body}]" if body else cls


def valid_utf8_regex(regex: str) -> str:
    """``regex`` whose classes and dots admit no surrogate (so no invalid UTF-8)."""

    def fix(m: re.Match[str]) -> str:
        if m.group("cls") is not None:
            return _valid_class(m.group("cls"))
        if m.group("dot") is not None:
            return _ANY_BUT_SURROGATE
        return m.group(0)

    return _REGEX_PART.sub(fix, regex)


def valid_utf8(ebnf: str) -> str:
    """``ebnf`` (xgrammar's EBNF) with every character class, its embedded regexes' included,
    admitting no surrogate: the grammar's language is then valid UTF-8 only."""

    def fix(m: re.Match[str]) -> str:
        if m.group("cls") is not None:
            return _valid_class(m.group("cls"))
        if m.group("regex") is not None:
            try:
                regex = json.loads(f'"{m.group("body")}"')
            except json.JSONDecodeError:  # an escape JSON does not know: left as it is
                return m.group(0)
            literal = json.dumps(valid_utf8_regex(regex), ensure_ascii=False)
            return m.group(0)[: m.start("body") - m.start()] + literal[1:-1] + '"'
        return m.group(0)

    return _EBNF_PART.sub(fix, ebnf)
