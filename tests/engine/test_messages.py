"""What crosses the process boundary survives msgpack unchanged, and bad values are refused on arrival."""

from __future__ import annotations

import msgspec
import pytest

from llmserve.config import ResolvedLimits
from llmserve.contracts import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
    TokenLogprobs,
)
from llmserve.engine.messages import EngineCoreFailure, UtilityResult
from llmserve.sampling_params import RequestOutputKind, SamplingParams


def round_trip(value: object, kind: type) -> object:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=kind)


def test_engine_core_request_round_trip() -> None:
    params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        seed=1234,
        max_tokens=32,
        min_tokens=2,
        stop=["\n\n", "END"],
        stop_token_ids=[7],
        logprobs=3,
        output_kind=RequestOutputKind.DELTA,
    )
    request = EngineCoreRequest("req-1", [1, 2, 3], params, eos_token_id=2, arrival_time=123.5)
    decoded = round_trip(request, EngineCoreRequest)
    assert decoded == request
    assert isinstance(decoded, EngineCoreRequest)
    assert decoded.sampling_params.stop_strings == ["\n\n", "END"]
    assert decoded.sampling_params.output_kind is RequestOutputKind.DELTA


def test_defaults_and_a_single_stop_string_round_trip() -> None:
    request = EngineCoreRequest("r", [5], SamplingParams(stop="###"), eos_token_id=None, arrival_time=0.0)
    decoded = round_trip(request, EngineCoreRequest)
    assert decoded == request
    assert isinstance(decoded, EngineCoreRequest) and decoded.sampling_params.stop == ["###"]


def test_invalid_sampling_params_are_refused_on_arrival() -> None:
    payload = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises(ValueError, match="temperature"):
        msgspec.msgpack.decode(payload, type=SamplingParams)


def test_engine_core_outputs_round_trip() -> None:
    logprobs = TokenLogprobs(token_ids=[42, 7, 9], logprobs=[-0.25, -0.5, -3.0], ranks=[2, 1, 3])
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("a", [42], new_logprobs=[logprobs]),
            EngineCoreOutput("b", [2], FinishReason.STOP, stop_reason=2),
            EngineCoreOutput("c", [11], FinishReason.LENGTH),
        ],
        scheduler_stats=SchedulerStats(1, 2, 0.5, 3, num_requests=3, num_free_blocks=4, num_total_blocks=8),
        timestamp=99.25,
    )
    decoded = round_trip(outputs, EngineCoreOutputs)
    assert decoded == outputs
    assert isinstance(decoded, EngineCoreOutputs)
    assert decoded.outputs[1].finish_reason is FinishReason.STOP and decoded.outputs[1].finished


def test_handshake_and_utility_payloads_round_trip() -> None:
    limits = ResolvedLimits(max_model_len=1024, num_kv_blocks=64, block_size=16, vocab_size=272)
    assert round_trip(limits, ResolvedLimits) == limits
    failure = EngineCoreFailure("ValueError", "Model 'x' not found.", is_value_error=True)
    assert round_trip(failure, EngineCoreFailure) == failure
    stats = SchedulerStats(num_requests=1, num_free_blocks=3, num_total_blocks=4)
    result = UtilityResult(7, msgspec.Raw(msgspec.msgpack.encode(stats)))
    decoded = round_trip(result, UtilityResult)
    assert isinstance(decoded, UtilityResult) and decoded.call_id == 7
    assert msgspec.msgpack.decode(decoded.result, type=SchedulerStats) == stats
