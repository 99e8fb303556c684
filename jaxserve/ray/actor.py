"""``EngineActor``: the map_batches UDF, one LLM per Ray actor: a batch of rows in, the same
rows with the generated columns out."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import Any

from jaxserve.ray.checks import (
    OUTPUT_COLUMNS,
    PARAMS_COLUMN,
    PROMPT_COLUMNS,
    make_params,
    row_label,
)
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve")


class EngineActor:
    """The map_batches UDF: one LLM per Ray actor; each call generates for a whole batch."""

    def __init__(
        self, model: str, engine_kwargs: dict[str, Any], sampling_params: dict[str, Any]
    ) -> None:
        from jaxserve.engine.llm import LLM

        kwargs = dict(engine_kwargs)
        if "seed" not in kwargs:
            kwargs["seed"] = secrets.randbits(63)
            logger.info(
                "jaxserve.ray: engine seed %d for this actor's unseeded rows", kwargs["seed"]
            )
        self.llm = LLM(model, **kwargs)
        self.base = dict(sampling_params)
        self.base_params = make_params(self.base, "sampling_params")
        self.with_logprobs = self.base_params.logprobs is not None

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        added = OUTPUT_COLUMNS if self.with_logprobs else OUTPUT_COLUMNS[:-1]
        clash = sorted(set(added) & set(batch.column_names))
        if clash:
            raise ValueError(
                f"jaxserve.ray: the input already has output column(s) {clash}; "
                "rename them (output rows keep every input column)"
            )
        rows = batch.to_pylist()
        prompts, params = [], []
        for i, row in enumerate(rows):
            try:
                prompts.append(self._prompt(row))
                params.append(self._params(row.get(PARAMS_COLUMN)))
            except (TypeError, ValueError) as e:
                raise type(e)(f"jaxserve.ray: {row_label(i, row)}: {e}") from None
        outputs = self._generate(rows, prompts, params) if rows else []
        completions = [out.outputs[0] for out in outputs]
        columns = {
            "generated_text": pa.array([c.text for c in completions], pa.string()),
            "generated_token_ids": pa.array(
                [list(c.token_ids) for c in completions], pa.list_(pa.int64())
            ),
            "num_generated_tokens": pa.array([len(c.token_ids) for c in completions], pa.int64()),
            "finish_reason": pa.array([c.finish_reason for c in completions], pa.string()),
        }
        if self.with_logprobs:
            columns["logprobs"] = pa.array(
                [
                    [pos[tok].logprob for pos, tok in zip(c.logprobs, c.token_ids, strict=True)]
                    for c in completions
                ],
                pa.list_(pa.float64()),
            )
        for name, column in columns.items():
            batch = batch.append_column(name, column)
        return batch

    def _prompt(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The row's prompt as a prompt dict for LLM.generate."""
        given = [c for c in PROMPT_COLUMNS if row.get(c) is not None]
        if len(given) != 1:
            raise ValueError(
                f"needs exactly one of {list(PROMPT_COLUMNS)}, got "
                f"{given if given else 'none of them'}"
            )
        (column,) = given
        value = row[column]
        if column == "prompt":
            if not isinstance(value, str):
                raise TypeError(f"'prompt' must be a str, got {type(value).__name__}")
            return {"prompt": value}
        if column == "prompt_token_ids":
            if not isinstance(value, list):
                raise TypeError(f"'prompt_token_ids' must be a list of int, got {value!r}")
            return {"prompt_token_ids": value}
        if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
            raise TypeError(
                f"'messages' must be a list of {{'role', 'content'}} dicts, got {value!r}"
            )
        # Arrow gives every message the keys any message has, null where it has none.
        messages = [{k: v for k, v in m.items() if v is not None} for m in value]
        return self.llm.engine.render_chat_prompt(messages)

    def _params(self, override: Any) -> SamplingParams:
        """The processor's params with the row's non-null fields over them."""
        if override is None:
            return self.base_params
        if not isinstance(override, dict):
            raise TypeError(
                f"'{PARAMS_COLUMN}' must be a struct (dict) of SamplingParams fields, "
                f"got {override!r}"
            )
        merged = {**self.base, **{k: v for k, v in override.items() if v is not None}}
        params = make_params(merged, f"'{PARAMS_COLUMN}'")
        if params.logprobs is not None and not self.with_logprobs:
            raise ValueError(
                f"'{PARAMS_COLUMN}' asks logprobs={params.logprobs}, but the processor's "
                "sampling_params do not set logprobs, so there is no logprobs column; set it "
                "in build_processor(sampling_params=...)"
            )
        return params

    def _generate(
        self, rows: list[dict[str, Any]], prompts: list[dict[str, Any]], params: list[Any]
    ) -> list[Any]:
        try:
            return self.llm.generate(prompts, params, use_tqdm=False)
        except (TypeError, ValueError) as e:
            # Name the row: the first whose check fails (generate checks all before queueing).
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                try:
                    self.llm.engine.check_request(prompt, p)
                except (TypeError, ValueError) as row_error:
                    raise type(row_error)(
                        f"jaxserve.ray: {row_label(i, rows[i])}: {row_error}"
                    ) from e
            raise
