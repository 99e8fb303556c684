"""jaxserve score: the same numbers as LLM.score, per token and summed, resumable, and bad lines
refused before anything runs."""

from __future__ import annotations

import json
import math

import pytest

from jaxserve import LLM, cli

ENGINE = dict(warmup=False, max_model_len=128, num_kv_blocks=64, block_size=8)
FLAGS = ["--no-warmup", "--max-model-len", "128", "--num-kv-blocks", "64", "--block-size", "8"]


def _args(inp, out) -> list[str]:
    return ["score", "-i", str(inp), "-o", str(out), "--no-progress", *FLAGS]


@pytest.mark.slow
def test_scores_match_llm_score_and_a_rerun_finishes_the_rest(tmp_path, capsys):
    pairs = [
        {"id": "fr", "prompt": "The capital of France is", "continuation": " Paris"},
        {"prompt_token_ids": [1, 40, 41, 42], "continuation_token_ids": [43, 44, 45]},
        {"id": 7, "prompt": "Hello", "continuation_token_ids": [50]},
    ]
    inp, out = tmp_path / "pairs.jsonl", tmp_path / "scores.jsonl"
    inp.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    # A previous run that wrote one record and died in the middle of the next.
    out.write_text(
        json.dumps({"id": "fr", "logprob": -1.0, "token_logprobs": [-1.0], "num_tokens": 1})
        + '\n{"id": "1", "lo'
    )
    assert cli.main(_args(inp, out)) == 0
    assert "(1 done before this run, 2 scored" in capsys.readouterr().out
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == ["1", "7", "fr"] and records["fr"]["logprob"] == -1.0  # kept
    llm = LLM("tiny-random-llama", **ENGINE)
    expected = llm.score(
        [{"prompt_token_ids": [1, 40, 41, 42]}, "Hello"],
        [{"prompt_token_ids": [43, 44, 45]}, {"prompt_token_ids": [50]}],
    )
    for key, value in zip(["1", "7"], expected, strict=True):
        record = records[key]
        assert math.isclose(record["logprob"], value, rel_tol=1e-6, abs_tol=1e-6)
        assert math.isclose(sum(record["token_logprobs"]), value, rel_tol=1e-6, abs_tol=1e-6)
        assert record["num_tokens"] == len(record["token_logprobs"])
    assert records["1"]["num_tokens"] == 3
    assert cli.main(_args(inp, out)) == 0
    assert "nothing to do: all 3 pairs" in capsys.readouterr().out


def test_bad_lines_are_refused_with_their_line(tmp_path, capsys):
    inp, out = tmp_path / "pairs.jsonl", tmp_path / "scores.jsonl"
    cases = [
        ('{"prompt": "a"}\n', "pairs.jsonl:1: give exactly one of 'continuation'"),
        ('{"prompt": "a", "continuation": "b", "x": 1}\n', "unknown field 'x'"),
        ('{"id": 1, "prompt": "a", "continuation": "b"}\n{"id": "1", "prompt": "c", '
         '"continuation": "d"}\n', "pairs.jsonl:2: id '1' repeats line 1"),
        ('{"prompt": "a", "continuation_token_ids": [100000]}\n',
         "pairs.jsonl:1 (prompt + continuation): prompt_token_ids: token id 100000 is outside"),
        ('{"prompt_token_ids": ' + json.dumps(list(range(3, 200))) + ', "continuation": "b"}\n',
         "max_model_len"),
    ]  # fmt: skip
    for text, message in cases:
        inp.write_text(text)
        assert cli.main(_args(inp, out)) == 2
        assert message in capsys.readouterr().err
    # nothing scored: at most the job header (the results file is opened before the engine)
    lines = out.read_text().splitlines() if out.exists() else []
    assert len(lines) <= 1 and all("jaxserve_job" in json.loads(line) for line in lines)
