"""Which requests guess, how many tokens, and when a request stops guessing."""

from __future__ import annotations

import pytest

from llmserve.config import SpeculativeConfig
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams
from llmserve.scheduling.request import Request
from llmserve.spec_decode.speculator import Speculator

REPEATING = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]  # "1 2 3" was followed by 4 5 6 7 8


def speculator(k: int = 3, **fields: int) -> Speculator:
    config = SpeculativeConfig("ngram", k, prompt_lookup_min=2, prompt_lookup_max=3, **fields)
    return Speculator(config, max_model_len=4096)


def request(prompt: list[int] = REPEATING, /, **params: object) -> Request:
    return Request("r", prompt, SamplingParams(**params), None, 0.0, max_model_len=4096)  # type: ignore[arg-type]


def test_guesses_from_the_prompt_up_to_k() -> None:
    assert speculator(3).propose(request(), budget=10) == [4, 5, 6]
    assert speculator(3).propose(request(), budget=2) == [4, 5]


def test_never_guesses_past_max_tokens() -> None:
    r = request(max_tokens=3)
    assert speculator(3).propose(r, budget=10) == [4, 5]  # the check itself adds one token
    r.append_output_token(4)
    r.append_output_token(5)
    assert speculator(3).propose(r, budget=10) == []


@pytest.mark.parametrize(
    "params",
    [
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"min_tokens": 2},
    ],
)
def test_requests_whose_processing_reads_the_history_do_not_guess(params: dict[str, object]) -> None:
    assert speculator().propose(request(**params), budget=10) == []


def test_bad_words_and_pooling_requests_do_not_guess() -> None:
    r = request()
    r.bad_words_token_ids = [[9]]
    assert speculator().propose(r, budget=10) == []
    pooling = Request("p", REPEATING, SamplingParams(), None, 0.0, 4096, pooling_params=PoolingParams())
    assert speculator().propose(pooling, budget=10) == []


def test_history_free_processing_still_guesses() -> None:
    r = request(min_tokens=1, logit_bias={7: 2.0}, allowed_token_ids=[4, 5, 6, 7])
    r.append_output_token(4)  # min_tokens met
    assert speculator().propose(r, budget=10) == [5, 6, 7]


def test_large_batches_do_not_guess() -> None:
    s = speculator(disable_by_batch_size=4)
    assert s.speculates(4) and not s.speculates(5)


def test_a_request_whose_guesses_fail_pauses_then_guesses_again() -> None:
    s = speculator(3)
    r = request(max_tokens=100)
    for _ in range(4):
        assert s.propose(r, budget=10)
        s.record(r, 3, 0)
    assert s.propose(r, budget=10) == []  # paused for the next 16 tokens it generates
    for token in [9] * 13 + [1, 2, 3]:
        r.append_output_token(token)
    assert s.propose(r, budget=10) == [9, 9, 9]  # after the latest earlier "1 2 3"
    assert s.stats.num_drafts == 4 and s.stats.num_draft_tokens == 12 and s.stats.num_accepted_tokens == 0


def test_accepted_tokens_are_counted_per_position() -> None:
    s = speculator(3)
    r = request()
    s.record(r, 3, 2)
    s.record(r, 2, 2)
    s.record(r, 3, 0)
    assert s.stats.num_accepted_tokens_per_pos == [2, 2, 0]
    assert (s.stats.num_drafts, s.stats.num_draft_tokens, s.stats.num_accepted_tokens) == (3, 8, 4)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
            "exceed",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "disable_by_batch_size",
        ),
    ],
)
def test_bad_configs_name_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(fields)


def test_lookup_bounds_default_as_vllm_s() -> None:
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}'
    )
    assert config is not None and (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert config is not None and (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    with pytest.raises(ValueError, match="JSON"):
        SpeculativeConfig.parse("{method: ngram}")
