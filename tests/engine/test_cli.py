"""jaxserve CLI: JSONL parsing and validation, output records, summary, subcommand hook, and one
end-to-end run of ``jaxserve generate`` on the built-in demo model."""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from jaxserve import cli
from jaxserve.cli import flags
from jaxserve.cli import generate as generate_cli
from jaxserve.jobs.generate import (
    PromptRequest,
    format_completion,
    format_summary,
    output_records,
    parse_prompt_line,
    read_prompt_lines,
    write_jsonl,
)
from jaxserve.jobs.jsonl import InputError
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import SamplingParams

STATS = {
    "num_kv_blocks": 65,
    "num_usable_kv_blocks": 64,
    "num_free_kv_blocks": 48,
    "kv_cache_usage": 0.25,
    "prefix_cache_queries": 40,
    "prefix_cache_hits": 10,
    "num_preemptions": 1,
    "num_steps": 7,
    "num_compilations": 3,
    "num_compilation_cache_hits": 2,
    "peak_kv_slot_utilization": 0.5,
}


def _results(path: pathlib.Path) -> list[dict]:
    """The records of a --output file (its first line is the job header)."""
    header, *records = [json.loads(line) for line in path.read_text().splitlines()]
    assert header["jaxserve_job"]["kind"] == "generate"
    return records


def generate_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["generate", *argv])


def test_parse_text_and_token_prompts() -> None:
    request = parse_prompt_line('{"prompt": "Hi"}', "p.jsonl:1", {}, 0)
    assert request == PromptRequest("0", "Hi", None, SamplingParams())
    assert request.engine_prompt() == "Hi"
    request = parse_prompt_line(
        '{"prompt_token_ids": [1, 5], "request_id": "a"}', "p.jsonl:2", {}, 1
    )
    assert request.request_id == "a" and request.prompt_token_ids == [1, 5]
    assert request.engine_prompt() == {"prompt_token_ids": [1, 5]}


def test_line_sampling_fields_override_command_line_defaults() -> None:
    defaults = {"temperature": 0.0, "max_tokens": 4, "stop": ["x"]}
    line = '{"prompt": "Hi", "max_tokens": 9, "stop": "y", "seed": 3, "logprobs": 2}'
    params = parse_prompt_line(line, "p.jsonl:1", defaults, 0).params
    assert params.temperature == 0.0 and params.max_tokens == 9
    assert params.stop_strings == ("y",) and params.seed == 3 and params.logprobs == 2


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"prompt": "Hi"', r"p.jsonl:7: not valid JSON"),
        ('["Hi"]', r"p.jsonl:7: expected a JSON object, got list"),
        ('{"prompt": "Hi", "temprature": 0}', r"p.jsonl:7: unknown field 'temprature'"),
        ('{"max_tokens": 3}', r"p.jsonl:7: give exactly one of 'prompt' and 'prompt_token_ids'"),
        ('{"prompt": "a", "prompt_token_ids": [1]}', r"p.jsonl:7: give exactly one of"),
        ('{"prompt": ""}', r"p.jsonl:7: field 'prompt' must be a non-empty string"),
        ('{"prompt": 5}', r"p.jsonl:7: field 'prompt' must be a non-empty string"),
        ('{"prompt_token_ids": []}', r"p.jsonl:7: field 'prompt_token_ids' must be a non-empty"),
        ('{"prompt_token_ids": [1, -2]}', r"p.jsonl:7: field 'prompt_token_ids'"),
        ('{"prompt_token_ids": [1, true]}', r"p.jsonl:7: field 'prompt_token_ids'"),
        ('{"prompt": "Hi", "request_id": [1]}', r"p.jsonl:7: field 'request_id' must be"),
        ('{"prompt": "Hi", "temperature": -1}', r"p.jsonl:7: SamplingParams.temperature must"),
        ('{"prompt": "Hi", "max_tokens": "4"}', r"p.jsonl:7: SamplingParams.max_tokens must be"),
        ('{"prompt": "Hi", "stop": [""]}', r"p.jsonl:7: SamplingParams.stop must not"),
    ],
)
def test_bad_line_names_the_line_and_the_field(line: str, match: str) -> None:
    with pytest.raises(InputError, match=match):
        parse_prompt_line(line, "p.jsonl:7", {}, 0)


def test_read_prompt_lines_numbers_lines_skips_blanks_and_rejects_duplicate_ids() -> None:
    lines = ['{"prompt": "a"}\n', "\n", '{"prompt": "b", "request_id": 7}\n']
    requests = read_prompt_lines(lines, "p.jsonl", {"max_tokens": 2})
    assert [r.request_id for r in requests] == ["0", "7"]
    assert all(r.params.max_tokens == 2 for r in requests)
    with pytest.raises(InputError, match=r"p.jsonl:3: not valid JSON"):
        read_prompt_lines(['{"prompt": "a"}', "", "nope"], "p.jsonl", {})
    with pytest.raises(InputError, match=r"p.jsonl:2: field 'request_id' '0' repeats line 1"):
        read_prompt_lines(['{"prompt": "a"}', '{"prompt": "b", "request_id": "0"}'], "p.jsonl", {})
    with pytest.raises(InputError, match="p.jsonl: no prompts"):
        read_prompt_lines(["\n"], "p.jsonl", {})


def test_flags_map_to_sampling_defaults_and_engine_kwargs() -> None:
    args = generate_args(
        "--prompt", "a", "--stop", "x", "--stop", "y", "--top-p", "0.5", "--ignore-eos",
        "--seed", "3", "--no-prefix-caching", "--num-kv-blocks", "32",
        "--no-calculate-kv-scales",
    )  # fmt: skip
    assert flags.sampling_defaults(args) == {"stop": ["x", "y"], "top_p": 0.5, "ignore_eos": True}
    assert flags.engine_kwargs(args) == {
        "num_kv_blocks": 32,
        "enable_prefix_caching": False,
        "seed": 3,
        "calculate_kv_scales": False,
    }
    requests = generate_cli.collect_requests(args)
    assert [(r.request_id, r.prompt) for r in requests] == [("0", "a")]
    assert requests[0].params.stop_strings == ("x", "y") and requests[0].params.seed is None
    bare = generate_args("--prompt", "a")
    assert flags.sampling_defaults(bare) == {} and flags.engine_kwargs(bare) == {}


def test_negated_flags_reach_engine_kwargs_and_a_replicas_command_line() -> None:
    args = generate_args("--prompt", "a", "--no-enable-background-warmup",
                         "--no-async-scheduling", "--max-num-seqs", "4")  # fmt: skip
    assert flags.engine_kwargs(args) == {
        "enable_background_warmup": False, "async_scheduling": False, "max_num_seqs": 4,
    }  # fmt: skip
    argv = flags.engine_argv(args)
    assert "--no-enable-background-warmup" in argv and "--no-async-scheduling" in argv
    again = generate_args("--prompt", "a", *argv)
    assert flags.engine_kwargs(again) == flags.engine_kwargs(args)


def test_bad_jsonl_exits_2_naming_line_and_field(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": "Hi", "top_k": 0}\n')
    assert cli.main(["generate", "--input", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert f"{prompts}:2: SamplingParams.top_k" in err


def test_bad_flags_and_missing_file_exit_2(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["generate", "--prompt", "a", "--temperature", "-1"]) == 2
    assert "command line: SamplingParams.temperature must be >= 0" in capsys.readouterr().err
    assert cli.main(["generate", "--input", str(tmp_path / "nope.jsonl")]) == 2
    assert "--input: cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse: --prompt and --input exclude
        cli.main(["generate", "--prompt", "a", "--input", "x.jsonl"])
    assert exit_info.value.code == 2


def test_script_exit_code_without_loading_the_engine(tmp_path: pathlib.Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hi", "n": 0}\n')
    result = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--input", str(prompts)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert f"{prompts}:1: SamplingParams.n must be >= 1" in result.stderr


def _request_output() -> RequestOutput:
    logprobs = [
        {5: Logprob(-0.5, 1, "a"), 6: Logprob(-1.5, 2, "b")},
        {7: Logprob(-2.0, 3, "c"), 5: Logprob(-0.25, 1, "a")},
    ]
    return RequestOutput(
        request_id="engine-id-0",
        prompt="Hi",
        prompt_token_ids=[1, 9],
        prompt_logprobs=None,
        outputs=[
            CompletionOutput(0, "ac", [5, 7], -2.5, logprobs, "length"),
            CompletionOutput(1, "", [2], -0.1, [{2: Logprob(-0.1, 1, "</s>")}], "stop", 2),
        ],
        finished=True,
    )


def test_output_records_one_per_completion_with_logprobs() -> None:
    request = PromptRequest("r1", "Hi", None, SamplingParams(n=2, logprobs=1))
    records = output_records(request, _request_output())
    assert [r["index"] for r in records] == [0, 1]
    assert records[0] == {
        "request_id": "r1",
        "index": 0,
        "prompt": "Hi",
        "prompt_token_ids": [1, 9],
        "text": "ac",
        "token_ids": [5, 7],
        "finish_reason": "length",
        "stop_reason": None,
        "cumulative_logprob": -2.5,
        "logprobs": [
            [
                {"token_id": 5, "logprob": -0.5, "rank": 1, "decoded_token": "a"},
                {"token_id": 6, "logprob": -1.5, "rank": 2, "decoded_token": "b"},
            ],
            [
                {"token_id": 7, "logprob": -2.0, "rank": 3, "decoded_token": "c"},
                {"token_id": 5, "logprob": -0.25, "rank": 1, "decoded_token": "a"},
            ],
        ],
    }
    assert records[1]["stop_reason"] == 2 and records[1]["finish_reason"] == "stop"
    without = output_records(PromptRequest("r1", "Hi", None, SamplingParams()), _request_output())
    assert "logprobs" not in without[0]
    out = io.StringIO()
    write_jsonl(records, out)
    assert [json.loads(line) for line in out.getvalue().splitlines()] == records


def test_format_completion_shows_token_ids_when_there_is_no_text() -> None:
    records = output_records(
        PromptRequest("r1", "Hi", None, SamplingParams(n=2)), _request_output()
    )
    assert format_completion(records[0]) == ("[r1.0] 'Hi' -> 'ac' (2 tokens, finish_reason=length)")
    assert format_completion(records[1]) == (
        "[r1.1] 'Hi' -> token_ids=[2] (1 tokens, finish_reason=stop)"
    )


def test_format_summary() -> None:
    summary = format_summary([_request_output()], STATS, elapsed_s=0.5, load_s=2.0)
    assert "requests:           1 (2 completions)" in summary
    assert "prompt tokens:      2" in summary
    assert "output tokens:      3" in summary
    assert "output throughput:  6.0 tokens/s" in summary
    assert "16/64 blocks in use (25.0%), peak slot utilization 50.0%" in summary
    assert "prefix cache hits:  25.0% (10/40 tokens)" in summary
    assert "7 steps, 1 preemptions, 3 compilations (2 more loaded from the cache)" in summary
    empty = format_summary([], {**STATS, "prefix_cache_queries": 0}, elapsed_s=0.1, load_s=0.0)
    assert "prefix cache hits:  n/a (10/0 tokens)" in empty


def test_subcommand_hook(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "fake_convert.py").write_text(
        textwrap.dedent(
            """
            def add_parser(subparsers):
                p = subparsers.add_parser("fake-convert", help="HF -> Orbax")
                p.add_argument("src")
                p.set_defaults(run=lambda args: print("converting", args.src) or 0)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, cli.lazy_subcommand("fake_convert")])
    assert cli.main(["fake-convert", "ckpt"]) == 0
    assert capsys.readouterr().out == "converting ckpt\n"


@pytest.mark.slow
def test_generate_end_to_end(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from jaxserve.checkpoints_tools.tiny_random import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "The quick brown fox", "request_id": "text"},
        {"prompt_token_ids": [1, 40, 41, 42, 43], "n": 2, "temperature": 1.0, "seed": 7},
        {"prompt": "Hello world", "logprobs": 2, "temperature": 0.0},
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    argv = [
        "generate", "--input", str(prompts), "--output", str(out), "--no-progress",
        "--max-tokens", "4", "--temperature", "0",
        # Small buckets, and no warm-up (it would compile all 16 step and copy shapes; the
        # startup bench's demo runs `jaxserve generate` warmed up): the steps compile as used.
        "--max-model-len", "32", "--num-kv-blocks", "16", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "16", "--no-warmup",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    # Written as requests finish (async scheduling admits the n=2 forks a step later): put
    # them in input order.
    order = {"text": 0, "1": 1, "2": 2}
    records = sorted(_results(out), key=lambda r: (order[r["request_id"]], r["index"]))
    assert [(r["request_id"], r["index"]) for r in records] == [
        ("text", 0),
        ("1", 0),
        ("1", 1),
        ("2", 0),
    ]
    for record in records:
        assert 1 <= len(record["token_ids"]) <= 4
        assert record["finish_reason"] in ("length", "stop")
        assert record["text"] == tokenizer.decode(record["token_ids"], skip_special_tokens=True)
    assert records[1]["prompt"] is None and records[1]["prompt_token_ids"] == [1, 40, 41, 42, 43]
    prompt_ids = records[0]["prompt_token_ids"]
    assert tokenizer.decode(prompt_ids, skip_special_tokens=True) == "The quick brown fox"
    logprobs = records[3]["logprobs"]
    assert len(logprobs) == len(records[3]["token_ids"])
    for position, token_id in zip(logprobs, records[3]["token_ids"], strict=True):
        assert position[0]["token_id"] == token_id  # greedy: the sampled token is the top one
        assert position[0]["rank"] == 1 and len(position) >= 2
    assert "logprobs" not in records[0]
    summary = capsys.readouterr().out
    assert "requests:           3 (4 completions)" in summary
    assert f"output tokens:      {sum(len(r['token_ids']) for r in records)}" in summary


SMALL_ENGINE = [
    # Small buckets (token buckets up to 16, 8 rows), no warm-up: few XLA compilations.
    "--max-model-len", "32", "--num-kv-blocks", "16", "--max-num-seqs", "8",
    "--max-num-batched-tokens", "16", "--no-warmup",
]  # fmt: skip


@pytest.mark.slow
def test_prompts_at_the_length_limit(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    lines = [{"prompt_token_ids": [5] * n, "request_id": f"len{n}"} for n in (31, 32)]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(prompts), "--output", str(out), "--no-progress"]
    assert cli.main([*argv, "--max-tokens", "4", *SMALL_ENGINE]) == 0
    records = _results(out)
    assert [(r["request_id"], len(r["token_ids"]), r["finish_reason"]) for r in records] == [
        ("len31", 1, "length"),
        ("len32", 1, "length"),
    ]
    with prompts.open("a") as f:
        f.write(json.dumps({"prompt_token_ids": [5] * 33, "request_id": "len33"}) + "\n")
    assert cli.main([*argv, "--max-tokens", "4", *SMALL_ENGINE]) == 2
    err = capsys.readouterr().err
    assert f"{prompts}:3 (request_id 'len33'): prompt has 33 tokens, more than " in err
    assert "max_model_len=32" in err


def test_engine_side_errors_name_the_line_and_request_id(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt_token_ids": [5, 99999]}\n')
    assert cli.main(["generate", "--input", str(prompts), *SMALL_ENGINE]) == 2
    err = capsys.readouterr().err
    assert f"{prompts}:2 (request_id '1'): prompt_token_ids: token id 99999 is outside" in err
    assert cli.main(["generate", "--prompt", "ok", "--prompt", "a\ud800", *SMALL_ENGINE]) == 2
    assert (
        "--prompt 2 (request_id '1'): prompt text is not valid Unicode" in capsys.readouterr().err
    )


def test_missing_or_malformed_model_exits_2(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-model"
    assert cli.main(["generate", "--prompt", "a", "--model", str(missing)]) == 2
    assert f"model {str(missing)!r} is neither a built-in model" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert cli.main(["generate", "--prompt", "a", "--model", str(broken)]) == 2
    assert f"{broken / 'config.json'}: malformed JSON" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_resumes_after_an_interrupted_run(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An output left by a killed run (request a complete, b's n=2 group cut after one record,
    a torn last line): the rerun keeps a, reruns b whole and c, each request's records once."""
    prompts = tmp_path / "p.jsonl"
    lines = [
        {"prompt_token_ids": [5, 6, 7], "request_id": "a", "temperature": 0},
        {"prompt_token_ids": [8, 9], "request_id": "b", "n": 2, "seed": 3},
        {"prompt_token_ids": [10, 11, 12, 13], "request_id": "c", "prompt_logprobs": 1, "seed": 4},
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(prompts), "--output", str(out), "--no-progress"]
    assert cli.main([*argv, "--max-tokens", "3", *SMALL_ENGINE]) == 0
    header = out.read_text().splitlines()[0]
    full = _results(out)
    by_key = {(r["request_id"], r["index"]): r for r in full}
    assert sorted(by_key) == [("a", 0), ("b", 0), ("b", 1), ("c", 0)]
    prompt_logprobs = by_key[("c", 0)]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == 4
    assert prompt_logprobs[1][0]["token_id"] == 11  # the prompt token first, then the top-1
    survivor = [json.dumps(by_key[("a", 0)]), json.dumps(by_key[("b", 0)])]
    out.write_text("\n".join([header, *survivor]) + '\n{"request_id": "c", "ind')
    capsys.readouterr()
    assert cli.main([*argv, "--max-tokens", "3", *SMALL_ENGINE]) == 0
    assert "already done:       1 requests" in capsys.readouterr().out
    again = _results(out)
    assert sorted((r["request_id"], r["index"]) for r in again) == sorted(by_key)
    assert {(r["request_id"], r["index"]): r["token_ids"] for r in again} == {
        k: r["token_ids"] for k, r in by_key.items()
    }
    # A resume with another sampling flag or a changed line is refused, naming it.
    done = out.read_bytes()
    assert cli.main([*argv, "--max-tokens", "4", *SMALL_ENGINE]) == 2
    assert (
        "sampling.max_tokens = 3, this run has sampling.max_tokens = 4" in capsys.readouterr().err
    )
    lines[0]["prompt_token_ids"] = [5, 6, 8]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert cli.main([*argv, "--max-tokens", "3", *SMALL_ENGINE]) == 2
    assert "the request of id 'a' changed" in capsys.readouterr().err
    assert out.read_bytes() == done


def test_quantization_flag_reaches_the_engine_kwargs() -> None:
    args = generate_args("--prompt", "a", "--quantization", "fp8")
    assert flags.engine_kwargs(args) == {"quantization": "fp8"}
    with pytest.raises(SystemExit):
        generate_args("--prompt", "a", "--quantization", "int4")
