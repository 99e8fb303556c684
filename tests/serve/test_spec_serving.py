"""Speculative decoding behind the OpenAI server: a stream carries several tokens in a delta
when several drafts were accepted, its text is the non-speculative greedy text, and /metrics
counts the drafts (vLLM's names under jaxserve:); response_format is served with drafts
checked against the schema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from server_utils import MODEL, SMALL, client, metrics, running_server

from jaxserve import AsyncLLM, LLMEngine, SamplingParams
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.spec_decode import SpecDecoder
from jaxserve.spec_decode.spec_decoder import host_proposer
from jaxserve.speculative_config import SpeculativeConfig

PROMPT = "The quick brown fox"
CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "policy": "always"}
JSON_PROMPT = "JSON:"
REGEX = "(ab ){12}"  # repetitive: n-gram drafts from the output's own earlier tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "ok"],
    "additionalProperties": False,
}


class _Oracle:
    """Drafts from the plain engine's greedy tokens: always right; n-gram drafts (the
    configured method's proposer) for any other request."""

    def __init__(self, *references: tuple[list[int], list[int]]) -> None:
        self.fulls = [prompt_ids + tokens for prompt_ids, tokens in references]
        self.ngram = host_proposer(SpeculativeConfig(**CONFIG))

    def propose(self, requests, k):
        requests = list(requests)
        out = {
            r.request_id: full[len(r.all_token_ids) : len(r.all_token_ids) + k]
            for r in requests
            for full in self.fulls
            if r.all_token_ids == full[: len(r.all_token_ids)]
        }
        out.update(self.ngram.propose([r for r in requests if r.request_id not in out], k))
        return out


def _greedy(llm_engine, req_id: str, prompt: str, params: SamplingParams):
    llm_engine.add_request(req_id, prompt, params)
    final = None
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            final = out
    completion = final.outputs[0]
    return final.prompt_token_ids, completion.token_ids, completion.text


@pytest.fixture(scope="module")
def reference(llm_engine):
    """The greedy tokens and text of PROMPT without speculation (the session's plain engine)."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return _greedy(llm_engine, "spec-reference", PROMPT, params)


@pytest.fixture(scope="module")
def json_reference(llm_engine):
    """The greedy tokens and text of JSON_PROMPT under SCHEMA without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": SCHEMA})
    return _greedy(llm_engine, "spec-json-reference", JSON_PROMPT, params)


@pytest.fixture(scope="module")
def regex_reference(llm_engine):
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"regex": REGEX})
    return _greedy(llm_engine, "spec-regex-reference", PROMPT, params)


@pytest.fixture(scope="module")
def base_url(reference, json_reference):
    engine = LLMEngine("tiny-random-llama", speculative_config=CONFIG, **SMALL)
    oracle = _Oracle(reference[:2], json_reference[:2])
    engine.core.spec = SpecDecoder(SpeculativeConfig(**CONFIG), proposer=oracle)
    async_engine = AsyncLLM.from_engine(engine, served_model_name=MODEL)
    with running_server(build_app(async_engine, served_model_name=MODEL)) as url:
        yield url
    async_engine.shutdown()


def test_a_stream_carries_accepted_runs_and_the_plain_text(base_url, reference):
    _, tokens, text = reference
    oai = client(base_url)
    stream = oai.completions.create(
        model=MODEL, prompt=PROMPT, stream=True, temperature=0.0, max_tokens=16,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    deltas = [c.choices[0].text for c in stream if c.choices]
    assert "".join(deltas) == text
    # 16 tokens, up to 4 a step: far fewer deltas than tokens.
    assert len([d for d in deltas if d]) < len(tokens) // 2
    values = metrics(base_url)
    accepted = sum(v for (name, _), v in values.items()
                   if name == "jaxserve:spec_decode_num_accepted_tokens_total")  # fmt: skip
    assert accepted > 0
    per_pos = {labels: v for (name, labels), v in values.items()
               if name == "jaxserve:spec_decode_num_accepted_tokens_per_pos_total"}  # fmt: skip
    assert len(per_pos) == 3 and all(v > 0 for v in per_pos.values())


def test_response_format_is_served_with_drafts_checked_against_the_schema(base_url, json_reference):
    _, tokens, text = json_reference
    before = metrics(base_url)
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    comp = client(base_url).completions.create(
        model=MODEL, prompt=JSON_PROMPT, temperature=0.0, max_tokens=40,
        extra_body={"response_format": fmt},
    )  # fmt: skip
    assert comp.choices[0].text == text and comp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    drafts = [sum(v for (name, _), v in values.items()
                  if name == "jaxserve:spec_decode_num_draft_tokens_total")
              for values in (before, metrics(base_url))]  # fmt: skip
    assert drafts[1] > drafts[0]


def _drafts(values) -> float:
    return sum(v for (name, _), v in values.items()
               if name == "jaxserve:spec_decode_num_draft_tokens_total")  # fmt: skip


def test_constrained_streams_are_the_plain_greedy_text(base_url, json_reference, regex_reference):
    oai = client(base_url)
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    stream = oai.completions.create(
        model=MODEL, prompt=JSON_PROMPT, stream=True, temperature=0.0, max_tokens=40,
        extra_body={"response_format": fmt},
    )  # fmt: skip
    deltas = [c.choices[0].text for c in stream if c.choices]
    assert "".join(deltas) == json_reference[2]
    jsonschema.validate(json.loads("".join(deltas)), SCHEMA)
    assert len([d for d in deltas if d]) < len(json_reference[1])  # accepted runs in a delta
    # The real n-gram proposer on a repetitive regex: drafts from the output itself, cut
    # where the grammar says, the stream the plain greedy text.
    before = _drafts(metrics(base_url))
    stream = oai.completions.create(
        model=MODEL, prompt=PROMPT, stream=True, temperature=0.0, max_tokens=40,
        extra_body={"structured_outputs": {"regex": REGEX}},
    )  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    text = "".join(c.text for c in chunks)
    assert text == regex_reference[2] and re.fullmatch(REGEX, text)
    assert chunks[-1].finish_reason == "stop"
    assert _drafts(metrics(base_url)) > before and len(chunks) < len(regex_reference[1])
