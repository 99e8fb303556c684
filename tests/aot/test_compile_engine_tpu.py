"""`jaxserve compile` of tiny engines with the real TPU compiler (libtpu, deviceless): a mixture
of experts with a sliding window, an FP8 KV cache and a host KV tier for v6e-1, and a dense one
with a draft model for v5e-4 with tensor parallelism 4 (the Mosaic kernel inside shard_map,
the target's forward and the draft's; tests/aot/test_tpu_kernel_compile.py compiles the kernel
on bf16 pages for v6e-1).
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


def _check_compiled(report: dict, tp: int, draft: bool = False) -> None:
    """``draft``: the engine has a draft model of the target's shapes, whose KV pages the
    planner's pool counts too: the step donates both (the pool), a target's copy half."""
    plan, totals = report["plan"], report["totals"]
    assert plan["platform"] == "tpu" and plan["attention"] == "pallas_tpu"
    assert plan["tensor_parallel_size"] == tp and plan["dtype"] == "bfloat16"
    buckets = report["buckets"]
    steps = [b for b in buckets if b["kind"] == "step"]
    samples = [b for b in buckets if b["kind"] == "sample"]
    copies = [b for b in buckets if b["kind"] == "copy"]
    # one token bucket (T=8, R=8): its forward once, its sample in both sampler variants; the
    # copies at 1, 2, 4, 8 blocks
    assert [(b["tokens"], b["rows"]) for b in steps] == [(8, 8)]
    assert [(b["rows"], b["sampling_lists"][0] > 0) for b in samples] == [(8, False), (8, True)]
    assert all(b["donated_bytes"] == 0 for b in samples)
    assert [b["copies"] for b in copies] == [1, 2, 4, 8]
    assert all(b["ok"] and b["error"] is None for b in buckets), [b["error"] for b in buckets]
    pool = report["memory_plan"]["num_kv_blocks"] * report["memory_plan"]["kv_bytes_per_block"]
    assert all(b["donated_bytes"] == pool for b in steps)
    assert all(b["donated_bytes"] == pool // (2 if draft else 1) for b in copies)
    for b in buckets:  # the donated pages come back in place
        assert b["memory"]["alias_size_in_bytes"] >= b["donated_bytes"], b["label"]
        assert b["compile_s"] > 0
    assert all(b["flops"] > 0 and b["roofline"]["seconds"] > 0 for b in steps)
    assert totals["ok"] and totals["fits"] and totals["kv_aliased"] and totals["num_failed"] == 0
    assert report["predicted"]["decode"]["tokens_per_s"] > 0


def test_a_tiny_moe_with_fp8_kv_and_a_host_kv_tier_compiles_for_v6e_1(tmp_path, capsys):
    """A mixture of experts with a sliding window and an FP8 KV cache. With
    --kv-offloading-size the tier's gather (pages -> host) and scatter (host -> pages) at every
    padded size compile too; the scatter gives the donated pages back in place, the gather
    donates none. With --output every executable is serialized."""
    folder = tmp_path / "precompiled"
    rc, report, output = _compile(
        tmp_path, capsys, "v6e-1", "--kv-cache-dtype", "fp8", "--kv-offloading-size", "0.01",
        "--token-buckets", "8", "--output", str(folder), config=TINY_MIXTRAL,
    )  # fmt: skip
    assert rc == 0, output
    _check_compiled(report, tp=1)
    assert report["target"]["device_kind"] == "TPU v6 lite"
    assert report["plan"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert report["memory_plan"]["architecture"] == "MixtralForCausalLM"
    assert "verdict: OK" in output and "predicted decode (roofline)" in output
    buckets = report["buckets"]
    pool = report["memory_plan"]["num_kv_blocks"] * report["memory_plan"]["kv_bytes_per_block"]
    to_host = [b for b in buckets if b["kind"] == "to_host"]
    from_host = [b for b in buckets if b["kind"] == "from_host"]
    sizes = [1, 2, 4, 8, 16, 32, 64]
    assert [b["copies"] for b in to_host] == [b["copies"] for b in from_host] == sizes
    assert all(b["donated_bytes"] == 0 for b in to_host)
    assert all(b["donated_bytes"] == pool for b in from_host)
    assert "copy from host n=64" in output
    # each compilation named on stderr before it starts (a fatal compiler error leaves only that)
    announced = [line for line in output.splitlines() if line.startswith("compiling ")]
    assert announced == [f"compiling {b['label']}" for b in buckets]
    # --output: every executable serialized, keyed for a v6e-1 (LLM(precompiled=...) there).
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["fields"]["backend"] == "tpu"
    assert manifest["fields"]["devices"] == "1 x TPU v6 lite"
    assert len(list(folder.glob("*.bin"))) == len(buckets)


def test_a_tiny_engine_with_a_draft_model_compiles_for_v5e_4_with_tensor_parallelism(
    tmp_path, capsys
):
    """At tensor parallelism 4, with --speculative-config's draft model (the tiny llama as its
    own draft, from its config.json alone): everything _check_compiled asks of an engine, the
    KV pages sharded over the chips; the step carries the draft's forward, and the draft's
    proposal at every row bucket and its block copies compile; each gives the pages it takes
    donated back in place (the draft's own for its proposal and copies)."""
    draft = write_tiny_llama(tmp_path / "draft")
    spec = json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 2})
    rc, report, output = _compile(
        tmp_path, capsys, "v5e-4", "--tensor-parallel-size", "4", "--token-buckets", "8",
        "--speculative-config", spec,
    )  # fmt: skip
    assert rc == 0, output
    _check_compiled(report, tp=4, draft=True)
    assert report["memory_plan"]["kv_cache_sharded"]  # 4 KV heads over 4 chips
    buckets = report["buckets"]
    proposals = [b for b in buckets if b["kind"] == "draft_propose"]
    draft_copies = [b for b in buckets if b["kind"] == "draft_copy"]
    target_copies = [b for b in buckets if b["kind"] == "copy"]
    assert [b["rows"] for b in proposals] == [4, 8]  # the row buckets of token buckets 4, 8
    assert [b["copies"] for b in draft_copies] == [b["copies"] for b in target_copies]
    steps = [b for b in buckets if b["kind"] == "step"]
    # The step donates the target's and the draft's pages (the same shapes here): twice a copy's.
    assert all(b["donated_bytes"] == 2 * target_copies[0]["donated_bytes"] for b in steps)
    assert all(b["donated_bytes"] == target_copies[0]["donated_bytes"] for b in draft_copies)
    for b in buckets:
        if b["kind"] != "sample":
            assert b["memory"]["alias_size_in_bytes"] >= b["donated_bytes"] > 0, b["label"]
    assert report["totals"]["kv_aliased"] and "draft propose R=8" in output


def test_a_token_bucket_the_engine_lacks_exits_2(tmp_path, capsys) -> None:
    rc, report, output = _compile(tmp_path, capsys, "v6e-1", "--token-buckets", "8,12")
    assert rc == 2 and report is None
    assert "--token-buckets [12] are not token buckets of this engine; they are [4, 8]" in output


def test_a_model_that_does_not_fit_the_target_exits_1(tmp_path, capsys) -> None:
    # 2^21 blocks x 16 tokens x 8 KiB per token = 256 GiB of KV pages on a 16 GiB chip
    rc, report, output = _compile(tmp_path, capsys, "v5e-1", "--num-kv-blocks", str(1 << 21))
    assert rc == 1 and report is None
    assert "does not fit in device memory" in output
