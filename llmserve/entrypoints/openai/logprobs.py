"""The engine's per-token logprobs (`SampleLogprobs`) in OpenAI's two shapes: the legacy completions one
(parallel lists) and the chat one (one object per token)."""

from __future__ import annotations

from llmserve.entrypoints.openai.responses import CompletionLogprobs, TokenLogprob, TopLogprob
from llmserve.outputs import Logprob, SampleLogprobs

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
