"""jaxserve.ray.build_processor: batch inference over Ray Data on a local two-CPU Ray cluster,
compared row by row with a single-process LLM run."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a local Ray cluster

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

import pyarrow as pa  # noqa: E402  (installed with ray[data])

from jaxserve import SamplingParams  # noqa: E402
from jaxserve.ray import EngineActor, build_processor  # noqa: E402

MODEL = "tiny-random-llama"
ENGINE = dict(
    warmup=False,
    block_size=8,
    num_kv_blocks=64,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    dtype="float32",
)
BASE_PARAMS = dict(temperature=0.0, max_tokens=8, logprobs=0)
SEEDED = dict(temperature=1.0)  # with a per-row seed
CHATS = [  # single-user chats, rendered to 21 tokens each
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Yo"}],
]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 2 CPUs, all on 127.0.0.1: no dashboard, no usage stats, and no
    look-up of this host's address through a public DNS server (workers inherit the
    environment)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # Off, Ray takes the loopback address as its node address (in workers too) instead of
        # asking the route to a public DNS server.
        env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(
            address="local",  # a new cluster, whatever RAY_ADDRESS says
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            object_store_memory=256 << 20,
        )
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            yield
        finally:
            ray.shutdown()


def _rows() -> list[dict]:
    """12 prompts (texts, token ids, two chats) greedy, then the same 12 seeded, sampled at
    temperature 1 through a per-row sampling_params override; extra columns to keep."""
    # Each T bucket (runner/buckets.py) is compiled once per process: plain prompts of 5-6
    # tokens (one bucket) and chats of 21 keep the test quick and still differ in length.
    prompts = [
        {"prompt": "Once upon a time"},
        {"prompt_token_ids": [5, 17, 42, 99, 3]},
        {"prompt": "Hello world"},
        {"messages": CHATS[0]},
        {"prompt_token_ids": [20, 21, 22, 23, 24, 25]},
        {"prompt": "1 2 3"},
        {"prompt_token_ids": [7, 300, 8, 301, 9, 302]},
        {"prompt": "x = 1"},
        {"messages": CHATS[1]},
        {"prompt_token_ids": [300, 301, 302, 303, 304]},
        {"prompt": "Once upon a day"},
        {"prompt_token_ids": [11, 12, 13, 14, 15]},
    ]
    rows = [{"id": i, "tag": f"greedy-{i}", **p} for i, p in enumerate(prompts)]
    n = len(prompts)
    rows += [
        {"id": n + i, "tag": f"seeded-{i}", **p, "sampling_params": {**SEEDED, "seed": 1000 + i}}
        for i, p in enumerate(prompts)
    ]
    # One row overrides one more field: Arrow gives the other rows' structs a null there,
    # which must read as "not set".
    rows[-1]["sampling_params"]["max_tokens"] = 3
    return rows


def _non_null(value):
    """A struct as the row gave it: Arrow fills the fields another row has with nulls."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if v is not None}
    return value


@pytest.fixture(scope="module")
def udf():
    """The map_batches UDF in this process, for the row checks; its engine, an
    ``LLM(MODEL, **ENGINE)``, also gives the single-process reference run."""
    return EngineActor(MODEL, ENGINE, BASE_PARAMS)


def _reference(llm, rows: list[dict]) -> list[tuple]:
    """(token ids, text, finish reason, sampled-token logprobs) of each row, generated alone
    by a single-process LLM; chats through LLM.chat."""
    out = []
    for row in rows:
        params = SamplingParams(**{**BASE_PARAMS, **row.get("sampling_params", {})})
        if "messages" in row:
            (res,) = llm.chat(row["messages"], params, use_tqdm=False)
        else:
            prompt = row.get("prompt", row.get("prompt_token_ids"))
            (res,) = llm.generate([prompt], params, use_tqdm=False)
        c = res.outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        out.append((list(c.token_ids), c.text, c.finish_reason, lps))
    return out


@pytest.mark.slow  # a Ray cluster, two engines and their compilations: about a minute here
def test_two_actors_match_a_single_process_run(ray_cluster, udf):
    rows = _rows()
    processor = build_processor(
        MODEL,
        engine_kwargs=ENGINE,
        sampling_params=BASE_PARAMS,
        concurrency=2,
        batch_size=3,
    )
    out = sorted(processor(ray.data.from_items(rows)).take_all(), key=lambda r: r["id"])
    expected = _reference(udf.llm, rows)

    assert [r["id"] for r in out] == [r["id"] for r in rows]
    for row, got, (ids, text, reason, lps) in zip(rows, out, expected, strict=True):
        for key, value in row.items():  # every input column kept as it was
            assert _non_null(got[key]) == value, (row["id"], key)
        assert got["generated_token_ids"] == ids, row["id"]
        assert got["generated_text"] == text, row["id"]
        assert got["num_generated_tokens"] == len(ids)
        assert got["finish_reason"] == reason
        assert got["logprobs"] == pytest.approx(lps, rel=1e-4, abs=1e-5), row["id"]
    assert out[-1]["num_generated_tokens"] <= 3  # its own max_tokens
    # The seeded rows really sampled: they differ from the greedy run somewhere.
    n = len(rows) // 2
    assert [r["generated_token_ids"] for r in out[:n]] != [
        r["generated_token_ids"] for r in out[n:]
    ]


@pytest.mark.slow
def test_a_bad_row_fails_the_dataset_naming_its_columns(ray_cluster):
    processor = build_processor(MODEL, engine_kwargs=ENGINE, concurrency=1, batch_size=1)
    ds = ray.data.from_items(
        [{"id": 7, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}]
    )
    with pytest.raises(Exception, match="exactly one of") as info:
        processor(ds).take_all()
    message = str(info.value)
    assert "'messages', 'prompt'" in message and "id=7" in message


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            dict(sampling_params={"temprature": 0.5}),
            TypeError,
            "unknown .*temprature",
        ),
        (dict(sampling_params={"temperature": -1.0}), ValueError, "temperature must be >= 0"),
        (dict(sampling_params={"n": 2}), ValueError, "n must be 1"),
        (dict(sampling_params={"prompt_logprobs": 1}), ValueError, "prompt_logprobs"),
        (dict(sampling_params=[("temperature", 0)]), TypeError, "must be a dict"),
        (dict(concurrency=0), ValueError, "concurrency must be >= 1, got 0"),
        (dict(concurrency=True), TypeError, "concurrency must be an int"),
        (dict(batch_size=0), ValueError, "batch_size must be >= 1, got 0"),
        (dict(engine_kwargs={"max_num_sqes": 4}), TypeError, "unknown engine argument"),
        (dict(engine_kwargs={"block_size": 0}), ValueError, "block_size"),
        (dict(engine_kwargs={"model": MODEL}), TypeError, "model=..."),
        (dict(resources={"num_tpus": 1}), ValueError, "unknown key 'num_tpus'"),
        (dict(resources={"num_gpus": -1}), ValueError, r"resources\['num_gpus'\].*>= 0"),
        (dict(resources={"resources": {"TPU": "4"}}), TypeError, "must be a number"),
    ],
)
def test_build_processor_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        build_processor(MODEL, **kwargs)


@pytest.mark.parametrize(
    ("model", "engine_kwargs", "error", "match"),
    [
        ("/no/such/model/folder", {}, FileNotFoundError, "model='/no/such/model/folder'"),
        ("tiny-random-lama", {}, FileNotFoundError, "model='tiny-random-lama'"),
        (MODEL, {"max_model_len": 10**7}, ValueError, "max_model_len=10000000 exceeds"),
    ],
)
def test_build_processor_checks_the_model_before_ray_runs(model, engine_kwargs, error, match):
    """What every actor's LLM would refuse, refused in the driver (no Ray cluster here)."""
    with pytest.raises(error, match=match):
        build_processor(model, engine_kwargs=engine_kwargs)


def test_build_processor_refuses_a_folder_without_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_processor(str(tmp_path))


def test_processor_refuses_what_is_not_a_dataset():
    with pytest.raises(TypeError, match="ray.data.Dataset"):
        build_processor(MODEL)([{"prompt": "Hi"}])


def test_imports_without_ray_and_names_the_extra():
    code = (
        "import sys\n"
        "sys.modules['ray'] = None\n"  # as if ray were not installed
        "import jaxserve.ray as m\n"
        "try:\n"
        "    m.build_processor()\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "jaxserve[ray]" in result.stdout


def _batch(rows: list[dict]) -> pa.Table:
    """The rows as a pyarrow batch, as Ray Data hands it over: every column, null where a row
    has none (pa.Table.from_pylist alone takes the columns of the first row)."""
    names = list(dict.fromkeys(k for row in rows for k in row))
    return pa.Table.from_pylist([{k: row.get(k) for k in names} for row in rows])


@pytest.mark.parametrize(
    ("rows", "error", "match"),
    [
        ([{"id": 1, "tag": "a"}], ValueError, r"row 0 .*exactly one of .*got none"),
        (
            [{"id": 1, "prompt": "Hi"}, {"id": 2, "prompt": "Hi", "prompt_token_ids": [1, 2]}],
            ValueError,
            r"row 1 of the batch \(non-null columns \['id', 'prompt', 'prompt_token_ids'\]; "
            r"id=2\): needs exactly one of",
        ),
        ([{"prompt": 5}], TypeError, "'prompt' must be a str"),
        ([{"messages": "Hi"}], TypeError, "'messages' must be a list"),
        ([{"prompt": "Hi", "sampling_params": {"n": 2}}], ValueError, "n must be 1"),
        (
            [{"prompt": "Hi", "sampling_params": {"top_k": 0}}],
            ValueError,
            "'sampling_params': SamplingParams.top_k must be -1",
        ),
        ([{"prompt": "Hi", "sampling_params": {"bogus": 1}}], TypeError, "unknown .*bogus"),
        ([{"prompt": "Hi", "generated_text": "x"}], ValueError, "generated_text"),
        (
            [{"id": 0, "prompt": "Hi"}, {"id": 9, "prompt_token_ids": [1, 10**9]}],
            ValueError,
            r"row 1 .*id=9.*vocab",
        ),
    ],
)
def test_bad_rows_are_refused_naming_the_row(udf, rows, error, match):
    with pytest.raises(error, match=match):
        udf(_batch(rows))
    assert not udf.llm.engine.has_unfinished_requests()


def test_an_empty_batch_gets_typed_empty_output_columns(udf):
    out = udf(_batch([{"id": 0, "prompt": "Hi"}]).slice(0, 0))
    assert out.num_rows == 0
    assert out.schema.field("generated_token_ids").type == pa.list_(pa.int64())
    assert out.schema.field("logprobs").type == pa.list_(pa.float64())
    assert out.column_names[:2] == ["id", "prompt"]


def test_a_row_cannot_ask_logprobs_the_processor_has_no_column_for():
    udf = EngineActor(MODEL, ENGINE, {"temperature": 0.0})
    assert not udf.with_logprobs
    row = {"prompt": "Hi", "sampling_params": {"logprobs": 2}}
    with pytest.raises(ValueError, match="no logprobs column"):
        udf(_batch([row]))
