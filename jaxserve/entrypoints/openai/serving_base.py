"""What both generation endpoints share: the served model's name and limits, a request's
SamplingParams, the checks of its prompts (tokenized in the engine client's worker thread, so
the event loop keeps serving) and the start of its engine requests."""

from __future__ import annotations

import logging
import time
from typing import Any

from jaxserve.engine.async_llm import AsyncLLM, CheckedRequest
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    echo_only,
    requested_max_tokens,
    sampling_params,
    translate_params_errors,
    usage,
    with_max_tokens,
)
from jaxserve.entrypoints.openai.request_outputs import RequestOutputs
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxserve")


class ChecksOnly(Exception):  # noqa: N818 (not an error: the end of a checks-only call)
    """Raised by a handler in checks-only mode (BaseServing.checks_only) with the engine
    requests it would have started, checked: nothing was started."""

    def __init__(self, checked: list[CheckedRequest]) -> None:
        super().__init__(f"{len(checked)} checked requests, not started")
        self.checked = checked


class BaseServing:
    """The shared part of the completions and chat handlers over ``engine``."""

    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        self.engine = engine
        # True: a request's handling stops, raising ChecksOnly, where it would start (a batch
        # job's warm-up reads its requests this way: OpenAIServing.checked_requests).
        self.checks_only = False
        self.served_model_name = served_model_name
        self._max_model_len = engine.max_model_len
        self._tokenizer = engine.tokenizer

    def _head(self, response_id: str) -> dict[str, Any]:
        return {"id": response_id, "created": int(time.time()), "model": self.served_model_name}

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise OpenAIError(
                f"the model {model!r} does not exist; this server serves "
                f"{self.served_model_name!r} (GET /v1/models)",
                status_code=404,
                param="model",
            )

    def _params(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        tool_constraint: dict | None = None,
    ) -> SamplingParams:
        requested, _ = requested_max_tokens(request)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        # Without a limit, each prompt gets what the context leaves (_check_prompt); until then
        # the longest that may be, so that min_tokens is checked against something.
        max_tokens = self._max_model_len if requested is None else requested
        if isinstance(request, CompletionRequest) and echo_only(request):
            max_tokens = 1  # the engine samples one token, which the answer leaves out
        return sampling_params(
            request, max_tokens=max_tokens, output_kind=kind, tool_constraint=tool_constraint
        )

    async def _check_prompt(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams,
        where: str,
    ) -> CheckedRequest:
        """Tokenize and check one prompt with the engine's checks, and the completion length
        against the context: nothing is queued yet.

        Raises:
            OpenAIError (400): a bad or too long prompt (param "prompt" / "messages"), a
                max_tokens that does not fit the context with the prompt.
        """
        param = where.split("[")[0]
        engine, limit = self.engine, self._max_model_len
        requested, field = requested_max_tokens(request)
        try:
            text, token_ids = await engine.tokenize(prompt)
            if requested is None:
                params = with_max_tokens(request, params, max(1, limit - len(token_ids)))
            prompt_dict = {"prompt": text, "prompt_token_ids": token_ids}
            checked = await engine.check_request(prompt_dict, params)
        except (TypeError, ValueError) as e:
            if str(e).startswith("SamplingParams."):  # a constraint (a grammar that fails...)
                with translate_params_errors(request):
                    raise
            raise OpenAIError(f"{where}: {e}", param=param) from None
        if requested is not None and len(token_ids) + requested > limit:
            raise OpenAIError(
                f"{field}={requested} is too large: this model's maximum context length is "
                f"{limit} tokens and the {where} has {len(token_ids)} tokens "
                f"({requested} > {limit} - {len(token_ids)})",
                param=field,
            )
        return checked

    def _start(self, response_id: str, checked: list[CheckedRequest]) -> RequestOutputs:
        if self.checks_only:
            raise ChecksOnly(checked)
        requests = [(f"{response_id}-{i}", c) for i, c in enumerate(checked)]
        logger.debug(
            "request %s: %d prompt(s), n=%d", response_id, len(checked), checked[0].params.n
        )
        return RequestOutputs(self.engine, requests)


def usage_of(finals: list[RequestOutput]) -> dict[str, int]:
    """The usage body of the final outputs of one API request."""
    return usage(
        sum(len(f.prompt_token_ids) for f in finals),
        sum(len(c.token_ids) for f in finals for c in f.outputs),
    )


def kv_transfer_answer(finals: list[RequestOutput]) -> dict[str, dict]:
    """{"kv_transfer_params": ...} of a prefill's answer (vLLM's field, for the decode
    request: disaggregated serving), or {} when it has none."""
    params = [f.kv_transfer_params for f in finals if f.kv_transfer_params is not None]
    return {"kv_transfer_params": params[0]} if params else {}
