"""bench/startup.py's same-run vLLM comparison (experiment 5, bench/_startup_vllm.py) with a
stand-in vLLM interpreter and stand-in jaxserve processes: no vLLM install, no model, no jax.

Checks the vLLM process's command line, environment and cache folder, the parsing of its
RESULT line and log, the alternation of the two engines' processes, the goal computed from the
same run's numbers, the fallback (the issue's figure) labelled as not the same run's, and an
interpreter without vLLM refused.
Never a real time.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _startup_phases as phases_mod  # noqa: E402
import _startup_vllm as vllm_side  # noqa: E402
import startup  # noqa: E402

CONFIG = dict(
    num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, intermediate_size=1536, vocab_size=32000,
)  # fmt: skip
KV_BYTES_PER_TOKEN = 2 * 8 * 2 * 64 * 4  # K and V, layers, kv heads, head dim, float32

# A stand-in for vLLM's interpreter: answers vllm_available's version probe; as the driver,
# records its argv and environment, "compiles" into VLLM_CACHE_ROOT the first time and loads
# from it after, and prints vLLM-like log lines and the RESULT line (fixed offsets from spawn).
STAND_IN = r"""
import json, os, sys
if sys.argv[1] == "-c":
    print("0.32.0")
    sys.exit(0)
driver, spec, spawn = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
with open(os.environ["STAND_IN_LOG"], "a") as f:
    f.write(json.dumps({"driver": driver, "spec": spec, "env": {k: os.environ.get(k) for k in (
        "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "XLA_FLAGS", "PYTHONPATH",
        "VLLM_LOGGING_LEVEL", "VLLM_USE_AOT_COMPILE")}}) + "\n")
root = os.environ["VLLM_CACHE_ROOT"]
marker = os.path.join(root, "model.bin")
if os.path.exists(marker):
    print("INFO [decorators.py:319] [backbone] Directly load AOT compilation from path x")
    init = 2.0
else:
    os.makedirs(root, exist_ok=True)
    open(marker, "w").write("compiled")
    print("INFO [decorators.py:743] [backbone] saved AOT compiled function to x")
    init = 20.0
print(f"(EngineCore pid=1) INFO [core.py:402] init engine (profile, create kv cache, "
      f"warmup model) took {init:.2f} s", file=sys.stderr)
built = spawn + 10.0 + init
print("RESULT " + json.dumps({"spawn": spawn, "imported": spawn + 10.0, "built": built,
      "first_token": built + 0.5, "token_ids": [7], "vllm_version": "0.32.0",
      "torch_version": "2.13.0+cpu"}))
"""


@pytest.fixture
def model_dir(tmp_path) -> Path:
    folder = tmp_path / "llama-57m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> tuple[str, Path]:
    path = tmp_path / "vllm-python"
    path.write_text(f"#!{sys.executable}\n{STAND_IN}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "stand_in.jsonl"
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    return str(path), log


def _engine(model_dir: Path) -> dict:
    return dict(model=str(model_dir), dtype="float32", block_size=32, num_kv_blocks=4097,
                max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048,
                enable_prefix_caching=True, seed=0)  # fmt: skip


def _jaxserve_stand_in(calls: list):
    """phases' jaxserve child, stood in: the first process 50 s, the later ones 10 s."""

    def run(engine, cache, env):
        calls.append(("jaxserve", cache))
        slow = sum(1 for c in calls if c[0] == "jaxserve") == 1
        to_tok = 40.0 if slow else 6.0
        first = {"construct_s": to_tok - 1.0, "first_token_s": 1.0, "to_first_token_s": to_tok}
        return {"import_s": 4.0, "first": first, "rebuild": dict(first),
                "spawn_to_first_token_s": 4.0 + to_tok, "wall_s": 60.0}  # fmt: skip

    return run


def test_settings_follow_jaxserves_engine(model_dir):
    """vLLM gets jaxserve's dtype, limits, prefix caching, seed and a KV pool of the same bytes
    (the usable blocks: jaxserve's null block excluded); an unsupported dtype is refused."""
    s = vllm_side.settings(_engine(model_dir))
    assert s["dtype"] == "float32" and s["skip_tokenizer_init"]
    assert (s["block_size"], s["max_num_seqs"], s["max_num_batched_tokens"]) == (32, 256, 2048)
    assert s["max_model_len"] == 2048 and s["enable_prefix_caching"] and s["seed"] == 0
    assert s["kv_cache_memory_bytes"] == 4096 * 32 * KV_BYTES_PER_TOKEN
    half = vllm_side.settings({**_engine(model_dir), "dtype": "bfloat16"})
    assert half["kv_cache_memory_bytes"] == s["kv_cache_memory_bytes"] // 2
    with pytest.raises(ValueError, match="dtype='int8'"):
        vllm_side.settings({**_engine(model_dir), "dtype": "int8"})


def test_command_and_parse():
    """The driver runs under the given interpreter with the spec and the spawn stamp; parse
    turns the RESULT stamps into seconds and counts the compilation cache's log lines."""
    cmd = vllm_side.command("/venv/bin/python", {"llm": {"model": "m"}, "prompt": [1]}, 12.5)
    assert cmd[0] == "/venv/bin/python" and cmd[1] == str(vllm_side.DRIVER)
    assert json.loads(cmd[2]) == {"llm": {"model": "m"}, "prompt": [1]} and float(cmd[3]) == 12.5
    stamps = {"spawn": 100.0, "imported": 103.0, "built": 110.0, "first_token": 110.25,
              "token_ids": [5], "vllm_version": "0.32.0", "torch_version": "2.13.0"}  # fmt: skip
    out = vllm_side.parse(
        "WARNING [decorators.py:333] Compiling model again due to a load failure from x\n"
        "INFO [core.py:402] init engine (profile, create kv cache, warmup model) took 5.50 s\n"
        "RESULT " + json.dumps(stamps)
    )
    assert out["import_s"] == 3.0 and out["construct_s"] == 7.0
    assert out["first_token_s"] == 0.25 and out["to_first_token_s"] == 7.25
    assert out["spawn_to_construct_s"] == 10.0 and out["spawn_to_first_token_s"] == 10.25
    assert out["engine_init_s"] == 5.5
    assert out["cache_events"] == {"aot_loaded": 0, "aot_load_failed": 1, "aot_saved": 0,
                                   "graph_loaded": 0, "graph_compiled": 0}  # fmt: skip
    assert out["cache_messages"] == [
        "WARNING [decorators.py:333] Compiling model again due to a load failure from x"
    ]
    with pytest.raises(ValueError, match="no RESULT line"):
        vllm_side.parse("INFO nothing\n")


def test_order_alternates_and_refuses_no_second_process():
    assert phases_mod.order(True, 2) == [
        ("jaxserve", 0), ("vllm", 0), ("jaxserve", 1), ("vllm", 1), ("vllm", 2), ("jaxserve", 2),
    ]  # fmt: skip
    assert phases_mod.order(False, 2) == [("jaxserve", 0), ("jaxserve", 1), ("jaxserve", 2)]
    with pytest.raises(ValueError, match="repeats=0"):
        phases_mod.order(True, 0)


def test_same_run_phases_alternate_and_the_goal_uses_them(model_dir, stand_in, monkeypatch, capsys):
    """With an interpreter: vLLM's processes alternate with jaxserve's on the 57M model only,
    share one vLLM cache folder of their own (empty for the first: it compiles; the second
    loads), run without jaxserve's XLA_FLAGS, and the goal is jaxserve's second processes over
    vLLM's of the same run."""
    python, log = stand_in
    calls: list = []
    monkeypatch.setattr(phases_mod, "_run", _jaxserve_stand_in(calls))
    real_run = vllm_side.run
    monkeypatch.setattr(
        vllm_side, "run", lambda *a, **k: calls.append(("vllm", str(a[2]))) or real_run(*a, **k)
    )
    models = {"demo": {"model": "tiny-random-llama"}, "57m": _engine(model_dir)}
    aot_off = {"VLLM_USE_AOT_COMPILE": "0"}
    entry = vllm_side.start(python, aot_off)  # probes the interpreter's vLLM version
    report = phases_mod.phases(models, lambda cache: {}, entry, repeats=2)

    assert [c[0] for c in calls] == ["jaxserve"] * 3 + [
        "jaxserve", "vllm", "jaxserve", "vllm", "vllm", "jaxserve",
    ]  # demo: jaxserve only  # fmt: skip
    vllm_caches = {c[1] for c in calls if c[0] == "vllm"}
    assert len(vllm_caches) == 1
    assert vllm_caches.isdisjoint(c[1] for c in calls if c[0] == "jaxserve")
    seen = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(seen) == 3 and all(Path(s["driver"]) == vllm_side.DRIVER for s in seen)
    for s in seen:
        assert s["spec"]["llm"] == vllm_side.settings(models["57m"])
        assert s["spec"]["prompt"] == phases_mod.PROMPT
        assert s["env"]["XLA_FLAGS"] is None and s["env"]["VLLM_LOGGING_LEVEL"] == "INFO"
        assert s["env"]["VLLM_USE_AOT_COMPILE"] == "0"  # --vllm-env reaches every process
        assert s["env"]["VLLM_CACHE_ROOT"].startswith(next(iter(vllm_caches)))
        assert s["env"]["TORCHINDUCTOR_CACHE_DIR"].startswith(next(iter(vllm_caches)))

    vllm = report["vllm"]
    assert vllm["same_run"] and vllm["version"] == "0.32.0" and len(vllm["runs"]) == 3
    assert vllm["env"] == aot_off and "VLLM_USE_AOT_COMPILE=0" in vllm["note"]
    first, *seconds = vllm["runs"]
    assert first["cache_events"]["aot_saved"] == 1 and first["cache_events"]["aot_loaded"] == 0
    assert all(r["cache_events"]["aot_loaded"] == 1 for r in seconds)
    assert first["cache_after"]["files"] == 1 and first["engine_init_s"] == 20.0
    assert vllm["second_to_first_token_s"] == pytest.approx(2.5)  # warm init 2 + 0.5
    assert vllm["second_spawn_to_first_token_s"] == pytest.approx(12.5)  # + import 10

    goals = startup.goals({"phases": report})
    goal = goals["57m_second_vs_vllm"]
    assert "same run" in goal["goal"] and goal["value"] == pytest.approx(6.0 / 2.5)
    assert goal["passed"] is False  # 2.4 > 0.35
    spawn = goals["57m_second_vs_vllm_spawn"]
    assert spawn["value"] == pytest.approx(10.0 / 12.5)

    phases_mod.print_phases(report)
    printed = capsys.readouterr().out
    assert "same run" in printed and "vLLM 57m second 2" in printed
    assert "jaxserve 57m first" in printed


def test_fallback_is_labelled_not_the_same_run(model_dir, monkeypatch, capsys):
    """No interpreter: nothing of vLLM runs, the goal divides by the issue's figure and says
    so, and the printed table says it is not this run's."""
    calls: list = []
    monkeypatch.setattr(phases_mod, "_run", _jaxserve_stand_in(calls))
    monkeypatch.setattr(vllm_side, "run", lambda *a, **k: pytest.fail("vLLM must not run"))
    for entry in (None, vllm_side.start(None)):
        calls.clear()
        report = phases_mod.phases({"57m": _engine(model_dir)}, lambda cache: {}, entry)
        vllm = report["vllm"]
        assert vllm["same_run"] is False and "NOT the same run" in vllm["note"]
        assert "no --vllm-python given" in vllm["note"]
        assert [c[0] for c in calls] == ["jaxserve"] * 2
        goals = startup.goals({"phases": report})
        assert set(goals) == {"57m_second_vs_vllm"}
        goal = goals["57m_second_vs_vllm"]
        assert "not this run's" in goal["goal"] and "NOT the same run" in goal["note"]
        assert goal["value"] == pytest.approx(10.0 / vllm_side.VLLM_CPU_ISSUE_S)
        phases_mod.print_phases(report)
        assert "NOT the same run" in capsys.readouterr().out


def test_an_interpreter_without_vllm_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """--vllm-python that cannot import vLLM, or --vllm-env without --vllm-python: refused
    (ValueError naming the option) before any experiment starts or a checkpoint is written."""
    monkeypatch.setattr(startup.throughput, "ensure_checkpoint", lambda *a: pytest.fail("ran"))
    missing = str(tmp_path / "missing-python")
    with pytest.raises(ValueError, match="--vllm-python .*missing-python"):
        startup.main(["--vllm-python", missing, "--output", str(tmp_path / "x.json")])
    with pytest.raises(ValueError, match="without --vllm-python"):
        startup.main(["--vllm-env", "A=1", "--output", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_cli_default_has_no_vllm_python():
    args = startup.parse_args([])
    assert args.vllm_python is None and args.vllm_env is None and args.phases_repeats == 1
    args = startup.parse_args(["--vllm-python", "/v/bin/python", "--phases-repeats", "2"])
    assert args.vllm_python == "/v/bin/python" and args.phases_repeats == 2


def test_vllm_env_items_are_parsed_and_bad_ones_refused(tmp_path):
    """--vllm-env KEY=VALUE: parsed, passed on; malformed items and the benchmark's own cache
    and logging variables are refused, naming them."""
    assert vllm_side.parse_env(["VLLM_USE_AOT_COMPILE=0", "A_B=x=y"]) == {
        "VLLM_USE_AOT_COMPILE": "0", "A_B": "x=y",
    }  # fmt: skip
    assert vllm_side.parse_env(None) == {}
    for bad in ("NOVALUE", "=1", "BAD-KEY=1"):
        with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(")):
            vllm_side.parse_env([bad])
    env = vllm_side.child_env(tmp_path, {"VLLM_USE_AOT_COMPILE": "0"})
    assert env["VLLM_USE_AOT_COMPILE"] == "0"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
    with pytest.raises(ValueError, match="VLLM_CACHE_ROOT"):
        vllm_side.child_env(tmp_path, {"VLLM_CACHE_ROOT": "/elsewhere"})
    with pytest.raises(ValueError, match="NOVALUE"):
        startup.main(["--vllm-env", "NOVALUE", "--output", str(tmp_path / "x.json")])
