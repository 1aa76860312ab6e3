"""A correction to the grammar xgrammar builds for a JSON schema, for a construct it gets wrong.

xgrammar 0.2.9 compiles a string with `minLength`/`maxLength` to a repetition of the character
class `[^"\\\\\\r\\n]`: that admits raw control characters (0x00-0x1F), which JSON forbids inside
strings, so a model could emit output no JSON parser accepts. The grammar's EBNF text is patched to
use `[^\\0-\\x1f"\\\\]` there and parsed again: the same repetition bounds, so the same per-token
cost (rewriting the string as a `pattern` regex instead measured 300x slower per token at
maxLength 400). tests/engine/structured_output/test_structured_output.py checks the result never admits a control
character, so an xgrammar that prints its grammar differently fails a test instead of passing one.
"""

from __future__ import annotations

UNSAFE_STRING_CHARACTER = r"[^\"\\\r\n]"
SAFE_STRING_CHARACTER = r"[^\0-\x1f\"\\]"


def safe_json_grammar(grammar):
    """`grammar` (an xgrammar Grammar from a JSON schema) with every length-bounded string's
    character class made to exclude control characters; the same object when none is there."""
    import xgrammar as xgr

    text = str(grammar)
    if UNSAFE_STRING_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(UNSAFE_STRING_CHARACTER, SAFE_STRING_CHARACTER))
