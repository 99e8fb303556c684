"""SamplingParams and the engine configs reject every bad value at construction, with a message
naming the field, the value and the allowed range (docs/architecture.md). Host-only: no jax."""

from __future__ import annotations

import pytest

from jaxserve.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig
from jaxserve.sampling_params import MAX_BANNED_STOP_TOKEN_IDS, SamplingParams


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(n=0), ValueError, r"n must be >= 1, got 0"),
        (dict(n=1.5), TypeError, r"n must be an int, got 1.5"),
        (dict(temperature=-0.1), ValueError, r"temperature must be >= 0, got -0.1"),
        (dict(temperature=float("nan")), ValueError, r"temperature must be >= 0, got nan"),
        (dict(temperature="hot"), TypeError, r"temperature must be a number"),
        (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=0), ValueError, r"top_k must be -1 \(disabled\) or >= 1, got 0"),
        (dict(top_k=-2), ValueError, r"top_k must be -1 \(disabled\) or >= 1, got -2"),
        (dict(min_p=-0.5), ValueError, r"min_p must be in \[0, 1\], got -0.5"),
        (dict(min_p=1.01), ValueError, r"min_p must be in \[0, 1\], got 1.01"),
        (dict(seed=-1), ValueError, r"seed must be in \[0, 2\*\*63\), got -1"),
        (dict(seed="7"), TypeError, r"seed must be an int"),
        (dict(max_tokens=0), ValueError, r"max_tokens must be >= 1, got 0"),
        (dict(min_tokens=20, max_tokens=10), ValueError, r"min_tokens must be in \[0, "),
        (dict(logprobs=-1), ValueError, r"logprobs must be in \[0, 20\], got -1"),
        (dict(logprobs=21), ValueError, r"logprobs must be in \[0, 20\], got 21"),
        (dict(prompt_logprobs=-3), ValueError, r"prompt_logprobs must be in \[0, 20\]"),
        (dict(presence_penalty=2.5), ValueError, r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=-3), ValueError, r"frequency_penalty must be in \[-2, 2\]"),
        (dict(repetition_penalty=0.0), ValueError, r"repetition_penalty must be in \(0, 10\]"),
        (dict(stop=5), TypeError, r"stop must be a str or a list of str, got 5"),
        (dict(stop=["ok", 3]), TypeError, r"stop must be a str or a list of str"),
        (dict(stop=[""]), ValueError, r"stop must not contain an empty string"),
        (dict(stop_token_ids=[1, "2"]), TypeError, r"stop_token_ids must be a list of int"),
        (dict(stop_token_ids=[-4]), ValueError, r"stop_token_ids must be >= 0"),
        (dict(ignore_eos=1), TypeError, r"ignore_eos must be a bool"),
    ],
)
def test_bad_sampling_params_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_good_sampling_params_normalise():
    p = SamplingParams(temperature=0, stop="END", stop_token_ids=[7, 7, 9], seed=2**63 - 1)
    assert p.greedy and p.stop_strings == ("END",) and p.all_stop_token_ids == {7, 9}
    assert SamplingParams(stop=["a", "b"]).stop_strings == ("a", "b")
    assert not SamplingParams().greedy


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: CacheConfig(block_size=0), r"CacheConfig.block_size must be >= 1, got 0"),
        (lambda: CacheConfig(num_kv_blocks=1), r"num_kv_blocks must be >= 2 .*got 1"),
        (lambda: CacheConfig(memory_utilization=1.5), r"memory_utilization must be in \(0, 1\]"),
        (
            lambda: CacheConfig(calculate_kv_scales="yes"),
            r"CacheConfig.calculate_kv_scales must be a bool, got 'yes'",
        ),
        (lambda: CacheConfig(enable_prefix_caching=1), r"enable_prefix_caching must be a bool"),
        (lambda: SchedulerConfig(max_num_seqs=0), r"max_num_seqs must be >= 1, got 0"),
        (lambda: SchedulerConfig(max_num_batched_tokens=-5), r"max_num_batched_tokens must be"),
        (lambda: SchedulerConfig(policy="lifo"), r"policy must be one of \('fcfs', 'priority'\)"),
        (lambda: ModelConfig(dtype="int4"), r"dtype must be one of .*got 'int4'"),
        (lambda: ModelConfig(max_model_len=0), r"max_model_len must be >= 1, got 0"),
        (lambda: RunnerConfig(attention_backend="cuda"), r"attention_backend must be one of"),
        (lambda: RunnerConfig(tensor_parallel_size=0), r"tensor_parallel_size must be >= 1"),
        (lambda: EngineConfig.from_kwargs(blocksize=16), r"unknown engine argument 'blocksize'"),
    ],
)
def test_bad_engine_config_raises(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_engine_config_from_flat_kwargs():
    cfg = EngineConfig.from_kwargs(
        model="m",
        block_size=32,
        max_num_seqs=4,
        max_model_len=99,
        attention_backend="xla",
        enable_prefix_caching=False,
    )
    assert cfg.model.model == "m" and cfg.model.max_model_len == 99
    assert cfg.cache.block_size == 32 and not cfg.cache.enable_prefix_caching
    assert cfg.scheduler.max_num_seqs == 4 and cfg.runner.attention_backend == "xla"


@pytest.mark.parametrize(
    "name", ["ignore_eos", "skip_special_tokens", "include_stop_str_in_output"]
)
def test_bool_fields_are_type_checked(name):
    with pytest.raises(TypeError, match=rf"SamplingParams.{name} must be a bool, got 'yes'"):
        SamplingParams(**{name: "yes"})


def test_clone_revalidates_and_shares_no_list():
    params = SamplingParams(stop=["a"], stop_token_ids=[7], temperature=0.5)
    params.stop.append("b")  # changed after construction: honoured by the clone
    params.top_k = 5
    clone = params.clone()
    assert clone.stop_strings == ("a", "b") and clone.top_k == 5
    params.stop.append("c")
    params.stop_token_ids.append(8)
    assert clone.stop == ["a", "b"] and clone.all_stop_token_ids == frozenset({7})
    params.top_p = 0.0
    with pytest.raises(ValueError, match=r"SamplingParams.top_p must be in \(0, 1\], got 0.0"):
        params.clone()


def test_a_misspelled_attribute_is_refused_naming_the_closest_field():
    params = SamplingParams()
    with pytest.raises(AttributeError, match=r"no field 'temprature'; did you mean 'temperature'"):
        params.temprature = 0
    assert not hasattr(params, "temprature") and params.temperature == 1.0
    with pytest.raises(AttributeError, match="no field 'colour'"):
        params.colour = "red"
    params.temperature = 0.0  # a known field is set as before
    assert params.clone().temperature == 0.0


def test_copies_and_pickles_survive_the_attribute_check():
    import copy
    import pickle

    params = SamplingParams(n=3, stop=["x"], stop_token_ids=[4], min_tokens=1, seed=7)
    params.temperature = 0.3
    for clone in (pickle.loads(pickle.dumps(params)), copy.deepcopy(params), params.clone()):
        assert clone == params and clone.all_stop_token_ids == frozenset({4})


def test_stop_token_ids_with_min_tokens_are_capped_naming_the_cap():
    many = list(range(MAX_BANNED_STOP_TOKEN_IDS + 1))
    with pytest.raises(ValueError, match=rf"at most {MAX_BANNED_STOP_TOKEN_IDS} distinct ids"):
        SamplingParams(min_tokens=2, stop_token_ids=many)
    assert len(SamplingParams(stop_token_ids=many).all_stop_token_ids) == len(many)  # no bans
    assert SamplingParams(min_tokens=2, stop_token_ids=many[:-1]).min_tokens == 2
    params = SamplingParams(min_tokens=2)
    params.stop_token_ids = many  # set after construction: refused when the engine clones it
    with pytest.raises(ValueError, match="stop_token_ids"):
        params.clone()


@pytest.mark.parametrize(
    "config", [CacheConfig(), ModelConfig(), RunnerConfig(), SchedulerConfig(), EngineConfig()]
)
def test_config_objects_refuse_any_attribute_assignment(config):
    with pytest.raises(AttributeError, match="max_num_seq"):  # frozen: unknown names too
        config.max_num_seq = 4
