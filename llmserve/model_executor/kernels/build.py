"""Compiling the kernels' C sources into one shared library per instruction set and flag set, cached.

Every build compiles with `-Wall -Wextra`; two variables change the flags, and so the cached file:
- `LLMSERVE_KERNEL_WERROR=1` makes a warning an error (the tests set it, so new warnings fail them);
- `LLMSERVE_KERNEL_SANITIZE=address,undefined` builds with those sanitizers (see
  tests/model_executor/test_native_build.py for how such a library is run).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE_DIR = Path(__file__).parent
BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-Wall", "-Wextra"]


class BuildError(RuntimeError):
    """The compiler is missing or failed; the message holds its command and output."""


def cache_dir() -> Path:
    root = os.environ.get("LLMSERVE_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(root).expanduser() / "llmserve" / "kernels"


def compile_flags(isa_flags: list[str]) -> list[str]:
    """A build's flags: ours, the instruction set's `isa_flags`, and what the environment asks."""
    flags = [*BASE_FLAGS, *isa_flags]
    if os.environ.get("LLMSERVE_KERNEL_WERROR") == "1":
        flags.append("-Werror")
    sanitize = os.environ.get("LLMSERVE_KERNEL_SANITIZE")
    if sanitize:
        # -O1 last: instrumented at -O3 these sources compile some 20 times slower, and the C they mean is
        # the same (which vector code is built depends on -march, not -O).
        flags += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-O1"]
    return flags


def build(isa: str, isa_flags: list[str]) -> Path:
    """The library for `isa`, compiled now unless a build of the same sources, compiler and flags is
    cached; raises BuildError with the compiler's output."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise BuildError("No C compiler found (set CC).")
    sources = sorted(SOURCE_DIR.glob("*.c"))
    flags = compile_flags(isa_flags)
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources + sorted(SOURCE_DIR.glob("*.h"))))
    key.update(" ".join([compiler, *flags]).encode())
    target = cache_dir() / f"llmserve_kernels-{isa}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.stem}.{os.getpid()}.partial")
    command = [compiler, *flags, "-o", str(partial), *map(str, sources), "-lm"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        output = (result.stderr + result.stdout).strip()
        raise BuildError(f"{' '.join(command)} failed ({result.returncode}):\n{output}")
    os.replace(partial, target)  # atomic: concurrent builders each install a whole library
    return target
