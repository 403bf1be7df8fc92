"""Log-probabilities of generated tokens, as OpenAI's ``logprobs.content`` entries, from either engine kind.

vLLM's default (``logprobs_mode: raw_logprobs``) is the log-softmax of the model's own logits, before
penalties, a grammar's mask and temperature: vLLM engines report them per token (:func:`from_vllm`),
and the transformers family reads them off its output head at each step (:class:`LogprobRecorder`).
The ``top`` alternatives are the most likely tokens in rank order, whichever was sampled (OpenAI's
``top_logprobs``; vLLM's own server lists the sampled token first).
"""

from __future__ import annotations

from typing import Any

from omni_serve.types import MIN_LOGPROB, TokenLogprob


def from_vllm(token_ids: list[int], logprobs: Any, top: int) -> list[TokenLogprob]:
    """vLLM's per-token logprob dicts (the sampled token's entry and the ``top`` ranked ones) -> ours."""
    entries = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        sampled = step[token_id]
        ranked = sorted((lp.rank, lp.decoded_token or "", lp.logprob) for lp in step.values() if lp.rank <= top)
        entries.append(
            TokenLogprob(
                sampled.decoded_token or "",
                max(sampled.logprob, MIN_LOGPROB),
                [(token, max(logprob, MIN_LOGPROB)) for _, token, logprob in ranked],
            )
        )
    return entries


class LogprobRecorder:
    """The raw log-probabilities of each generated token and its ``top`` alternatives, from an HF output head.

    A forward hook on the model's output head keeps each step's logits (the last position's); the
    streamer calls :meth:`token` with the token sampled from them.
    """

    def __init__(self, head: Any, tokenizer: Any, top: int):
        self._tokenizer = tokenizer
        self._top = top
        self._logits: Any = None
        self._hook = head.register_forward_hook(self._keep)

    def _keep(self, module: Any, args: Any, output: Any) -> None:
        self._logits = output[0, -1]

    def token(self, token_id: int) -> TokenLogprob:
        import torch

        if self._logits is None:
            raise RuntimeError("a token was sampled without the output head running")
        logprobs = torch.log_softmax(self._logits.float(), dim=-1)
        top: list[tuple[str, float]] = []
        if self._top:
            values, ids = torch.topk(logprobs, self._top)
            top = [(self._text(int(i)), max(float(v), MIN_LOGPROB)) for v, i in zip(values, ids, strict=True)]
        return TokenLogprob(self._text(token_id), max(float(logprobs[token_id]), MIN_LOGPROB), top)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def close(self) -> None:
        self._hook.remove()
