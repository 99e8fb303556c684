"""``jaxserve plan``: the figures for real models' configs (config.json only, written here), its
exit status (0 fits, 1 does not, 2 bad input), --json, dtype "auto" per platform, Hub model IDs
(config.json only), agreement with the engine on the CPU; and the engine flags of ``jaxserve
generate`` that go with it (vLLM's names)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import huggingface_hub
import pytest

from jaxserve import LLM, cli
from jaxserve.checkpoints_tools import hub
from jaxserve.cli.flags import engine_kwargs

GIB = 1 << 30
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
KEYS = {"weights_bytes", "kv_bytes_per_token", "max_kv_tokens"}
KEYS |= {"max_num_seqs_at_max_model_len", "fits", "dtype", "tensor_parallel_size"}


def write_config(folder: pathlib.Path, **overrides: object) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B | overrides))
    return folder


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_config(tmp_path_factory.mktemp("Meta-Llama-3-8B")))


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = cli.main(["plan", *argv, "--json"])
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one object
    return code, json.loads(out)


def test_llama3_8b_on_an_h200(llama3: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, plan = plan_json(capsys, "--model", llama3, "--device-memory-gb", "141")
    assert code == 0 and KEYS <= set(plan)
    assert plan["num_params"] == 8_030_261_248
    assert plan["weights_bytes"] == 16_060_522_496
    assert plan["kv_bytes_per_token"] == 131_072
    assert plan["max_kv_tokens"] == 908_992
    assert plan["max_num_seqs_at_max_model_len"] == 110
    assert plan["fits"] is True and plan["reason"] is None
    assert plan["dtype"] == "bfloat16" and plan["platform"] == "gpu"
    assert plan["device_memory_bytes"] == 141 * GIB and plan["memory_utilization"] == 0.9
    assert plan["workspace_bytes"] == 1_050_673_152  # the sample half on a GPU
    assert cli.main(["plan", "--model", llama3, "--device-memory-gb", "141"]) == 0
    text = capsys.readouterr().out
    assert "weights per device:   16,060,522,496 bytes (14.96 GiB)" in text
    assert "max_kv_tokens:        908,992 (56,812 blocks of 16 tokens" in text
    assert "sequences at once:    110 of max_model_len=8,192" in text
    assert text.rstrip().endswith("fits:                 yes")


def test_a_kv_transfer_producer_leaves_room_for_its_held_offers(
    llama3: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--kv-transfer-config: a JaxTransferConnector producer's pool and its cap of held offers
    (max_held_offers_fraction of the pool) share the budget; a consumer's plan is the plain one."""
    argv = ["--model", llama3, "--device-memory-gb", "141"]
    _, plain = plan_json(capsys, *argv)
    role = '{"kv_connector": "JaxTransferConnector", "kv_role": "%s"}'
    _, producer = plan_json(capsys, *argv, "--kv-transfer-config", role % "kv_producer")
    _, consumer = plan_json(capsys, *argv, "--kv-transfer-config", role % "kv_consumer")
    assert plain["held_offers_bytes"] == consumer["held_offers_bytes"] == 0
    assert consumer["num_kv_blocks"] == plain["num_kv_blocks"]
    held, block = producer["held_offers_bytes"], producer["kv_bytes_per_block"]
    pool = producer["num_kv_blocks"]
    assert 0 < held <= 0.5 * pool * block  # the default fraction, 0.5
    assert pool < plain["num_kv_blocks"] <= pool + held // block + 1  # the same budget
    assert cli.main([
        "plan", *argv, "--kv-transfer-config", role % "kv_producer"]) == 0  # fmt: skip
    assert "held KV offers:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("tp", "weights", "kv"), [(2, 8_030_527_488, 65_536), (8, 2_008_031_232, 16_384)]
)
def test_llama3_8b_tensor_parallel(
    llama3: str, tp: int, weights: int, kv: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", llama3, "--device-memory-gb", "80", "--tensor-parallel-size", str(tp)]
    code, plan = plan_json(capsys, *argv)
    assert code == 0 and plan["tensor_parallel_size"] == tp
    assert plan["weights_bytes"] == weights and plan["kv_bytes_per_token"] == kv
    assert plan["weights_bytes_total"] == 16_060_522_496


def test_does_not_fit_exits_1_and_still_prints(
    llama3: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, plan = plan_json(capsys, "--model", llama3, "--device-memory-gb", "16")
    assert code == 1 and plan["fits"] is False and plan["max_kv_tokens"] == 0
    assert "exceed the budget" in plan["reason"]
    assert cli.main(["plan", "--model", llama3, "--device-memory-gb", "18"]) == 1
    text = capsys.readouterr().out
    assert "fits:                 no: " in text and "one sequence of max_model_len=8192" in text
    # The same model fits a shorter max_model_len, or in float32 on a larger device.
    assert cli.main(["plan", "--model", llama3, "--device-memory-gb", "18"]
                    + ["--max-model-len", "2048"]) == 0  # fmt: skip
    assert capsys.readouterr().out.rstrip().endswith("yes")
    code, plan = plan_json(
        capsys, "--model", llama3, "--device-memory-gb", "40", "--dtype", "float32"
    )
    assert code == 0 and plan["weights_bytes"] == 2 * 16_060_522_496


def test_exit_status_of_the_command(llama3: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "plan", "--model", llama3]
        + ["--device-memory-gb", "16", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and json.loads(run.stdout)["fits"] is False


def test_auto_dtype_follows_the_platform(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f32 = str(write_config(tmp_path, torch_dtype="float32"))
    _, gpu = plan_json(capsys, "--model", f32, "--device-memory-gb", "80")
    assert gpu["dtype"] == "bfloat16" and gpu["declared_dtype"] == "float32"
    _, cpu = plan_json(capsys, "--model", f32, "--device-memory-gb", "80", "--platform", "cpu")
    assert cpu["dtype"] == "float32" and cpu["kv_bytes_per_token"] == 2 * 131_072
    _, tpu = plan_json(capsys, "--model", f32, "--device-memory-gb", "80", "--platform", "tpu")
    assert tpu["dtype"] == "bfloat16"


def test_fp8_kv_cache_doubles_the_kv_tokens(
    llama3: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, bf16 = plan_json(capsys, "--model", llama3, "--device-memory-gb", "141")
    _, fp8 = plan_json(
        capsys, "--model", llama3, "--device-memory-gb", "141", "--kv-cache-dtype", "fp8"
    )
    assert fp8["kv_cache_dtype"] == "float8_e4m3fn" and fp8["kv_bytes_per_token"] == 65_536
    assert fp8["max_kv_tokens"] >= 1.9 * bf16["max_kv_tokens"]
    assert fp8["kv_scales_bytes"] == 256  # f32 (k_scale, v_scale) x 32 layers
    with pytest.raises(SystemExit):  # argparse: "invalid choice", exit status 2
        cli.main(["plan", "--model", llama3, "--kv-cache-dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device-memory-gb", "0"], "--device-memory-gb must be a number > 0, got 0.0"),
        (["--device-memory-gb", "nan"], "--device-memory-gb must be a number > 0"),
        (["--device-memory-gb", "1e300"], "--device-memory-gb must be at most 1048576, got 1e+300"),
        (["--gpu-memory-utilization", "1.5"], r"gpu_memory_utilization must be in (0, 1], got 1.5"),
        (["--block-size", "0"], "CacheConfig.block_size must be >= 1, got 0"),
        (["--max-model-len", "9000"], "max_model_len=9000 exceeds the model's"),
        (["--platform", "gpu"], "--platform gpu: the local device is cpu"),
        (["--revision", "v2"], "revision='v2': applies to Hugging Face Hub model IDs only"),
    ],
)
def test_bad_input_exits_2(
    llama3: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if "--platform" not in argv and "--device-memory-gb" not in argv:
        argv = [*argv, "--device-memory-gb", "80"]
    assert cli.main(["plan", "--model", llama3, *argv, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err


def test_unknown_model_exits_2(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope")
    assert cli.main(["plan", "--model", missing, "--device-memory-gb", "80"]) == 2
    assert f"model {missing!r} is neither a built-in model" in capsys.readouterr().err


def test_hub_ids_fetch_config_json_only(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cached snapshot holding config.json alone plans offline; online, the plan asks
    snapshot_download for config.json and nothing else."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = hub.repo_folder(tmp_path / "hub", "meta-llama/Meta-Llama-3-8B")
    commit = "b" * 40
    write_config(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    argv = ["--model", "meta-llama/Meta-Llama-3-8B", "--device-memory-gb", "141"]
    code, plan = plan_json(capsys, *argv)
    assert code == 0 and plan["model"] == "meta-llama/Meta-Llama-3-8B"
    assert plan["weights_bytes"] == 16_060_522_496 and plan["max_kv_tokens"] == 908_992

    calls: list[dict] = []

    def recording(repo_id: str, **kwargs: object) -> str:
        calls.append(kwargs)
        return str(repo / "snapshots" / commit)

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    code, _ = plan_json(capsys, *argv, "--revision", "main")
    assert code == 0 and [c["allow_patterns"] for c in calls] == [["config.json"]]
    assert calls[0]["revision"] == "main"


def test_generate_engine_flags_use_vllm_names() -> None:
    args = cli.build_parser().parse_args(
        ["generate", "--prompt", "a", "--gpu-memory-utilization", "0.5", "--revision", "v2"]
        + ["--download-dir", "/d", "--tokenizer", "/t", "--memory-utilization", "0.5"]
        + ["--kv-cache-dtype", "fp8_e5m2"]
    )  # fmt: skip
    assert engine_kwargs(args) == {
        "gpu_memory_utilization": 0.5,
        "memory_utilization": 0.5,
        "revision": "v2",
        "download_dir": "/d",
        "tokenizer": "/t",
        "kv_cache_dtype": "fp8_e5m2",
    }


def test_plan_agrees_with_the_engine_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """The same flags to `jaxserve plan` (the local CPU, its cpu_memory_bytes budget) and to
    `jaxserve generate`'s engine: the engine's pool is the plan's."""
    flags = ["--gpu-memory-utilization", "0.005", "--max-model-len", "256"]
    flags += ["--max-num-seqs", "64", "--max-num-batched-tokens", "256", "--block-size", "16"]
    code, plan = plan_json(capsys, "--model", "tiny-random-llama", *flags)
    assert code == 0 and plan["platform"] == "cpu" and plan["dtype"] == "float32"
    assert plan["device_memory_bytes"] == 4 * GIB  # CacheConfig.cpu_memory_bytes
    assert plan["num_kv_blocks"] == plan["num_kv_blocks_fit"]  # not capped
    args = cli.build_parser().parse_args(["generate", "--prompt", "a", *flags])
    llm = LLM("tiny-random-llama", **engine_kwargs(args), warmup=False)
    assert llm.engine.info.num_kv_blocks == plan["num_kv_blocks"]
    assert llm.get_stats()["num_usable_kv_blocks"] * 16 == plan["max_kv_tokens"]


def test_help_lists_plan_without_importing_jax() -> None:
    code = (
        "import sys\n"
        "from jaxserve import cli\n"
        "parser = cli.build_parser()\n"
        "assert 'plan' in parser.format_help()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'huggingface_hub'))\n"
        "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_subcommand_run_imports_only_its_own_module() -> None:
    """`jaxserve compile` / `plan` build their own parser alone: the server's web stack (pydantic,
    fastapi) is never imported, so they work where it is not installed (as on a GPU image)."""
    code = (
        "import sys\n"
        "from jaxserve import cli\n"
        "for name in ('compile', 'plan'):\n"
        "    assert name in cli.build_parser([name, '--help']).format_help()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'fastapi'))\n"
        "assert not bad, bad[:5]\n"
        "assert 'serve' in cli.build_parser(['--help']).format_help()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_8bit_weights_take_one_byte_each_plus_scales(
    llama3: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Per layer: q, o [4096 x 4096], k, v [4096 x 1024], gate, up, down [4096 x 14336]; one f32
    # scale per output channel. Embedding and LM head (2 x 128256 x 4096) and norms stay bf16.
    linear = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    scales = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)
    other = 8_030_261_248 - linear
    argv = ["--model", llama3, "--device-memory-gb", "141"]
    for quantization in ("int8", "fp8"):
        code, plan = plan_json(capsys, *argv, "--quantization", quantization)
        assert code == 0 and plan["quantization"] == quantization
        assert plan["weights_bytes"] == 2 * other + linear + 4 * scales == 9_086_705_664
    # An FP8 checkpoint's own quantization_config is planned as FP8 without the flag.
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}
    folder = write_config(tmp_path / "fp8", quantization_config=fp8)
    code, plan = plan_json(capsys, "--model", str(folder), "--device-memory-gb", "141")
    assert code == 0 and plan["quantization"] == "fp8"
    assert plan["weights_bytes"] == 9_086_705_664
    assert cli.main(["plan", "--model", str(folder), "--quantization", "int8"]) == 2
    assert "is a fp8 checkpoint" in capsys.readouterr().err
