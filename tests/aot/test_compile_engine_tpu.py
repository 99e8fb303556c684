"""`jaxserve compile` of tiny engines with the real TPU compiler (libtpu, deviceless): a dense
one for v6e-1 and for v5e-4 with tensor parallelism 4 (the Mosaic kernel inside shard_map), a
mixture of experts with a sliding window and an FP8 KV cache for v6e-1.
Every compilation warm-up would run there compiles, the donated KV pages alias, the memory
fits, and the report carries the plan, the memory and a roofline. One token bucket each, to
stay fast. Skipped without libtpu (``pip install "jaxserve[tpu]"``)."""

from __future__ import annotations

import json

import pytest
from aot_compilers import require_compiler
from tiny_config import TINY_MIXTRAL, write_tiny_llama

from jaxserve.cli import main

ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "8", "--max-model-len", "256"]


@pytest.fixture(autouse=True)
def _no_mds_query(monkeypatch) -> None:
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")


def _compile(
    tmp_path, capsys, target: str, *flags: str, config: dict | None = None
) -> tuple[int, dict | None, str]:
    require_compiler(target)
    model = write_tiny_llama(tmp_path / "model", config)
    out = tmp_path / "report.json"
    rc = main(
        ["compile", "--model", model, "--target", target, *ENGINE, *flags, "--json", str(out)]
    )
    captured = capsys.readouterr()
    report = json.loads(out.read_text()) if out.exists() else None
    return rc, report, captured.out + captured.err


def _check_compiled(report: dict, tp: int) -> None:
    plan, totals = report["plan"], report["totals"]
    assert plan["platform"] == "tpu" and plan["attention"] == "pallas_tpu"
    assert plan["tensor_parallel_size"] == tp and plan["dtype"] == "bfloat16"
    buckets = report["buckets"]
    steps = [b for b in buckets if b["kind"] == "step"]
    copies = [b for b in buckets if b["kind"] == "copy"]
    # one token bucket (T=8, R=8) in both sampler variants; the copies at 1, 2, 4, 8 blocks
    assert [(b["tokens"], b["rows"]) for b in steps] == [(8, 8), (8, 8)]
    assert [b["sampling_lists"][0] > 0 for b in steps] == [False, True]
    assert [b["copies"] for b in copies] == [1, 2, 4, 8]
    assert all(b["ok"] and b["error"] is None for b in buckets), [b["error"] for b in buckets]
    pool = report["memory_plan"]["num_kv_blocks"] * report["memory_plan"]["kv_bytes_per_block"]
    for b in buckets:
        assert b["memory"]["alias_size_in_bytes"] >= pool  # the donated pages come back in place
        assert b["compile_s"] > 0
    assert all(b["flops"] > 0 and b["roofline"]["seconds"] > 0 for b in steps)
    assert totals["ok"] and totals["fits"] and totals["kv_aliased"] and totals["num_failed"] == 0
    assert report["predicted"]["decode"]["tokens_per_s"] > 0


def test_a_tiny_engine_compiles_for_v6e_1(tmp_path, capsys) -> None:
    folder = tmp_path / "precompiled"
    rc, report, output = _compile(
        tmp_path, capsys, "v6e-1", "--token-buckets", "8", "--output", str(folder)
    )
    assert rc == 0, output
    _check_compiled(report, tp=1)
    assert report["target"]["device_kind"] == "TPU v6 lite"
    assert "verdict: OK" in output and "predicted decode (roofline)" in output
    # --output: every executable serialized, keyed for a v6e-1 (LLM(precompiled=...) there).
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["fields"]["backend"] == "tpu"
    assert manifest["fields"]["devices"] == "1 x TPU v6 lite"
    assert len(list(folder.glob("*.bin"))) == len(report["buckets"])


def test_a_tiny_engine_compiles_for_v5e_4_with_tensor_parallelism(tmp_path, capsys) -> None:
    rc, report, output = _compile(
        tmp_path, capsys, "v5e-4", "--tensor-parallel-size", "4", "--token-buckets", "8"
    )
    assert rc == 0, output
    _check_compiled(report, tp=4)
    assert report["memory_plan"]["kv_cache_sharded"]  # 4 KV heads over 4 chips


def test_a_tiny_moe_with_a_sliding_window_and_fp8_kv_compiles_for_v6e_1(tmp_path, capsys):
    rc, report, output = _compile(
        tmp_path, capsys, "v6e-1", "--kv-cache-dtype", "fp8", "--token-buckets", "8",
        config=TINY_MIXTRAL,
    )  # fmt: skip
    assert rc == 0, output
    _check_compiled(report, tp=1)
    assert report["plan"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert report["memory_plan"]["architecture"] == "MixtralForCausalLM"


def test_a_token_bucket_the_engine_lacks_exits_2(tmp_path, capsys) -> None:
    rc, report, output = _compile(tmp_path, capsys, "v6e-1", "--token-buckets", "8,12")
    assert rc == 2 and report is None
    assert "--token-buckets [12] are not token buckets of this engine; they are [4, 8]" in output


def test_a_model_that_does_not_fit_the_target_exits_1(tmp_path, capsys) -> None:
    # 2^21 blocks x 16 tokens x 8 KiB per token = 256 GiB of KV pages on a 16 GiB chip
    rc, report, output = _compile(tmp_path, capsys, "v5e-1", "--num-kv-blocks", str(1 << 21))
    assert rc == 1 and report is None
    assert "does not fit in device memory" in output
