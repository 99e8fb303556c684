"""``build_processor``: a validated Ray Data job (``RayProcessor``) mapping a Dataset with one
jaxserve engine per actor (actor.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxserve.ray.actor import EngineActor
from jaxserve.ray.checks import (
    check_count,
    check_engine_kwargs,
    check_resources,
    import_ray,
    make_params,
)


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
        ray = import_ray()
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
    import_ray()
    if engine_kwargs is None:
        engine_kwargs = {}
    check_engine_kwargs(model, engine_kwargs)
    base = {} if sampling_params is None else sampling_params
    make_params(base, "build_processor: sampling_params")
    check_count("concurrency", concurrency)
    check_count("batch_size", batch_size)
    return RayProcessor(
        model=model,
        engine_kwargs=dict(engine_kwargs),
        sampling_params=dict(base),
        concurrency=concurrency,
        batch_size=batch_size,
        resources=check_resources(resources),
    )
