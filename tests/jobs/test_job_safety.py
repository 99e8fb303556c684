"""The jobs (generate --output, run-batch, score) never eat a user's file: an output that is not
this job's is refused untouched, the input cannot be the output, a resume after the input or
the settings changed is refused naming the first difference (--overwrite starts again), bad
input bytes name their file and line, and Ctrl-C exits 130 with one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxserve import cli
from jaxserve.jobs.job_spec import JobMismatchError, JobSpec, NotAResultsFileError
from jaxserve.jobs.results import ResultsFile
from jaxserve.jobs.run_batch import output_key, parse_batch_lines

ENGINE = [
    "--no-warmup", "--max-model-len", "64", "--max-num-seqs", "8",
    "--max-num-batched-tokens", "32", "--num-kv-blocks", "32", "--block-size", "8",
]  # fmt: skip
MODEL = "tiny-random-llama"


def _request(custom_id: str, prompt, **body) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def _write(path, items) -> None:
    path.write_text("".join(json.dumps(i) + "\n" for i in items))


def _argv(job: str, inp, out, *extra: str) -> list[str]:
    flags = ["--input", str(inp), "--output", str(out)]
    if job != "generate":
        flags = ["-i", str(inp), "-o", str(out)]
    # The session's compilation cache (tests/conftest.py; the processes a test starts inherit
    # it): the file's runs share one engine configuration, so later ones load its steps.
    return [job, *flags, "--no-progress", *ENGINE, *extra]


def _inputs(tmp_path):
    """One valid input per job."""
    batch, pairs, prompts = (tmp_path / n for n in ("batch.jsonl", "pairs.jsonl", "p.jsonl"))
    _write(batch, [_request("a", [5, 6, 7]), _request("b", [8, 9])])
    _write(pairs, [{"prompt_token_ids": [5, 6], "continuation_token_ids": [7]}] * 1
           + [{"prompt_token_ids": [8, 9], "continuation_token_ids": [10, 11]}])  # fmt: skip
    _write(prompts, [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}])
    return {"run-batch": batch, "score": pairs, "generate": prompts}


UNRELATED = (
    b'{"name": "my notes", "items": [1, 2, 3]}\n'
    b"some text the user cares about, 2026-12-03, do not lose it\n"
    b'{"id": "x", "what": "an object that is no result of any job, and a last line without'
)


@pytest.mark.parametrize("job", ["run-batch", "score", "generate"])
def test_an_output_that_is_not_this_jobs_is_refused_untouched(job, tmp_path, capsys):
    inp = _inputs(tmp_path)[job]
    for content in (UNRELATED, UNRELATED[UNRELATED.rindex(b"\n") + 1 :], b"\xff\xfe\n"):
        out = tmp_path / "notes.jsonl"
        out.write_bytes(content)
        assert cli.main(_argv(job, inp, out)) == 2
        err = capsys.readouterr().err
        assert "notes.jsonl" in err and ("refusing to modify" in err or "not " in err)
        assert out.read_bytes() == content  # not truncated, not appended to
        # --overwrite replaces only what a jaxserve job wrote
        assert cli.main(_argv(job, inp, out, "--overwrite")) == 2
        assert out.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir() if "notes" in p.name) == ["notes.jsonl"]


@pytest.mark.parametrize("job", ["run-batch", "score", "generate"])
def test_the_input_cannot_be_the_output(job, tmp_path, capsys):
    inp = _inputs(tmp_path)[job]
    content = inp.read_bytes()
    link = tmp_path / "hardlink.jsonl"
    os.link(inp, link)
    dotted = tmp_path / "." / inp.name
    for out in (inp, dotted, link):
        assert cli.main(_argv(job, inp, out)) == 2
        assert "are the same file" in capsys.readouterr().err
        assert inp.read_bytes() == content


@pytest.mark.parametrize(
    ("job", "text", "match"),
    [
        ("run-batch", b'{"custom_id": "a"}\n{"custom_id": "\xff"}\n', "batch.jsonl:2: not UTF-8"),
        ("score", b'{"prompt": "a", "continuation": "b"}\n\xc3(\n', "pairs.jsonl:2: not UTF-8"),
        ("generate", b'{"prompt": "a"}\n\n{"prompt": "\xe9"}\n', "p.jsonl:3: not UTF-8"),
        ("run-batch", b"[" * 50_000 + b"]" * 50_000 + b"\n", "batch.jsonl:1: JSON nested too"),
        ("score", b'{"prompt": "a", "continuation": "b"}\n' + b"[" * 50_000, "pairs.jsonl:2: JSON"),
        ("generate", b'{"prompt": ' + b"[" * 50_000 + b"\n", "p.jsonl:1: JSON nested too deeply"),
    ],
    ids=["batch-utf8", "score-utf8", "generate-utf8", "batch-deep", "score-deep", "generate-deep"],
)
def test_bad_bytes_and_deep_lines_name_the_file_and_line(job, text, match, tmp_path, capsys):
    inp = _inputs(tmp_path)[job]
    inp.write_bytes(text)
    out = tmp_path / "out.jsonl"
    assert cli.main(_argv(job, inp, out)) == 2  # an exit code, not a traceback
    assert match in capsys.readouterr().err
    assert not out.exists()


def test_a_custom_id_that_reads_like_a_bad_lines_id_does_not_collide():
    lines = parse_batch_lines([json.dumps(_request("line 2", "x")), "not json"], "in.jsonl")
    assert len({item.key for item in lines}) == 2
    bad = {"id": "r", "custom_id": None, "response": None, "error": {"line": 2}}
    named = {"id": "s", "custom_id": "line 2", "response": {}, "error": None}
    assert output_key(bad) == lines[1].key != output_key(named) == lines[0].key


def _job(**hashes: str) -> JobSpec:
    return JobSpec("score", {"model": MODEL}, hashes, frozenset({"id", "logprob"}))


def test_results_file_header_and_hashes_are_checked_before_anything_changes(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultsFile(path, lambda r: r["id"], job=_job(a="h1", b="h2")) as results:
        results.append({"id": "a", "logprob": -1.0, "input_hash": "h1"})
    written = path.read_bytes() + b'{"id": "b", "lo'  # and a torn line
    path.write_bytes(written)
    cases = [
        (_job(a="h9", b="h2"), "the request of id 'a' changed"),
        (_job(b="h2"), "id 'a', which the input no longer has"),
        (JobSpec("score", {"model": "m2"}, {"a": "h1"}), "model = 'tiny-random-llama', this"),
        (JobSpec("run-batch", {"model": MODEL}, {"a": "h1"}), "kind 'score', this one has"),
    ]
    for job, match in cases:
        with pytest.raises(JobMismatchError, match=match):
            ResultsFile(path, lambda r: r["id"], job=job)
        assert path.read_bytes() == written  # the torn line too: nothing changed
    results = ResultsFile(path, lambda r: r["id"], job=_job(a="h1", b="h2"))
    assert results.done == {"a"} and results.num_torn_dropped == len(b'{"id": "b", "lo')
    results.close()
    again = ResultsFile(path, lambda r: r["id"], job=_job(a="h9"), overwrite=True)
    assert again.done == set()
    again.close()
    assert [json.loads(line)["jaxserve_job"]["kind"] for line in path.read_text().splitlines()] == [
        "score"
    ]


def test_an_older_header_less_results_file_is_taken_only_if_every_line_is_this_jobs(tmp_path):
    path = tmp_path / "out.jsonl"
    old = b'{"id": "a", "logprob": -1.0}\n{"id": "b", "lo'
    path.write_bytes(old)
    assert ResultsFile(path, lambda r: r["id"], job=_job(a="h1", b="h2")).done == {"a"}
    for text in (b'{"id": "a", "logprob": -1.0}\n{"id": "z", "logprob": 0}\n', b'{"id": "a"}\n'):
        path.write_bytes(text)
        with pytest.raises(NotAResultsFileError, match="not a result of this score job"):
            ResultsFile(path, lambda r: r["id"], job=_job(a="h1"))
        assert path.read_bytes() == text


@pytest.mark.slow
def test_run_batch_resume_refuses_a_changed_input_or_model_and_overwrite_starts_again(
    tmp_path, capsys
):
    inp, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    items = [_request("a", [5, 6, 7]), _request("b", [8, 9]), _request("c", [10])]
    _write(inp, items)
    assert cli.main(_argv("run-batch", inp, out)) == 0
    done = out.read_bytes()
    capsys.readouterr()
    changed = [items[0], _request("b", [8, 9], max_tokens=3), items[2]]
    refusals = [
        (changed, [], "the request of id 'b' changed"),
        ([items[0], items[2]], [], "id 'b', which the input no longer has"),
        (items, ["--model", "another-model"], "model = 'tiny-random-llama', this run has model"),
        (items, ["--served-model-name", "x"], "served_model_name = 'tiny-random-llama'"),
        (items, ["--dtype", "bfloat16"], "dtype = None, this run has dtype = 'bfloat16'"),
    ]
    for lines, extra, match in refusals:
        _write(inp, lines)
        assert cli.main(_argv("run-batch", inp, out, *extra)) == 2
        assert match in capsys.readouterr().err
        assert out.read_bytes() == done
    _write(inp, changed)
    assert cli.main(_argv("run-batch", inp, out, "--overwrite")) == 0
    header, *records = map(json.loads, out.read_text().splitlines())
    assert header["jaxserve_job"]["settings"]["model"] == MODEL
    by_id = {r["custom_id"]: r for r in records}
    assert sorted(by_id) == ["a", "b", "c"]
    assert by_id["b"]["response"]["body"]["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_score_implicit_ids_cannot_name_another_pair_after_a_line_is_deleted(tmp_path, capsys):
    inp, out = tmp_path / "pairs.jsonl", tmp_path / "out.jsonl"
    pairs = [
        {"prompt_token_ids": [5, 6], "continuation_token_ids": [7]},
        {"prompt_token_ids": [8, 9], "continuation_token_ids": [10, 11]},
    ]
    _write(inp, pairs)
    assert cli.main(_argv("score", inp, out)) == 0
    done = out.read_bytes()
    _write(inp, pairs[1:])  # the second pair's implicit id is now "0"
    capsys.readouterr()
    assert cli.main(_argv("score", inp, out)) == 2
    assert "the request of id '0' changed" in capsys.readouterr().err
    assert out.read_bytes() == done


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["loading", "running"])
def test_ctrl_c_exits_130_with_one_line_and_the_rerun_finishes(moment, tmp_path):
    """SIGINT while the engine loads (the header is out) or once records are being written."""
    inp, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    num = 48
    _write(inp, [_request(f"r{i}", [5 + i, 6, 7], max_tokens=16) for i in range(num)])
    command = [sys.executable, "-m", "jaxserve.cli", *_argv("run-batch", inp, out)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines_before_sigint = 1 if moment == "loading" else 2  # the header, then a first record
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= lines_before_sigint:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert f"interrupted; the results so far are in {out}: rerun the same command" in err
    assert out.read_bytes().count(b"\n") >= lines_before_sigint  # what was written stays
    # The rerun in this process: the same cli.main, without an interpreter's start.
    assert cli.main(_argv("run-batch", inp, out)) == 0
    header, *records = map(json.loads, out.read_text().splitlines())
    assert sorted(r["custom_id"] for r in records) == sorted(f"r{i}" for i in range(num))
