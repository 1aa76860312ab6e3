"""`tokenloom sweep KEY VALUES`: the values of one config key, as typed on the command line."""

from __future__ import annotations

from tokenloom.engine.config import ENGINE_SECTIONS, ConfigError, EngineConfig
from tokenloom.engine.config.fields import field_specs
from tokenloom.offline.sweep import apply
from tokenloom.settings.text_values import parse_text_value


def parse_values(key: str, spec: str) -> list:
    """'0.6:0.95:0.05' (inclusive range) or 'a,b,c' -> typed values of `key`, each validated.

    For quantization.method, "none" means quantization disabled.
    """
    section, kind = _key_kind(key)
    if ":" in spec and kind in ("int", "float"):
        parts = spec.split(":")
        if len(parts) != 3:
            raise ConfigError(f"sweep values {spec!r}: write START:STOP:STEP, e.g. 0.60:0.95:0.05", key)
        start, stop, step = (parse_text_value(kind, p) for p in parts)
        if step <= 0 or stop < start:
            raise ConfigError(f"sweep values {spec!r}: STEP must be > 0 and STOP >= START", key)
        count = int(round((stop - start) / step)) + 1
        values = [start + i * step for i in range(count)]
        values = [round(v, 10) if kind == "float" else int(v) for v in values]
    else:
        values = [
            v.strip() if v.strip() == "none" and key == "quantization.method" else parse_text_value(kind, v)
            for v in spec.split(",")
            if v.strip()
        ]
    if not values:
        raise ConfigError(f"sweep values {spec!r}: no values", key)
    probe = EngineConfig()
    for value in values:
        apply(probe, key, value)  # raises ConfigError naming the key and its range
    return values


def _key_kind(key: str) -> tuple[str, str]:
    section, _, name = key.partition(".")
    if section not in ENGINE_SECTIONS or not name:
        raise ConfigError(f"sweep key {key!r} is not SECTION.KEY (sections: {', '.join(ENGINE_SECTIONS)})", key)
    specs = field_specs(ENGINE_SECTIONS[section])
    if name not in specs:
        raise ConfigError(f"sweep key {key!r}: [{section}] has no key {name!r} (keys: {', '.join(specs)})", key)
    return section, specs[name][0]
