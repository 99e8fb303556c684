"""jaxserve run-batch: OpenAI's batch format in and out, bad lines answered line by line, and a
job killed with SIGKILL three times that still ends with every line once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from jaxserve import cli

ENGINE_KW = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
                 num_kv_blocks=96, block_size=8)  # fmt: skip


def _flags(**engine) -> list[str]:
    """run-batch's engine flags for LLM arguments ``engine`` (no warm-up)."""
    return [
        "--no-warmup",
        *(a for k, v in engine.items() for a in (f"--{k.replace('_', '-')}", str(v))),
    ]


ENGINE = _flags(**ENGINE_KW)
MODEL = "tiny-random-llama"


TOOL = {"type": "function", "function": {"name": "noop", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}  # fmt: skip
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}


def _completion(custom_id: str, prompt, structured_outputs=None, **body) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **body}
    if structured_outputs is not None:
        body["structured_outputs"] = structured_outputs
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def _write(path, items) -> None:
    path.write_text("".join(i if isinstance(i, str) else json.dumps(i) + "\n" for i in items))


def _results(path) -> list[dict]:
    """The records of a results file (its first line is the job header)."""
    header, *records = map(json.loads, path.read_text().splitlines())
    assert header["jaxserve_job"]["kind"] == "run-batch"
    return records


def _records(path) -> dict:
    return {
        r["custom_id"] if r["custom_id"] is not None else f"line {r['error']['line']}": r
        for r in _results(path)
    }


def _run_batch_args(inp, out, engine=ENGINE) -> list[str]:
    """The runs use the session's compilation cache (tests/conftest.py; the processes a test
    starts inherit it): a later run of a configuration loads its steps, not compiles them."""
    return ["run-batch", "-i", str(inp), "-o", str(out), "--no-progress", *engine]


@pytest.mark.slow
def test_every_line_is_answered_and_a_rerun_has_nothing_to_do(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    _write(
        inp,
        [
            _completion("text", "The quick brown fox"),
            _completion("ids", [1, 40, 41, 42], n=2, logprobs=2),
            {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
            _completion("bad-temp", "x", temperature=-1),
            _completion("bad-model", "x", model="other"),
            _completion("too-long", list(range(3, 300))),
            {"custom_id": "url", "method": "POST", "url": "/v1/embeddings", "body": {}},
            {"custom_id": "stream", "url": "/v1/completions", "body": {"stream": True}},
            "\n",
            "not json\n",
            {"method": "POST", "url": "/v1/completions", "body": {}},
            # Constraints and tools, through the server's handlers.
            _completion("choice", "Spam?", extra_choice := {"choice": ["spam", "ham"]}),
            {"custom_id": "tool", "method": "POST", "url": "/v1/chat/completions",
             "body": {**chat, "max_tokens": 40, "tools": [TOOL], "tool_choice": "required",
                      "parallel_tool_calls": False}},
            _completion("bad-schema", "x", response_format=BAD_SCHEMA),
        ],
    )  # fmt: skip
    assert cli.main(_run_batch_args(inp, out)) == 0
    records = _records(out)
    assert len(_results(out)) == len(records) == 13
    ok = {k: r for k, r in records.items() if r["response"] and r["response"]["status_code"] == 200}
    assert set(ok) == {"text", "ids", "chat", "choice", "tool"}
    assert ok["choice"]["response"]["body"]["choices"][0]["text"] in extra_choice["choice"]
    (call,) = ok["tool"]["response"]["body"]["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "noop"
    bad = records["bad-schema"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "response_format"
    body = ok["ids"]["response"]["body"]
    assert body["object"] == "text_completion" and len(body["choices"]) == 2
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20}
    assert len(body["choices"][0]["logprobs"]["top_logprobs"]) == 8
    assert ok["chat"]["response"]["body"]["object"] == "chat.completion"
    assert records["bad-temp"]["response"]["status_code"] == 400
    assert "temperature" in records["bad-temp"]["response"]["body"]["error"]["message"]
    assert records["bad-model"]["response"]["status_code"] == 404
    assert records["too-long"]["response"]["status_code"] == 400
    for key, words in (("url", "'url'"), ("stream", "stream"), ("line 10", "not valid JSON")):
        assert records[key]["response"] is None and words in records[key]["error"]["message"]
    assert "custom_id" in records["line 11"]["error"]["message"]
    # The greedy text is what LLM.generate gives (the same engine, the same handlers' params).
    from jaxserve import LLM, SamplingParams

    llm = LLM(MODEL, warmup=False, **ENGINE_KW)  # ENGINE's: it loads the steps run-batch compiled
    (expected,) = llm.generate(
        "The quick brown fox", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    assert ok["text"]["response"]["body"]["choices"][0]["text"] == expected.outputs[0].text
    capsys.readouterr()
    assert cli.main(_run_batch_args(inp, out)) == 0
    assert "nothing to do: all 13 requests" in capsys.readouterr().out


def test_a_repeated_custom_id_is_refused_before_anything_runs(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [_completion("a", "x"), _completion("b", "y"), _completion("a", "z")])
    assert cli.main(_run_batch_args(inp, out)) == 2
    assert "in.jsonl:3: custom_id 'a' repeats line 1" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_a_job_killed_twice_ends_with_every_line_once(tmp_path):
    """200 lines; SIGKILL at 2 random moments, each time resumed; then compared with an
    uninterrupted run of the same job. Two kills take the paths that matter: a kill mid-write,
    a resume, a kill of a resumed run, a final resume (each further kill is one more process
    start for the same paths)."""
    rng = random.Random(0)
    inp = tmp_path / "in.jsonl"
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(4, 40))] for _ in range(200)]
    _write(
        inp,
        [_completion(f"r{i}", p, max_tokens=rng.randrange(2, 12)) for i, p in enumerate(prompts)],
    )
    # Fewer shapes than ENGINE's (T <= 16, 8 blocks a row): fewer steps to compile, and to trace
    # in each process; the longest request (39 + 11 tokens) still takes several prefill chunks.
    engine = _flags(**{**ENGINE_KW, "max_model_len": 64, "max_num_batched_tokens": 16})

    def args(out) -> list[str]:  # the runs share a compilation cache, as a job's do by default
        return _run_batch_args(inp, out, engine)

    reference = tmp_path / "reference.jsonl"  # in this process: no interpreter to start
    assert cli.main(args(reference)) == 0
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "jaxserve.cli", *args(out)]
    kills = 0
    deadline = time.monotonic() + 600
    while kills < 2 and time.monotonic() < deadline:
        before = len(out.read_text().splitlines()) if out.exists() else 0
        target = before + rng.randrange(1, 30)  # kill once this many lines are out, or so
        proc = subprocess.Popen(command, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if out.exists() and len(out.read_bytes().split(b"\n")) > target:
                    break
                time.sleep(rng.uniform(0.0, 0.05))
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait(timeout=60)
        if proc.returncode == 0:
            break  # it finished before the kill came
    assert kills == 2
    assert len(out.read_text().splitlines()) <= 200  # header and records: lines are left
    assert cli.main(args(out)) == 0  # the final resume, in this process
    ids = [r["custom_id"] for r in _results(out)]
    assert len(ids) == 200 and sorted(ids) == sorted(f"r{i}" for i in range(200))

    def texts(path):
        return {k: r["response"]["body"]["choices"][0]["text"] for k, r in _records(path).items()}

    assert texts(out) == texts(reference)


def test_speculative_decoding_does_not_change_a_batch_job(tmp_path):
    """run-batch with --speculative-config answers every line as without it: greedy, seeded,
    n > 1, logprobs, a stop string and a chat (the texts, usage and logprob tokens)."""
    inp = tmp_path / "in.jsonl"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "ab ab ab ab"}],
            "max_tokens": 12, "temperature": 0}  # fmt: skip
    _write(inp, [
        _completion("rep", "abc abc abc abc abc abc", max_tokens=16),
        _completion("ids", [40, 41, 42] * 6, max_tokens=16, logprobs=2),
        _completion("seeded", "the the the the", temperature=0.9, seed=5, n=2, max_tokens=12),
        _completion("stop", "xyz xyz xyz xyz", max_tokens=16, stop=["z"]),
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
    ])  # fmt: skip
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "policy": "always"}'
    bodies = []
    for name, extra in (("plain", []), ("spec", ["--speculative-config", spec])):
        out = tmp_path / f"{name}.jsonl"
        assert cli.main([*_run_batch_args(inp, out), *extra]) == 0
        records = _records(out)
        assert {r["response"]["status_code"] for r in records.values()} == {200}
        bodies.append({k: r["response"]["body"] for k, r in records.items()})
    plain, spec_bodies = bodies
    for key in plain:
        a, b = plain[key], spec_bodies[key]
        assert a["usage"] == b["usage"], key
        for ca, cb in zip(a["choices"], b["choices"], strict=True):
            assert ca.get("text", ca.get("message")) == cb.get("text", cb.get("message")), key
            assert ca.get("logprobs") == cb.get("logprobs") or key == "ids", key
            assert ca["finish_reason"] == cb["finish_reason"], key
    lp_a = plain["ids"]["choices"][0]["logprobs"]
    lp_b = spec_bodies["ids"]["choices"][0]["logprobs"]
    assert lp_a["tokens"] == lp_b["tokens"]
    assert lp_a["token_logprobs"] == pytest.approx(lp_b["token_logprobs"], abs=1e-4)


@pytest.mark.slow
def test_a_batch_job_warms_up_only_its_own_shapes(tmp_path, monkeypatch):
    """run-batch reads its requests through the handlers (checks only) and compiles the shapes
    they reach before the first runs: fewer than the full set, and none after."""
    from jaxserve.engine.async_llm import AsyncLLM

    seen = []
    shutdown = AsyncLLM.shutdown
    monkeypatch.setattr(
        AsyncLLM, "shutdown", lambda self: seen.append((self.get_stats(), self.engine.runner))
        or shutdown(self),
    )  # fmt: skip
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
    _write(inp, [
        _completion("a", "The quick brown fox", n=2, temperature=0.8),
        _completion("b", [1, 40, 41, 42, 43, 44], presence_penalty=0.5),
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        _completion("bad", "x", temperature=-1),
    ])  # fmt: skip
    args = [a for a in _run_batch_args(inp, out) if a != "--no-warmup"]
    assert cli.main(args) == 0
    ((stats, runner),) = seen
    assert stats["recompilations"] == []
    compiled = stats["num_compilations"] + stats["num_compilation_cache_hits"]
    ws = runner.warmup_set()  # the full set: forwards, samples, block copies
    full = len(ws.shapes) + len(ws.samples) + len(ws.copy_sizes)
    assert 0 < compiled < full
    assert sum(r["response"]["status_code"] == 200 for r in _results(out)) == 3
