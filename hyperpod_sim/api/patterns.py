"""botocore's patterns in Python: Java regular expressions that AWS applies as full matches.

The service models carry Java's dialect (``\\uD800\\uDC00`` surrogate pairs, ASCII ``\\d``/``\\w``/
``\\s``, a ``.`` that stops at every Java line terminator); :func:`java_to_python_pattern` turns
it into the ``regex`` module's, and :func:`pattern_matches` applies it as AWS does.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import regex

__all__ = ["java_to_python_pattern", "pattern_matches"]

_SURROGATE_PAIR = re.compile(r"\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})", re.IGNORECASE)

# Java's predefined classes are ASCII unless UNICODE_CHARACTER_CLASS is set; Python's (and the
# regex module's) are Unicode. `.` in Java excludes every line terminator, not only "\n".
_OUTSIDE_CLASS = {
    ".": "[^\\n\\r\\u0085\\u2028\\u2029]",
    "\\d": "[0-9]",
    "\\D": "[^0-9]",
    "\\w": "[a-zA-Z0-9_]",
    "\\W": "[^a-zA-Z0-9_]",
    "\\s": "[ \\t\\n\\x0b\\f\\r]",
    "\\S": "[^ \\t\\n\\x0b\\f\\r]",
}
_INSIDE_CLASS = {
    "\\d": "0-9",
    "\\w": "a-zA-Z0-9_",
    "\\s": " \\t\\n\\x0b\\f\\r",
}


def _combine_surrogates(match: re.Match[str]) -> str:
    high, low = int(match.group(1), 16), int(match.group(2), 16)
    return f"\\U{0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00):08X}"


def _pattern_tokens(source: str) -> list[tuple[str, int | None]]:
    """Split a pattern into escapes and single characters, each tagged with its character class.

    The tag is the index of the outermost ``[...]`` the token sits in (None outside any class);
    the brackets themselves carry their class's tag too.
    """
    tokens: list[tuple[str, int | None]] = []
    depth = 0  # Java classes nest: [a-z[0-9]]
    classes = 0
    i = 0
    while i < len(source):
        char = source[i]
        token = char
        if char == "\\" and i + 1 < len(source):
            token = source[i : i + 2]
            if token[1] in "pP" and source[i + 2 : i + 3] == "{":
                close = source.find("}", i + 2)
                token = source[i : close + 1] if close != -1 else source[i:]
        consumed = len(token)
        if char == "[":
            if not depth:
                classes += 1
            depth += 1
            # A "]" right after "[" or "[^" is a literal, not the end of the class.
            if source[i + 1 : i + 2] == "^":
                token, consumed = "[^", 2
            if source[i + consumed : i + consumed + 1] == "]":
                token, consumed = token + "\\]", consumed + 1
        tag = classes - 1 if depth else None
        if char == "]" and depth:
            depth -= 1
        tokens.append((token, tag))
        i += consumed
    return tokens


def java_to_python_pattern(pattern: str) -> str:
    """Translate the Java-isms botocore's patterns use into the ``regex`` module's dialect.

    UTF-16 surrogate pairs (``\\uD800\\uDC00``) become code points, ``.`` stops at every Java
    line terminator, and ``\\d``/``\\w``/``\\s`` and their negations become ASCII classes (Java's
    default). A character class holding a negated escape (``[\\S\\s]``) is left as it is, since
    a negation cannot be spelled out inside a class; it keeps Python's Unicode meaning there.
    """
    tokens = _pattern_tokens(_SURROGATE_PAIR.sub(_combine_surrogates, pattern))
    verbatim = {tag for token, tag in tokens if tag is not None and token in ("\\D", "\\W", "\\S")}
    out: list[str] = []
    for token, tag in tokens:
        if tag is None:
            out.append(_OUTSIDE_CLASS.get(token, token))
        elif tag in verbatim:
            out.append(token)
        else:
            out.append(_INSIDE_CLASS.get(token, token))
    return "".join(out)


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> Any:
    """The compiled form of a model pattern, or None when it cannot be expressed (not checked)."""
    try:
        return regex.compile(java_to_python_pattern(pattern))
    except regex.error:
        return None


def pattern_matches(pattern: str, value: str) -> bool:
    """Whether ``value`` satisfies a model pattern the way AWS applies it (a full match)."""
    compiled = _compiled(pattern)
    return compiled is None or compiled.fullmatch(value) is not None
