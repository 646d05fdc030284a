"""How a model pools, read from the sentence-transformers files shipped beside its weights.

`modules.json` lists the model's modules in order: the transformer, then a `Pooling` module (its
folder's `config.json` says which pooling), then an optional `Normalize` (L2). `sentence_bert_config.json`
gives the longest input it was trained on (`max_seq_length`), which caps max_model_len as in vLLM.
Modules we do not compute (a `Dense` projection, say) are refused: the vectors would be wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmserve.model_executor.pooler import PoolerConfig, PoolingType

_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"
# Pooling's config: each boolean flag, and the `pooling_mode` spelling of newer releases
_MODE_FLAGS: dict[str, PoolingType] = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_MODE_NAMES: dict[str, PoolingType] = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


@dataclass(frozen=True)
class SentenceTransformersConfig:
    pooler: PoolerConfig
    max_seq_length: int | None  # None: not stated


def read_sentence_transformers(folder: Path) -> SentenceTransformersConfig | None:
    """The pooling of the model in `folder`, or None when it has no `modules.json`. `ValueError` for
    files we cannot read, or modules we do not compute."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} must hold a list of modules.")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
    unknown = [k for k in kinds if k not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if unknown or kinds.count(_POOLING) != 1:
        raise ValueError(
            f"{modules_file} lists the modules {', '.join(kinds)}; llmserve computes a Transformer, one "
            "Pooling and an optional Normalize."
        )
    pooling = next(m for m, k in zip(modules, kinds) if k == _POOLING)
    pooling_file = folder / str(pooling.get("path", "")) / "config.json"
    pooler = PoolerConfig(_pooling_type(_read_json(pooling_file), pooling_file), _NORMALIZE in kinds)
    bert_config = folder / "sentence_bert_config.json"
    max_seq_length = _read_json(bert_config).get("max_seq_length") if bert_config.is_file() else None
    return SentenceTransformersConfig(pooler, int(max_seq_length) if max_seq_length else None)


def _pooling_type(config: Any, path: Path) -> PoolingType:
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    mode = config.get("pooling_mode")
    if isinstance(mode, str) and mode in _MODE_NAMES:
        return _MODE_NAMES[mode]
    chosen = [name for flag, name in _MODE_FLAGS.items() if config.get(flag)]
    others = sorted(
        k for k, v in config.items() if k.startswith("pooling_mode") and v and k not in _MODE_FLAGS
    )
    if len(chosen) != 1 or others:
        raise ValueError(
            f"{path} asks for the pooling {', '.join(chosen + others) or 'none'}; llmserve pools with "
            "exactly one of mean, cls and lasttoken."
        )
    return chosen[0]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"Cannot read {path}: {e}") from e


def load_pooler_config(folder: Path | None, encoder: bool) -> SentenceTransformersConfig:
    """The model's sentence-transformers pooling where it ships one (`folder`: its HF folder), else
    vLLM's defaults: CLS for an encoder, LAST for a decoder, normalised."""
    found = read_sentence_transformers(folder) if folder is not None else None
    if found is not None:
        return found
    return SentenceTransformersConfig(PoolerConfig("CLS" if encoder else "LAST", True), None)
