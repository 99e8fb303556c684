"""What ``build_processor`` and its actors check, naming the field: the model, the counts and
resources, each row's SamplingParams (one row in, one row out), and how an error names a row.
Imports no Ray and no jax (``import_ray`` loads Ray when it is called)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from jaxserve.config import EngineConfig

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


def import_ray() -> Any:
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


def check_engine_kwargs(model: str, engine_kwargs: object) -> EngineConfig:
    """The EngineConfig of ``LLM(model, **engine_kwargs)``, its model resolved and checked.

    Raises:
        TypeError / ValueError / FileNotFoundError: a bad argument, as LLM(...) would, prefixed
            by the call.
    """
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
    check_model(config)
    return config


def check_model(config: EngineConfig) -> None:
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


def check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"build_processor: {name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"build_processor: {name} must be >= 1, got {value}")


def _check_amount(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"build_processor: {name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"build_processor: {name} must be a finite number >= 0, got {value}")


def check_resources(resources: object) -> dict[str, Any]:
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


def make_params(base: Mapping[str, Any], where: str) -> SamplingParams:
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


def row_label(index: int, row: Mapping[str, Any]) -> str:
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
