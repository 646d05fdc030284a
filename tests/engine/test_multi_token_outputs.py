"""An engine core output may carry several tokens (confirmed guesses of speculative decoding): the front
end ends a request at the token that completes a stop string, as if each token had come alone."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
from transformers import AutoTokenizer

from llmserve.contracts import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from llmserve.engine.output_processor import OutputProcessor
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams


def run(tiny_llama_hf_dir: Path, params: SamplingParams, steps: list[list[int]]) -> RequestOutput:
    processor = OutputProcessor(AutoTokenizer.from_pretrained(tiny_llama_hf_dir))
    processor.add_request(EngineCoreRequest("r", [5, 6], params, None, 0.0), None)
    last: list[RequestOutput] = []
    for tokens in steps:
        logprobs = [TokenLogprobs([t], [-float(t)], [1]) for t in tokens]
        output = processor.process_outputs([EngineCoreOutput("r", tokens, new_logprobs=logprobs)])
        last = output.request_outputs or last  # type: ignore[assignment]
        if output.reqs_to_abort:
            break
    return last[-1]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_a_multi_token_output_drops_the_tokens_after_it(
    tiny_llama_hf_dir: Path, include: bool
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_hf_dir)
    tokens = tokenizer.encode("abcdefgh", add_special_tokens=False)
    stop = cast(str, tokenizer.decode(tokens[2:4]))  # completed by the 4th token (one sequence: a str)
    params = SamplingParams(max_tokens=50, stop=[stop], include_stop_str_in_output=include, logprobs=0)
    single = run(tiny_llama_hf_dir, params, [[t] for t in tokens])
    several = run(tiny_llama_hf_dir, params, [tokens[:3], tokens[3:6], tokens[6:]])
    for output in (single, several):
        completion = output.outputs[0]
        assert completion.token_ids == tokens[:4] and completion.stop_reason == stop
        assert completion.logprobs is not None and len(completion.logprobs) == 4
        assert completion.text == tokenizer.decode(tokens[: 4 if include else 2])
    assert several.outputs[0] == single.outputs[0]
