"""ResultsFile: torn last lines dropped, unfinished groups dropped atomically, keys recovered,
groups durable as they are written."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.jobs.results import ResultsFile


def _key(record: dict) -> str:
    return record["id"]


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_are_durable_per_group_and_keys_come_back(tmp_path):
    path = tmp_path / "sub" / "out.jsonl"
    with ResultsFile(path, _key, group_size=2, group_seconds=3600) as results:
        assert results.done == set()
        results.append({"id": "a", "x": 1})
        assert path.read_text() == ""  # queued: the group is not due yet
        results.append({"id": "b", "x": "é"})
        assert [r["id"] for r in _lines(path)] == ["a", "b"]  # written and fsynced
        results.append({"id": "c"})
    assert [r["id"] for r in _lines(path)] == ["a", "b", "c"]  # close() writes the rest
    assert ResultsFile(path, _key).done == {"a", "b", "c"}


def test_a_torn_last_line_is_dropped(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "te')
    results = ResultsFile(path, _key)
    assert results.done == {"a", "b"} and results.num_torn_dropped == len('{"id": "c", "te')
    results.append({"id": "c"})
    results.close()
    assert [r["id"] for r in _lines(path)] == ["a", "b", "c"]


def test_keys_with_missing_records_are_dropped_and_the_file_rewritten(tmp_path):
    path = tmp_path / "out.jsonl"
    records = [{"id": "a", "i": 0}, {"id": "b", "i": 0}, {"id": "a", "i": 1}, {"id": "b", "i": 1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    results = ResultsFile(path, _key, expected=lambda k: 2)
    assert results.done == {"a"} and results.num_partial_dropped == 1
    assert _lines(path) == [records[0], records[2]]
    assert not (tmp_path / "out.jsonl.tmp").exists()
    results.close()


def test_a_line_that_is_not_a_record_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"out.jsonl:2: not valid JSON"):
        ResultsFile(path, _key)
    path.write_text('{"id": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"out.jsonl:2: expected a JSON object, got list"):
        ResultsFile(path, _key)


@settings(max_examples=60, deadline=None)
@given(
    n=st.lists(st.integers(1, 3), min_size=1, max_size=8),
    cut=st.floats(0, 1),
    group=st.integers(1, 4),
)
def test_any_crash_point_resumes_to_each_record_exactly_once(tmp_path_factory, n, cut, group):
    """Write a job's groups, cut the file at an arbitrary byte (a crash), reopen, write what
    is not done: every key ends up with all of its records, once."""
    path = tmp_path_factory.mktemp("job") / "out.jsonl"
    groups = [[{"id": str(k), "i": i} for i in range(count)] for k, count in enumerate(n)]
    with ResultsFile(path, _key, group_size=group) as results:
        for g in groups:
            results.append(*g)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    expected = dict(enumerate(n))
    with ResultsFile(path, _key, expected=lambda k: expected[int(k)]) as results:
        for g in groups:
            if g[0]["id"] not in results.done:
                results.append(*g)
    final = sorted(_lines(path), key=lambda r: (int(r["id"]), r["i"]))
    assert final == [r for g in groups for r in g]
