"""The engine's per-token logprobs (`SampleLogprobs`) in OpenAI's two shapes: the legacy completions one
(parallel lists, with echo the prompt's first) and the chat one (one object per token); and the prompt's
(`PromptLogprobs`) in vLLM's shape. With `as_ids` (vLLM's `return_tokens_as_token_ids`) a token is
named "token_id:<id>", which identifies even a token whose text is not valid UTF-8 on its own; text
offsets and `bytes` stay those of the token's text."""

from __future__ import annotations

from llmserve.entrypoints.openai import responses
from llmserve.entrypoints.openai.responses import CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob
from llmserve.outputs import Logprob, PromptLogprobs, SampleLogprobs

# OpenAI's floor for a token's logprob; also keeps -inf (which JSON cannot carry) out of responses.
MIN_LOGPROB = -9999.0


def _top(entry: dict[int, Logprob], k: int, as_ids: bool) -> list[tuple[str, Logprob]]:
    """The k most likely tokens at one position (all that are known when k is -1), most likely first,
    each with its name; the chosen token may be among them."""
    ranked = [(t, lp) for t, lp in entry.items() if lp.rank is not None and (k < 0 or 1 <= lp.rank <= k)]
    return [(_name(t, lp, as_ids), lp) for t, lp in sorted(ranked, key=lambda item: item[1].rank or 0)]


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _name(token_id: int, logprob: Logprob, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else logprob.decoded_token or ""


def completion_logprobs(
    token_ids: list[int], logprobs: SampleLogprobs, k: int, text_offset: int, as_ids: bool = False
) -> tuple[CompletionLogprobs, int]:
    """The tokens' logprobs with `k` alternatives each; offsets count from `text_offset`, the length of
    the text before these tokens. Returns them and the offset after the last token."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry[token_id]
        out.tokens.append(_name(token_id, chosen, as_ids))
        out.token_logprobs.append(_clamp(chosen.logprob))
        out.top_logprobs.append({name: _clamp(lp.logprob) for name, lp in _top(entry, k, as_ids)})
        out.text_offset.append(text_offset)
        text_offset += len(chosen.decoded_token or "")
    return out, text_offset


def echo_logprobs(
    token_ids: list[int], logprobs: PromptLogprobs, k: int, first_token: str, as_ids: bool = False
) -> tuple[CompletionLogprobs, int]:
    """The prompt's tokens in the completions shape, as OpenAI's echo returns them: the first token
    (`first_token`, its text) has no logprob, so None in `token_logprobs` and `top_logprobs`.
    Returns them and the text offset after the prompt."""
    entries = [e for e in logprobs[1:] if e is not None]
    if len(entries) != len(token_ids) - 1:
        raise RuntimeError("the engine's prompt logprobs do not cover the prompt")
    out, text_offset = completion_logprobs(token_ids[1:], entries, k, len(first_token), as_ids)
    out.tokens.insert(0, f"token_id:{token_ids[0]}" if as_ids else first_token)
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


def chat_logprobs(
    token_ids: list[int], logprobs: SampleLogprobs, k: int, as_ids: bool = False
) -> list[TokenLogprob]:
    """One object per token, with its UTF-8 bytes and `k` alternatives (OpenAI's `top_logprobs`)."""
    out: list[TokenLogprob] = []
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry[token_id]
        top = [
            TopLogprob(token=name, logprob=_clamp(lp.logprob), bytes=_bytes(lp))
            for name, lp in _top(entry, k, as_ids)
        ]
        out.append(
            TokenLogprob(
                token=_name(token_id, chosen, as_ids),
                logprob=_clamp(chosen.logprob),
                bytes=_bytes(chosen),
                top_logprobs=top,
            )
        )
    return out


def _bytes(logprob: Logprob) -> list[int]:
    return list((logprob.decoded_token or "").encode())
