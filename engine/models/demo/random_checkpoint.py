"""A tiny random-weights checkpoint (with a real byte-level BPE tokenizer) built on demand.

`tokenloom run` uses it when no `[model] name` is configured and the trained demo model cannot be
fetched (offline) or `[model] demo = "random"` pins it (engine/models/demo/choice.py): it needs no
download; the text it writes is gibberish and the CLI says so. Tests build their
Llama/Mistral/Qwen2/Qwen3 checkpoints with `build_random_checkpoint` too.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from tokenloom.engine.models.build_once import build_once

_CORPUS = """\
Once upon a time there was a small engine that batched many requests at once.
It read prompts from a file, wrote answers to another file, and never lost a line.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Numbers like 0 1 2 3 4 5 6 7 8 9 and symbols like , . ; : ! ? ( ) [ ] { } " ' - + = / * # % & @.
Tokens are pieces of text; a model predicts the next token from the ones before it.
"""

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

DEMO_CONFIG = dict(
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def build_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a built-in paragraph: any text (any UTF-8) round-trips."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def build_random_checkpoint(
    path: Path, architecture: str = "LlamaForCausalLM", seed: int = 0, dtype=torch.float32, **config_overrides
) -> Path:
    """Save a seeded random-initialised model of `architecture` plus the demo tokenizer at `path`."""
    path = Path(path)
    tokenizer = build_tokenizer()
    # Gemma 3's text-only model has its own config class; Gemma3Config is the multimodal one.
    config_name = {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(
        architecture, architecture.replace("ForCausalLM", "Config")
    )
    config_cls = getattr(transformers, config_name)
    values = dict(DEMO_CONFIG, vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=None)
    values.update(config_overrides)
    config = config_cls(**values)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(dtype)
    with transformers_progress_bars_off():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@contextlib.contextmanager
def transformers_progress_bars_off():
    """transformers draws a "Writing model shards" bar on stderr even for one small file: a building
    step of a command is reported by the command's own log lines, never by a library's bar."""
    was_enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers.utils.logging.enable_progress_bar()


def random_demo_checkpoint(cache_dir: Path) -> Path:
    """The random-weights demo model, built once into `cache_dir` and reused by every process
    (engine/models/build_once.py: the API and a worker starting together build it once)."""
    return build_once(
        Path(cache_dir) / "tokenloom-demo-llama", build_random_checkpoint, "the random-weights demo model"
    )
