"""Batch inference over Ray Data: ``build_processor(...)`` -> a Dataset -> Dataset function that
runs one jaxserve engine (``LLM``) per Ray actor.

::

    from jaxserve.ray import build_processor

    processor = build_processor(
        model="tiny-random-llama",
        engine_kwargs=dict(max_model_len=2048),
        sampling_params=dict(temperature=0.0, max_tokens=64),
        concurrency=2,  # Ray actors, one engine each
        batch_size=32,  # rows per engine call
        resources={"num_gpus": 1},  # per actor: num_cpus / num_gpus / resources
    )
    out = processor(ray.data.from_items([{"id": 0, "prompt": "Hello"}]))

Each input row holds exactly one of ``prompt`` (str), ``messages`` (a chat conversation, a
list of {"role", "content"} rendered with the model's chat template as ``LLM.chat`` does) or
``prompt_token_ids`` (list of int), and may hold a ``sampling_params`` struct column whose
fields override the processor's for that row. A null field of that struct means "not set":
Arrow fills the fields one row lacks with nulls when another row has them. Output rows keep
every input column and add ``generated_text``, ``generated_token_ids``,
``num_generated_tokens``, ``finish_reason``, and ``logprobs`` (the sampled token's logprob at
each generated position, a list of float) when the processor's sampling_params set
``logprobs``. One row in, one row out: ``n > 1`` and ``prompt_logprobs`` are refused.

Ray is imported lazily: this module imports without it, and ``build_processor`` raises an
ImportError naming the ``jaxserve[ray]`` extra when it is missing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.config import EngineConfig

logger = logging.getLogger("jaxserve")

PROMPT_COLUMNS = ("prompt", "messages", "prompt_token_ids")
PARAMS_COLUMN = "sampling_params"
OUTPUT_COLUMNS = (  # logprobs last: only when the processor's sampling_params ask for it
    "generated_text",
    "generated_token_ids",
    "num_generated_tokens",
    "finish_reason",
    "logprobs",
)
# Per-actor resource requests passed through to Dataset.map_batches (Ray's names).
RESOURCE_KEYS = ("num_cpus", "num_gpus", "resources")
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)


def _import_ray() -> Any:
    """The ray module, with Ray Data loaded.

    Raises:
        ImportError: ray (or its data extra) is not installed; names the extra to install.
    """
    try:
        import ray
        import ray.data  # noqa: F401  (loads the Dataset API)
    except ImportError as e:
        raise ImportError(
            "jaxserve.ray needs Ray Data, which is not installed: "
            "pip install 'jaxserve[ray]' (or pip install 'ray[data]')"
        ) from e
    return ray


def _check_model(config: EngineConfig) -> None:
    """What every actor's LLM would check first, here in the driver: the model resolves (a
    built-in name, a folder with its config.json, a Hub ID: config.json only is fetched) and
    max_model_len is within its max_position_embeddings. Reads no weight and starts no Ray.

    Raises:
        FileNotFoundError / ValueError / TypeError: as LLM(...) would, prefixed by the call.
    """
    from jaxserve.checkpoints_tools.hub import CONFIG_FILES
    from jaxserve.checkpoints_tools.load import load_arch, resolve_model

    model = config.model
    try:
        source = resolve_model(
            model.model, revision=model.revision, download_dir=model.download_dir,
            files=CONFIG_FILES,
        )  # fmt: skip
        arch = load_arch(source)
    except (OSError, TypeError, ValueError) as e:
        raise type(e)(f"build_processor: model={model.model!r}: {e}") from None
    limit = arch.max_position_embeddings
    if model.max_model_len is not None and model.max_model_len > limit:
        raise ValueError(
            f"build_processor: engine_kwargs: max_model_len={model.max_model_len} exceeds the "
            f"model's max_position_embeddings={limit}"
        )


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"build_processor: {name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"build_processor: {name} must be >= 1, got {value}")


def _check_amount(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"build_processor: {name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"build_processor: {name} must be a finite number >= 0, got {value}")


def _check_resources(resources: object) -> dict[str, Any]:
    """A validated copy of the per-actor resource request (map_batches keyword arguments)."""
    if resources is None:
        return {}
    if not isinstance(resources, Mapping):
        raise TypeError(
            f"build_processor: resources must be a dict with keys among {list(RESOURCE_KEYS)} "
            f"or None, got {type(resources).__name__}"
        )
    out: dict[str, Any] = {}
    for key, value in resources.items():
        if key not in RESOURCE_KEYS:
            raise ValueError(
                f"build_processor: resources has an unknown key {key!r}; "
                f"allowed: {list(RESOURCE_KEYS)}"
            )
        if key == "resources":
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                raise TypeError(
                    "build_processor: resources['resources'] must be a dict of custom resource "
                    f"name -> amount (e.g. {{'TPU': 4}}), got {value!r}"
                )
            for name, amount in value.items():
                _check_amount(f"resources['resources'][{name!r}]", amount)
            out[key] = dict(value)
        else:
            _check_amount(f"resources[{key!r}]", value)
            out[key] = value
    return out


def _check_supported(params: SamplingParams, where: str) -> None:
    """Refuse what one output row cannot hold."""
    if params.n != 1:
        raise ValueError(
            f"{where}: n must be 1 (one row in, one row out), got {params.n}; "
            "repeat the row to get several samples"
        )
    if params.prompt_logprobs is not None:
        raise ValueError(
            f"{where}: prompt_logprobs is not supported (no output column holds it), "
            f"got {params.prompt_logprobs}"
        )


def _make_params(base: Mapping[str, Any], where: str) -> SamplingParams:
    """SamplingParams from a dict of its fields, checked for one-row output.

    Raises:
        TypeError: not a dict, or an unknown field (the known ones are listed).
        ValueError / TypeError: a bad value (SamplingParams names the field and the limit).
    """
    if not isinstance(base, Mapping):
        raise TypeError(
            f"{where} must be a dict of SamplingParams fields, got {type(base).__name__}"
        )
    unknown = sorted(str(k) for k in base if k not in _PARAM_FIELDS)
    if unknown:
        raise TypeError(
            f"{where} has unknown SamplingParams fields {unknown}; known: {list(_PARAM_FIELDS)}"
        )
    try:
        params = SamplingParams(**base)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None
    _check_supported(params, where)
    return params


def _row_label(index: int, row: Mapping[str, Any]) -> str:
    """How an error names a row: its place in the batch, its non-null columns and, to find
    it, up to three of its short scalar values (an id column, say)."""
    present = sorted(k for k, v in row.items() if v is not None)
    scalars = [
        f"{k}={v!r}"
        for k, v in row.items()
        if k not in PROMPT_COLUMNS
        and isinstance(v, (int, float, str))
        and not (isinstance(v, str) and len(v) > 40)
    ][:3]
    label = f"row {index} of the batch (non-null columns {present}"
    return label + (f"; {', '.join(scalars)})" if scalars else ")")


@dataclasses.dataclass(frozen=True)
class RayProcessor:
    """A validated batch-inference job: call it on a ``ray.data.Dataset`` to get the lazily
    executed output Dataset (build it with ``build_processor``)."""

    model: str
    engine_kwargs: dict[str, Any]
    sampling_params: dict[str, Any]
    concurrency: int
    batch_size: int
    resources: dict[str, Any]

    def __call__(self, ds: Any) -> Any:
        ray = _import_ray()
        if not isinstance(ds, ray.data.Dataset):
            raise TypeError(
                f"processor(ds): ds must be a ray.data.Dataset, got {type(ds).__name__}"
            )
        # pyarrow batches: list, string and struct columns round-trip exactly, and every input
        # column is handed back untouched (no pandas dtype conversion of ints with nulls).
        return ds.map_batches(
            EngineActor,
            fn_constructor_kwargs=dict(
                model=self.model,
                engine_kwargs=self.engine_kwargs,
                sampling_params=self.sampling_params,
            ),
            compute=ray.data.ActorPoolStrategy(size=self.concurrency),
            batch_size=self.batch_size,
            batch_format="pyarrow",
            **self.resources,
        )


def build_processor(
    model: str = "tiny-random-llama",
    *,
    engine_kwargs: Mapping[str, Any] | None = None,
    sampling_params: Mapping[str, Any] | None = None,
    concurrency: int = 1,
    batch_size: int = 32,
    resources: Mapping[str, Any] | None = None,
) -> RayProcessor:
    """A Dataset -> Dataset function running ``LLM(model, **engine_kwargs).generate`` over the
    rows, on ``concurrency`` Ray actors with one engine each, ``batch_size`` rows per call.

    Args:
        model: anything ``LLM(model=...)`` accepts; every actor loads it.
        engine_kwargs: ``LLM(...)`` keyword arguments. Without ``seed``, each actor draws a
            seed of its own for unseeded sampled rows (so actors do not repeat each other's
            random streams); give rows a ``seed`` in their sampling params for reproducible
            sampling, which does not depend on the actor or the batch.
        sampling_params: SamplingParams fields applied to every row; a row's own
            ``sampling_params`` column overrides them field by field. ``logprobs`` set here
            adds the ``logprobs`` output column.
        concurrency: Ray actors, each holding one engine.
        batch_size: rows per ``generate`` call (the engine batches them continuously).
        resources: per-actor resources, passed through to ``Dataset.map_batches``:
            ``num_cpus`` (Ray Data's default: 1), ``num_gpus`` (e.g. ``{"num_gpus": 1}``; Ray
            sets CUDA_VISIBLE_DEVICES for the actor) and ``resources`` (custom resources, e.g.
            ``{"resources": {"TPU": 4}}`` on a TPU host).

    Everything is checked here, before Ray runs anything, naming the field.

    Raises:
        ImportError: Ray Data is not installed (install the ``jaxserve[ray]`` extra).
        TypeError / ValueError: a bad argument, engine argument or SamplingParams field, or
            a max_model_len beyond the model's max_position_embeddings.
        FileNotFoundError: the model is not a built-in name, a folder with config.json or a
            Hub model ID that resolves (only its config.json is fetched here).
    """
    _import_ray()
    if engine_kwargs is None:
        engine_kwargs = {}
    if not isinstance(engine_kwargs, Mapping):
        raise TypeError(
            f"build_processor: engine_kwargs must be a dict of LLM(...) keyword arguments, "
            f"got {type(engine_kwargs).__name__}"
        )
    if "model" in engine_kwargs:
        raise TypeError("build_processor: give the model as model=..., not in engine_kwargs")
    from jaxserve.config import EngineConfig  # no jax: plain validation of the arguments

    try:
        config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(f"build_processor: engine_kwargs: {e}") from None
    _check_model(config)
    base = {} if sampling_params is None else sampling_params
    _make_params(base, "build_processor: sampling_params")
    _check_count("concurrency", concurrency)
    _check_count("batch_size", batch_size)
    return RayProcessor(
        model=model,
        engine_kwargs=dict(engine_kwargs),
        sampling_params=dict(base),
        concurrency=concurrency,
        batch_size=batch_size,
        resources=_check_resources(resources),
    )


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
        self.base_params = _make_params(self.base, "sampling_params")
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
                raise type(e)(f"jaxserve.ray: {_row_label(i, row)}: {e}") from None
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
        params = _make_params(merged, f"'{PARAMS_COLUMN}'")
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
                        f"jaxserve.ray: {_row_label(i, rows[i])}: {row_error}"
                    ) from e
            raise
