"""Scoring: the log-probability of a continuation given its prompt, as one prompt-logprobs
request (prompt tokens + continuation tokens, one token generated and ignored). Shared by
LLM.score and the `jaxserve score` job."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.prompts import PromptType
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

# Greedy, one generated token, the prompt's own logprobs (top-0: just each prompt token's).
SCORE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)


@dataclass(frozen=True)
class ScorePair:
    token_ids: list[int]  # prompt tokens + continuation tokens
    num_prompt_tokens: int


def check_pairs(
    engine: LLMEngine, prompts: Sequence[PromptType], continuations: Sequence[PromptType]
) -> list[ScorePair]:
    """Tokenize and check every pair before any runs. A text continuation is tokenized
    without special tokens (no BOS of its own: it continues the prompt).

    Raises:
        TypeError / ValueError: a bad prompt or continuation, or a pair longer than
            max_model_len ("pairs[i]: ...").
    """
    if len(prompts) != len(continuations):
        raise ValueError(f"score: {len(prompts)} prompts but {len(continuations)} continuations")
    pairs = []
    for i, (prompt, cont) in enumerate(zip(prompts, continuations, strict=True)):
        try:
            pairs.append(check_pair(engine, prompt, cont))
        except (TypeError, ValueError) as e:
            raise type(e)(f"score: pairs[{i}] (prompt + continuation): {e}") from None
    return pairs


def check_pair(engine: LLMEngine, prompt: PromptType, continuation: PromptType) -> ScorePair:
    """One pair of check_pairs (its errors unprefixed)."""
    _, p_ids = engine.process_prompt(prompt)
    _, c_ids = engine.process_prompt(continuation, add_special_tokens=False)
    engine.core.check_prompt_length(len(p_ids) + len(c_ids))
    return ScorePair(p_ids + c_ids, len(p_ids))


def continuation_logprobs(out: RequestOutput, num_prompt_tokens: int) -> list[float]:
    """Each continuation token's log-probability, from a SCORE_PARAMS request's output."""
    lps, ids = out.prompt_logprobs, out.prompt_token_ids
    return [lps[i][ids[i]].logprob for i in range(num_prompt_tokens, len(ids))]
