"""Render docs/configuration.md from the config dataclasses, so the reference cannot drift.

Every key of every section in `SECTIONS` is listed with its type, default, allowed values, the
environment variable that overrides it and a one-line description. The description is the
trailing `# comment` on the field's line in the dataclass source; where a field has none, or
its comment only explains a special value ('0 = ...', '"" = ...'), the commented config.toml at
the repository root supplies what the key is. Nothing here is a third copy of the facts.

    python -m tokenloom.settings.reference > docs/configuration.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from functools import cache
from pathlib import Path
from typing import Any

from tokenloom.engine.config.fields import Bounds, field_specs, show
from tokenloom.settings.config import ENV_VARS, SECTIONS
from tokenloom.settings.text_values import BOOL_WORDS as ENV_BOOL_WORDS

__all__ = ["render_configuration_reference"]

# The commented defaults file; present in a checkout (editable install), absent from a wheel.
CONFIG_TOML = Path(__file__).resolve().parent.parent / "config.toml"

_KIND_NAMES = {"int": "integer", "float": "number", "bool": "boolean", "str": "string", "strs": "list of strings"}
# A comment that only says what one value means ('0 = disabled', '"" = same as name').
_VALUE_ONLY = re.compile(r'^(""|-?\d+(\.\d+)?|true|false)\s*=')
# Pointers into the source file that mean nothing on a docs page.
_SOURCE_POINTER = re.compile(r"[,;]?\s*see (below|above)\s*$")
# The allowed-values part of a config.toml comment; the page has its own column for it.
_TOML_RANGE = re.compile(r"^(an? )?(integer|number) in [\[(][^\]]*\](,\s*)?")
_TOML_TYPE_ONLY = re.compile(r"^(one of:.*|true or false)$")


@cache
def _source_comments(cls: type) -> tuple[str | None, dict[str, str]]:
    """(explicit docstring, {field: trailing comment}) read from the class's source."""
    source = textwrap.dedent(inspect.getsource(cls))
    trailing: dict[int, str] = {}
    code_on_line: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            if tok.start[0] in code_on_line:
                trailing[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_on_line.update(range(tok.start[0], tok.end[0] + 1))
    [node] = ast.parse(source).body
    assert isinstance(node, ast.ClassDef)
    comments = {
        stmt.target.id: trailing[stmt.end_lineno]
        for stmt in node.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.end_lineno in trailing
    }
    return ast.get_docstring(node), comments


def _toml_comment_text(line: str) -> str | None:
    """The trailing comment of a `key = value  # comment` line ('#' inside strings skipped)."""
    code = re.sub(r'"(\\.|[^"\\])*"|\'[^\']*\'', lambda m: " " * len(m.group(0)), line)
    hash_at = code.find("#")
    return line[hash_at + 1 :].strip() if hash_at >= 0 else None


@cache
def _toml_comments() -> dict[tuple[str, str], str]:
    """{(section, key): what config.toml's comment says the key is}, allowed values left out."""
    if not CONFIG_TOML.is_file():
        return {}
    found: dict[tuple[str, str], str] = {}
    section: str | None = None
    for line in CONFIG_TOML.read_text(encoding="utf-8").splitlines():
        head = re.match(r"^\[([A-Za-z0-9_]+)\]", line)
        if head:
            section = head.group(1)
            continue
        key = re.match(r"^([A-Za-z0-9_]+)\s*=", line)
        if not (key and section):
            continue
        comment = _toml_comment_text(line)
        if not comment:
            continue
        parts = []
        for part in comment.split("; "):
            part = _TOML_RANGE.sub("", part.strip())
            if part and not _TOML_TYPE_ONLY.match(part):
                parts.append(part)
        if parts:
            found[(section, key.group(1))] = "; ".join(parts)
    return found


def _description(section: str, cls: type, key: str) -> str:
    own = _SOURCE_POINTER.sub("", _source_comments(cls)[1].get(key, ""))
    from_toml = _toml_comments().get((section, key), "")
    if not own:
        return from_toml
    if _VALUE_ONLY.match(own) and from_toml:
        lead = from_toml.split("; ")[0]
        if lead not in own and not _VALUE_ONLY.match(lead):
            return f"{lead}; {own}"
    return own


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise TypeError(f"config field {field.name} has no default")


def _allowed(kind: str, bounds: Bounds) -> str:
    if bounds.choices:
        return ", ".join(f"`{choice}`" for choice in bounds.choices)
    if bounds.lo is not None:
        return f"{'(' if bounds.lo_open else '['}{bounds.lo}, {bounds.hi}]"
    return "`true`, `false`" if kind == "bool" else "any"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _env_var(section: str, key: str) -> str:
    [name] = [var for var, where in ENV_VARS.items() if where == (section, key)]
    return name


_INTRO = f"""\
# Configuration reference

<!-- Generated by `python -m tokenloom.settings.reference > docs/configuration.md` from the
config dataclasses (tokenloom.settings.config, tokenloom.engine.config) and the comments in
config.toml; edit those, not this page. tests/test_docs.py checks that they agree. -->

tokenloom reads its whole configuration once, at start-up. Each key comes from, in increasing
precedence: the built-in default, the config file, then an environment variable named
`TOKENLOOM_<SECTION>_<KEY>` (e.g. `TOKENLOOM_MODEL_MAX_MODEL_LEN=1024`). The config file is
`--config PATH`, else `$TOKENLOOM_CONFIG`, else `./config.toml` if it exists; every key is
optional. Unknown sections, keys or `TOKENLOOM_*` variables, wrong types and out-of-range values
stop start-up with a message naming the key and what it allows. In environment variables,
booleans are written {ENV_BOOL_WORDS} and lists comma-separated. Ranges: `[a, b]` includes
both ends, `(a, b]` excludes `a`.

Three variables are not keys: `TOKENLOOM_CONFIG` (the config file's path), the admin API key,
read from the variable that `[server] api_key_env` names (`TOKENLOOM_API_KEY` by default), and
`TOKENLOOM_CPU_ISA`, the instruction-set level the CPU kernels are built for (backends.md). The
repository's `config.toml` lists every key with its default. What `dtype = "auto"`,
`attention_backend` and the quantization methods choose on each device:
[backends.md](backends.md).
"""


def render_configuration_reference() -> str:
    """The Markdown of docs/configuration.md."""
    out = [_INTRO]
    for section, cls in SECTIONS.items():
        docstring, _ = _source_comments(cls)
        out.append(f"\n## [{section}]\n")
        if docstring:
            out.append(f"\n{' '.join(docstring.split())}\n")
        out.append("\n| key | type | default | allowed | environment variable | description |\n")
        out.append("| --- | --- | --- | --- | --- | --- |\n")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, (kind, bounds) in field_specs(cls).items():
            row = (
                f"`{key}`",
                _KIND_NAMES[kind],
                f"`{_cell(show(_default(fields[key])))}`",
                _cell(_allowed(kind, bounds)),
                f"`{_env_var(section, key)}`",
                _cell(_description(section, cls, key)),
            )
            out.append("| " + " | ".join(row) + " |\n")
    return "".join(out)


if __name__ == "__main__":
    print(render_configuration_reference(), end="")
