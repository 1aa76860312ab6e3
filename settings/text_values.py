"""A config key's value written as text (an environment variable, a sweep's command-line values).

TOML carries real types; text does not, so the settings turn text into the key's kind here before
the engine's sections check its bounds.
"""

from __future__ import annotations

from typing import Any

_TRUE_WORDS = frozenset({"true", "1", "yes"})
_FALSE_WORDS = frozenset({"false", "0", "no"})
BOOL_WORDS = "true/false/1/0/yes/no"


def parse_text_value(kind: str, text: str) -> Any:
    """Parse `text` as a value of `kind` ("int", "float", "bool", "strs", "str"); ValueError if it
    does not parse (bounds are checked later, by the section that receives it)."""
    if kind == "int":
        return int(text.strip(), 10)
    if kind == "float":
        return float(text.strip())
    if kind == "bool":
        word = text.strip().lower()
        if word in _TRUE_WORDS or word in _FALSE_WORDS:
            return word in _TRUE_WORDS
        raise ValueError(f"not one of {BOOL_WORDS}")
    if kind == "strs":
        return tuple(part.strip() for part in text.split(",") if part.strip())
    return text
