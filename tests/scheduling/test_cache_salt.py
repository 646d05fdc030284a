"""Prefix-cache keys are SHA-256 digests chained block to block, and a request's `cache_salt` (vLLM's)
enters its first block's digest: requests share cached blocks only under the same salt (or none)."""

from __future__ import annotations

import hashlib
import struct

import msgspec
import pytest
from transformers import PreTrainedTokenizerFast

from llmserve.config import ResolvedLimits, SchedulerConfig
from llmserve.contracts import EngineCoreRequest
from llmserve.engine.input_processor import InputProcessor, TokensPrompt
from llmserve.sampling_params import SamplingParams
from llmserve.scheduling.kv_cache_manager import KVCacheManager
from llmserve.scheduling.request import Request
from llmserve.scheduling.scheduler import Scheduler
from tests.fixtures.tiny_llama import VOCAB_SIZE, build_tokenizer
from tests.scheduling.fake_requests import make_request
from tests.scheduling.test_scheduler import step

BLOCK_SIZE = 4


def salted(request_id: str, num_tokens: int, salt: str | None) -> Request:
    request = make_request(request_id, num_tokens, max_tokens=1)
    request.cache_salt = salt
    return request


def sha256_chain(tokens: list[int], salt: str | None) -> list[bytes]:
    """The expected digests, computed apart from the manager: 32 zero bytes above the first block,
    each token id as 8 native-order bytes, the salt's UTF-8 after the first block's tokens."""
    out, parent = [], bytes(32)
    for i in range(len(tokens) // BLOCK_SIZE):
        block = tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        data = parent + struct.pack(f"={len(block)}q", *block)
        if i == 0 and salt is not None:
            data += salt.encode("utf-8")
        parent = hashlib.sha256(data).digest()
        out.append(parent)
    return out


def cached_hashes(manager: KVCacheManager, request: Request) -> list[bytes | None]:
    """Run the request's prompt through the manager and return its blocks' registered hashes."""
    assert manager.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    return [manager.block_pool.blocks[i].block_hash for i in manager.get_block_ids(request.request_id)]


@pytest.mark.parametrize("salt", [None, "tenant-a", "ünïcode ✓"])
def test_full_blocks_are_keyed_by_chained_sha256(salt: str | None) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = salted("a", 3 * BLOCK_SIZE + 1, salt)  # 3 full blocks and a partial one
    hashes = cached_hashes(manager, request)
    assert hashes == [*sha256_chain(request.all_token_ids, salt), None]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes[:3])


def test_the_salt_changes_the_first_block_and_so_the_whole_chain() -> None:
    tokens = list(range(1, 3 * BLOCK_SIZE + 1))
    chains = [sha256_chain(tokens, salt) for salt in (None, "a", "b")]
    for i in range(3):
        assert len({chain[i] for chain in chains}) == 3
    # later blocks take only their parent's digest: the salt is in the chain through the first block
    first_a, second_a = chains[1][:2]
    tail = struct.pack(f"={BLOCK_SIZE}q", *tokens[BLOCK_SIZE : 2 * BLOCK_SIZE])
    assert second_a == hashlib.sha256(first_a + tail).digest()


def run_two(first_salt: str | None, second_salt: str | None) -> tuple[KVCacheManager, Request]:
    """One request runs to the end, then the same 12-token prompt comes with another salt and is
    scheduled once."""
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(), manager, max_model_len=4096)
    first = salted("a", 3 * BLOCK_SIZE, first_salt)
    scheduler.add_request(first)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert len(manager.block_pool.cached) == 3
    second = salted("b", 3 * BLOCK_SIZE, second_salt)
    scheduler.add_request(second)
    scheduler.schedule()
    return manager, second


@pytest.mark.parametrize(("first", "second"), [("a", "b"), (None, "b"), ("a", None)])
def test_different_salts_share_no_cached_block(first: str | None, second: str | None) -> None:
    manager, request = run_two(first, second)
    assert request.num_computed_tokens == 0
    assert manager.prefix_cache_hits == 0
    cached_ids = {b.block_id for b in manager.block_pool.cached.values()}
    assert not cached_ids & set(manager.get_block_ids("b"))


@pytest.mark.parametrize("salt", ["a", None])
def test_the_same_salt_shares_the_prefix(salt: str | None) -> None:
    manager, request = run_two(salt, salt)
    assert request.num_computed_tokens == 2 * BLOCK_SIZE  # the last block holds the token to compute
    assert manager.prefix_cache_hits == 2 * BLOCK_SIZE


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    limits = ResolvedLimits(max_model_len=64, num_kv_blocks=8, block_size=16, vocab_size=VOCAB_SIZE)
    return InputProcessor(tokenizer, limits, eos_token_ids=[2])


def test_the_salt_travels_from_the_prompt_to_the_core_request(processor: InputProcessor) -> None:
    prompt = TokensPrompt(prompt_token_ids=[5, 6, 7], cache_salt="tenant-a")
    request, _ = processor.process_inputs("r", prompt, SamplingParams(max_tokens=1))
    assert request.cache_salt == "tenant-a"
    text_request, _ = processor.process_inputs("t", {"prompt": "hi", "cache_salt": "x"}, SamplingParams())
    assert text_request.cache_salt == "x"
    unsalted, _ = processor.process_inputs("u", "hi", SamplingParams())
    assert unsalted.cache_salt is None
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert Request.from_engine_core_request(wire, max_model_len=64).cache_salt == "tenant-a"


@pytest.mark.parametrize("salt", ["", 7, "\ud800"])
def test_a_salt_must_be_a_non_empty_string(processor: InputProcessor, salt: object) -> None:
    prompt = {"prompt_token_ids": [5, 6, 7], "cache_salt": salt}
    with pytest.raises(ValueError, match="^cache_salt"):
        processor.process_inputs("r", prompt, SamplingParams())  # type: ignore[arg-type]
