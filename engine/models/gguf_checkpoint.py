"""A GGUF file as a normal checkpoint: dequantized by transformers once, then read from the cache.

tokenloom's loader reads config.json + safetensors. A GGUF file (llama.cpp's format) holds the
same model quantized (Q4_1, Q8_0, K-quants...) with its tokenizer and chat template in metadata.
transformers' GGUF loader dequantizes the tensors and rebuilds the config and tokenizer; we save
that result with `save_pretrained` into `<cache>/gguf/<sha256 prefix>-<file stem>` and hand the
loader that directory. Keyed by the file's content, so a renamed copy reuses the conversion and
an edited file gets a fresh one. Built once under a file lock (engine/models/build_once.py), so a
worker and the API starting together convert it once and never read a half-written checkpoint.

The weights are saved in float32: dequantized values are exact there (the scales are float16,
so bfloat16 would round them), and `[model] dtype` still picks what the engine runs in.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import time
from pathlib import Path

import torch

from tokenloom.engine.models.build_once import build_once, is_built

log = logging.getLogger("tokenloom.engine")

# llama.cpp's `general.architecture` -> the tokenloom family it becomes, for the families both
# transformers' GGUF loader and tokenloom's decoder support. (llama.cpp writes Mistral as "llama".)
GGUF_FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


class GgufError(ValueError):
    """A GGUF file tokenloom cannot use; the message says why and what to do instead."""


def gguf_file_in(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a directory that has no
    config.json (a directory with config.json is an ordinary checkpoint). None when it is neither."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(files) > 1:
        raise GgufError(
            f"{path} holds {len(files)} .gguf files ({', '.join(p.name for p in files[:4])}): "
            "set [model] name to the one file to load"
        )
    return files[0] if files else None


def converted_checkpoint(gguf_file: Path, cache_dir: Path) -> Path:
    """The checkpoint directory converted from `gguf_file`, converting it on first use."""
    gguf_file = Path(gguf_file).resolve()
    target = Path(cache_dir) / "gguf" / f"{_sha256(gguf_file)[:16]}-{gguf_file.stem}"
    if not is_built(target):
        log.info(
            "converting %s into a checkpoint at %s: one time, its tensors are dequantized to float32", gguf_file, target
        )
        started = time.monotonic()
        convert_gguf(gguf_file, target)
        log.info("converted %s in %.0f s (cached for later starts)", gguf_file.name, time.monotonic() - started)
    return target


def convert_gguf(gguf_file: Path, target: Path) -> Path:
    """Dequantize `gguf_file` into a checkpoint directory at `target`, once (engine/models/build_once.py)."""
    check_gguf(gguf_file)
    return build_once(target, lambda out: write_dequantized(gguf_file, out), f"the conversion of {gguf_file.name}")


def write_dequantized(gguf_file: Path, out: Path) -> None:
    """Dequantize `gguf_file` into the checkpoint directory `out` (no cache, no lock: the caller's)."""
    check_gguf(gguf_file)
    _save_dequantized(gguf_file, out)


def check_gguf(gguf_file: Path) -> None:
    """Refuse, before any tensor is read, a file that is no GGUF, a family tokenloom does not run,
    or a quantization type that gguf cannot dequantize."""
    from gguf import GGUFReader
    from gguf.quants import GGMLQuantizationType, _type_traits

    try:
        reader = GGUFReader(gguf_file)
    except Exception as exc:  # bad magic, truncated header, ...
        raise GgufError(
            f"{gguf_file} is not a readable GGUF file ({exc}): point [model] name at a .gguf file "
            "written by llama.cpp's converter, or at a checkpoint directory"
        ) from exc
    field = reader.get_field("general.architecture")
    architecture = field.contents() if field is not None else None
    if architecture not in GGUF_FAMILIES:
        raise GgufError(
            f"{gguf_file} holds a {architecture!r} model; tokenloom loads GGUF files of the "
            f"{', '.join(GGUF_FAMILIES)} families: use one of those, or the model's Hugging Face "
            "checkpoint (config.json + *.safetensors)"
        )
    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    unreadable = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in readable})
    if unreadable:
        raise GgufError(
            f"{gguf_file} uses quantization type(s) {', '.join(unreadable)}, which the installed gguf package "
            "cannot dequantize: use a GGUF file quantized as Q4_0/Q4_1/Q5_*/Q8_0/K-quants/F16, or upgrade gguf"
        )


def _save_dequantized(gguf_file: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenloom.engine.models.demo.random_checkpoint import transformers_progress_bars_off

    folder, name = str(gguf_file.parent), gguf_file.name
    # transformers' GGUF reader draws its own tqdm bar, which no transformers switch turns off; the
    # conversion is announced by our own log lines, so the bar's stderr writes are dropped.
    with transformers_progress_bars_off(), contextlib.redirect_stderr(io.StringIO()):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # The tensors are plain float32 now; transformers still marks the model "gguf-quantized"
        # and refuses to save it unless both marks are dropped.
        # transformers sets hf_quantizer without declaring it, so mypy checks nn.Module.__setattr__ (Tensor | Module)
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # with the chat template (chat_template.jinja)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()
