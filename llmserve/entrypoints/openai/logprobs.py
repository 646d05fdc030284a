"""The engine's per-token logprobs (`SampleLogprobs`) in OpenAI's two shapes: the legacy completions one
(parallel lists, with echo the prompt's first) and the chat one (one object per token); and the prompt's
(`PromptLogprobs`) in vLLM's shape."""

from __future__ import annotations

from llmserve.entrypoints.openai import responses
from llmserve.entrypoints.openai.responses import CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob
from llmserve.outputs import Logprob, PromptLogprobs, SampleLogprobs

# OpenAI's floor for a token's logprob; also keeps -inf (which JSON cannot carry) out of responses.
MIN_LOGPROB = -9999.0


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely tokens at one position (all that are known when k is -1), most likely first;
    the chosen token may be among them."""
    ranked = [lp for lp in entry.values() if lp.rank is not None and (k < 0 or 1 <= lp.rank <= k)]
    return sorted(ranked, key=lambda lp: lp.rank or 0)


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(
    token_ids: list[int], logprobs: SampleLogprobs, k: int, text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """The tokens' logprobs with `k` alternatives each; offsets count from `text_offset`, the length of
    the text before these tokens. Returns them and the offset after the last token."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry[token_id]
        text = chosen.decoded_token or ""
        out.tokens.append(text)
        out.token_logprobs.append(_clamp(chosen.logprob))
        out.top_logprobs.append({lp.decoded_token or "": _clamp(lp.logprob) for lp in _top(entry, k)})
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out, text_offset


def echo_logprobs(
    token_ids: list[int], logprobs: PromptLogprobs, k: int, first_token: str
) -> tuple[CompletionLogprobs, int]:
    """The prompt's tokens in the completions shape, as OpenAI's echo returns them: the first token
    (`first_token`, its text) has no logprob, so None in `token_logprobs` and `top_logprobs`.
    Returns them and the text offset after the prompt."""
    entries = [e for e in logprobs[1:] if e is not None]
    if len(entries) != len(token_ids) - 1:
        raise RuntimeError("the engine's prompt logprobs do not cover the prompt")
    out, text_offset = completion_logprobs(token_ids[1:], entries, k, len(first_token))
    out.tokens.insert(0, first_token)
    out.token_logprobs.insert(0, None)
    out.top_logprobs.insert(0, None)
    out.text_offset.insert(0, 0)
    return out, text_offset


def concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def prompt_logprobs(logprobs: PromptLogprobs) -> responses.PromptLogprobs:
    """vLLM's `prompt_logprobs` response field: every logprob the engine returned, by token id."""
    return [
        None
        if entry is None
        else {
            t: PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for t, lp in entry.items()
        }
        for entry in logprobs
    ]


def chat_logprobs(token_ids: list[int], logprobs: SampleLogprobs, k: int) -> list[TokenLogprob]:
    """One object per token, with its UTF-8 bytes and `k` alternatives (OpenAI's `top_logprobs`)."""
    out: list[TokenLogprob] = []
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry[token_id]
        top = [
            TopLogprob(token=t, logprob=_clamp(lp.logprob), bytes=list(t.encode()))
            for lp in _top(entry, k)
            for t in [lp.decoded_token or ""]
        ]
        token = chosen.decoded_token or ""
        out.append(
            TokenLogprob(
                token=token, logprob=_clamp(chosen.logprob), bytes=list(token.encode()), top_logprobs=top
            )
        )
    return out
