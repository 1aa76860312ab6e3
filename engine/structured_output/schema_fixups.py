"""JSON-schema rewrites applied before xgrammar compiles a schema, for constructs it gets wrong.

xgrammar 0.2.9 compiles a string with `minLength`/`maxLength` to `"[^"\\\\\\r\\n]{min,max}"`: that
admits raw control characters (0x00-0x1F), which JSON forbids inside strings, so a model could emit
output that no JSON parser accepts. Such a string is given the equivalent `pattern`
`^[^\\x00-\\x1f"\\\\]{min,max}$` instead, which xgrammar compiles as a JSON string regex: the same
lengths, no control characters (and, as before, no quotes or backslashes inside the string).
A string that already has a `pattern`, `format`, `enum` or `const` is left as it is.
"""

from __future__ import annotations

import copy

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "unevaluatedItems", "unevaluatedProperties", "propertyNames")


def fixed_schema(schema: dict) -> dict:
    """A copy of `schema` with the rewrites above (the caller's schema is not modified)."""
    schema = copy.deepcopy(schema)
    _visit(schema)
    return schema


def _visit(node) -> None:
    if not isinstance(node, dict):
        return
    if node.get("type") == "string" and ("minLength" in node or "maxLength" in node) \
            and not ({"pattern", "format", "enum", "const"} & set(node)):
        low = int(node.get("minLength", 0))
        high = node.get("maxLength")
        node["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{"" if high is None else int(high)}}}$'
    for key in _SUBSCHEMA_LISTS:
        for child in node.get(key, ()) if isinstance(node.get(key), list) else ():
            _visit(child)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for child in node[key].values():
                _visit(child)
    for key in _SUBSCHEMA_ONE:
        _visit(node.get(key))
