#!/usr/bin/env bash
# One prepared device check on ONE NVIDIA H100 or H200, in under 10 minutes of wall time:
#   1. the kernel grid natively on the GPU (pytest --platform gpu -m gpu tests/pallas_kernels),
#   2. decode attention bandwidth of every GPU implementation the registry runs
#      (bench/attention_kernel.py --preset h200-decode: batch 64 x 4096, bf16, pages of 16 and
#      32, against a device-to-device copy measured in the same run),
#   3. the issues' first device checks: `jaxserve compile --output` for this chip's target,
#      deviceless, then LLM(precompiled=...) on the chip (bench/precompiled_check.py, the 1M
#      preset); n-gram and oracle speculation against plain decoding at batch 1 and 16 and the
#      verification step's cost, and plain against itself at batch 16 and 1 (bench/spec_decode.py,
#      the 57M preset),
#   4. structured outputs: 100% JSON-schema requests against unconstrained on the demo model,
#      the masks overlapped with the forward (bench/structured.py; issue 32's >= 0.90x goal),
#   5. end to end on a Llama-3-8B-shaped bf16 checkpoint (bench/gpu_e2e.py --preset llama3-8b):
#      cold and warm start, output tok/s on 512 ShareGPT-like requests, transformers
#      `generate` on the same GPU, the ratio.
# Outputs go to $OUT if set, else ./gpu_check_out: one log per stage, the junit XML, the
# benchmarks' JSON, and summary.json (every stage's status, time and headline numbers); a table
# is printed at the end. Usage, from anywhere:  bash bench/gpu_check.sh
#
# Time budget. Every stage runs under `timeout` for min(its cap, what is left of the total
# minus what the later stages are guaranteed), so the stages together stay inside
# GPU_CHECK_TOTAL_S (580 s on a GPU, 460 on the CPU) even when each one runs to its limit; the
# summary adds about a second, `timeout -k` at most 5 s per stage that ignores SIGTERM. A stage that times out leaves
# its partial output (the benchmarks rewrite their JSON after every row or phase; the test
# counts come from the per-test log lines when pytest did not get to write its XML) and the
# script goes on to the next. Unused time flows to the end-to-end stage.
#
#   stage                                                      cap (s)   estimate, H200 (*)
#   0  pip install -e . (only if jaxserve does not import)        60      ~10
#      device probe (jax, the GPU, library versions)              45      ~10
#   -  the 16 GB checkpoint of stage 4, written in the background during stages 1-3 (numpy,
#      no torch model; disk and one CPU core only; stage 4 waits for it if needed)  ~20-60
#   1  kernel grid, 4 pytest-xdist workers sharing the GPU        90      ~40-80
#      then the tests named *bandwidth* alone (timing asserts)    25      ~10
#   2  attention bandwidth, 3 backends x 2 page sizes             45      ~20-40
#   3  precompiled: compile, load, compile again (3 processes)    75      ~40-60
#      spec_decode: 6 engines of the 57M model, 1 and 16 at once  130      ~80-130
#   4  structured outputs (skipped without llguidance, below)     60      ~30-50
#   5  end to end: everything left, at least                     270      ~240-330
#      (bench/gpu_e2e.py --budget-s <that - 10>, three processes with their own deadlines):
#        cold: the rest after the reserves below: load 16 GB (~30-45 s) + compile every bucket
#          (10 token buckets x 2 sampler variants = 20 compilations; it stops compiling when
#          45 s are left, for the run) + 512 requests (~30 s; cut at its deadline if need be);
#        transformers: reserve 75, cap 90: load (~25 s) + generate on the first 64 requests,
#          stopped by generate(max_time) at its deadline;
#        warm: reserve 60, then whatever is left: load + every bucket from the cache.
#   6  summary.json and the tables                                          ~1
#   (*) estimates from CPU measurements (disk ~0.3 GB/s, bf16 transposes ~0.3 GB/s on a 2-core
#       VM) and typical H200 figures; the first device run's (an H100, 2026-12-05) are in
#       docs/benchmarks.md.
#
# Environment: OUT, PYTHON (default python3), GPU_CHECK_TOTAL_S (above), GPU_CHECK_CACHE (where the
# checkpoint lives, default bench/.cache/gpu_e2e: not under $OUT, it is 16 GB),
# GPU_CHECK_PYTEST_WORKERS (4 on GPU when pytest-xdist is installed; 0 = one serial run),
# GPU_CHECK_KEEP_COMPILE_CACHE=1 (keep $OUT/jax_compile_cache, removed by default: large).
# GPU_CHECK_PLATFORM=cpu runs the same stages on the CPU with tiny presets (tests/bench uses it
# to check this script's plumbing); GPU_CHECK_ATTENTION_PRESET, GPU_CHECK_ATTENTION_BACKENDS,
# GPU_CHECK_E2E_PRESET and GPU_CHECK_E2E_ARGS override the stages' presets and options,
# GPU_CHECK_STRUCTURED_ARGS the structured stage's.
# Structured outputs need llguidance, which a device image may lack and cannot download: its
# package folder (pure Python and one abi3 library, any CPython >= 3.8 on x86-64 Linux) copied to
# bench/.device_libs/llguidance on a machine that has it, and that folder carried along (it is
# git-ignored), is put on PYTHONPATH here:
#   mkdir -p bench/.device_libs && cp -r "$(python -c 'import llguidance, os;
#   print(os.path.dirname(llguidance.__file__))')" bench/.device_libs/
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
platform=${GPU_CHECK_PLATFORM:-gpu}
if [ "$platform" = cpu ]; then total=${GPU_CHECK_TOTAL_S:-460}; else total=${GPU_CHECK_TOTAL_S:-580}; fi
cache=${GPU_CHECK_CACHE:-bench/.cache/gpu_e2e}
if [ "$platform" = cpu ]; then
  attention_preset=${GPU_CHECK_ATTENTION_PRESET:-cpu-smoke}
  e2e_preset=${GPU_CHECK_E2E_PRESET:-tiny}
else
  attention_preset=${GPU_CHECK_ATTENTION_PRESET:-h200-decode}
  e2e_preset=${GPU_CHECK_E2E_PRESET:-llama3-8b}
fi
# Seconds guaranteed to the stages after each one (their minimum). The two issue checks
# (precompiled, spec_decode) run on a GPU only (GPU_CHECK_EXTRAS=1 / 0 to choose): the CPU run
# (tests/bench) keeps to the rest.
reserve_attention=45
reserve_e2e=270
# The structured stage's minimum, and everything after the extras together.
if [ "$platform" = cpu ]; then reserve_structured=20; else reserve_structured=25; fi
reserve_tail=$((reserve_structured + reserve_e2e))
extras=${GPU_CHECK_EXTRAS:-$([ "$platform" = gpu ] && echo 1 || echo 0)}
reserve_extras=0
if [ "$extras" = 1 ]; then reserve_extras=120; fi

start=$(date +%s)
stages="$out/stages.tsv"
printf 'stage\tstatus\texit_code\twall_s\ttimeout_s\n' >"$stages"

left() { echo $((total - ($(date +%s) - start))); }

# limit CAP RESERVE: seconds for a stage: its cap, or what is left after RESERVE if less.
limit() {
  local cap=$1 rest
  rest=$(($(left) - $2))
  if [ "$rest" -lt "$cap" ]; then cap=$rest; fi
  echo "$cap"
}

# record NAME EXIT_CODE WALL TIMEOUT: one row of stages.tsv.
record() {
  local status=failed
  case "$2" in
    0) status=ok ;;
    5) status=ok ;; # pytest: no test selected
    124 | 137) status=timeout ;;
    skipped) status=skipped ;;
  esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$status" "$2" "$3" "$4" >>"$stages"
  echo "== $1: $status (exit $2, ${3}s of ${4}s)"
}

# stage NAME CAP RESERVE CMD...: run CMD under timeout, its output in $out/NAME.txt.
stage() {
  local name=$1 t s rc
  t=$(limit "$2" "$3")
  shift 3
  if [ "$t" -lt 5 ]; then
    record "$name" skipped 0 "$t"
    return 0
  fi
  echo "== $name (up to ${t}s): $*"
  s=$(date +%s)
  timeout -k 5 "$t" "$@" 2>&1 | tee "$out/$name.txt"
  rc=${PIPESTATUS[0]}
  record "$name" "$rc" $(($(date +%s) - s)) "$t"
  return 0
}

# 0. Install (offline, no deps) if this machine has not yet; then what jax sees.
if ! "$python" -c "import jaxserve.pallas_kernels" 2>/dev/null; then
  stage install 60 $((reserve_attention + reserve_extras + reserve_tail + 90)) \
    "$python" -m pip install -q --no-deps --no-build-isolation -e .
  if ! "$python" -c "import jaxserve.pallas_kernels"; then
    echo "jaxserve does not import after pip install -e .: see $out/install.txt"
    exit 2
  fi
fi
stage probe 45 $((reserve_attention + reserve_extras + reserve_tail + 90)) "$python" - "$out/devices.json" "$platform" <<'PY'
import importlib.metadata as md
import json
import sys

import jax

path, want = sys.argv[1], sys.argv[2]
dev = jax.devices()[0]
stats = dev.memory_stats() or {}
versions = {}
for name in ("jax", "jaxlib", "flax", "orbax-checkpoint", "torch", "transformers", "pytest-xdist"):
    try:
        versions[name] = md.version(name)
    except md.PackageNotFoundError:
        versions[name] = None
info = dict(
    backend=jax.default_backend(),
    devices=[str(d) for d in jax.devices()],
    device_kind=dev.device_kind,
    compute_capability=getattr(dev, "compute_capability", None),
    core_count=getattr(dev, "core_count", None),
    bytes_limit=stats.get("bytes_limit"),
    versions=versions,
)
print(json.dumps(info, indent=1))
with open(path, "w") as f:
    json.dump(info, f, indent=1)
if want == "gpu":
    assert jax.default_backend() == "gpu", "no GPU visible to jax"
PY
if [ "$(awk -F'\t' '$1 == "probe" {print $2}' "$stages")" != ok ]; then
  echo "the device probe failed: see $out/probe.txt"
  exit 2
fi

# The end-to-end checkpoint, written while the kernels are tested (reused when present).
ckpt_limit=$(($(left) - 60))
timeout -k 5 "$ckpt_limit" "$python" bench/gpu_e2e.py --preset "$e2e_preset" --checkpoint-only \
  --cache "$cache" --out "$out/e2e_checkpoint.json" >"$out/checkpoint.txt" 2>&1 &
ckpt_pid=$!

# 1. The kernel grid. Workers share the GPU, so none may preallocate it; the tests that time
# a kernel against the HBM peak run afterwards, alone.
workers=${GPU_CHECK_PYTEST_WORKERS:-}
if [ -z "$workers" ]; then
  workers=0
  if [ "$platform" = gpu ] && "$python" -c "import xdist" 2>/dev/null; then workers=4; fi
fi
pytest_args=(--platform "$platform" -m gpu tests/pallas_kernels -v -rs -p no:cacheprovider)
if [ "$workers" -gt 0 ]; then
  stage kernel_tests 90 $((reserve_attention + reserve_extras + reserve_tail + 25)) \
    env XLA_PYTHON_CLIENT_PREALLOCATE=false "$python" -m pytest "${pytest_args[@]}" \
    -n "$workers" -k "not bandwidth" --junitxml="$out/pytest_gpu.xml"
  stage kernel_tests_bandwidth 25 $((reserve_attention + reserve_extras + reserve_tail)) \
    "$python" -m pytest "${pytest_args[@]}" -k bandwidth --junitxml="$out/pytest_gpu_bandwidth.xml"
else
  stage kernel_tests 115 $((reserve_attention + reserve_extras + reserve_tail)) \
    "$python" -m pytest "${pytest_args[@]}" --junitxml="$out/pytest_gpu.xml"
fi

# 2. Decode attention bandwidth, every implementation the registry runs here.
attention_args=(--preset "$attention_preset" --out "$out/attention_kernel.json")
if [ -n "${GPU_CHECK_ATTENTION_BACKENDS:-}" ]; then
  attention_args+=(--backends "$GPU_CHECK_ATTENTION_BACKENDS")
fi
stage attention 45 $((reserve_extras + reserve_tail)) "$python" bench/attention_kernel.py \
  "${attention_args[@]}"

# 3. The issues' first device checks (GPU only, unless GPU_CHECK_EXTRAS says otherwise): executables compiled deviceless for this
# chip's target load into an engine on it (bench/precompiled_check.py); speculative decoding
# against plain decoding, and the cost of a verification step (bench/spec_decode.py).
if [ "$extras" = 1 ]; then
  stage precompiled 75 $((70 + reserve_tail)) "$python" bench/precompiled_check.py \
    --preset quick --out "$out/precompiled.json"
  stage spec_decode 130 "$reserve_tail" "$python" bench/spec_decode.py --batch-sizes 1,16 \
    --workloads repetitive --methods ngram,ngram-auto,oracle --no-sampled-drafts --plain-variance \
    --output "$out/spec_decode.json"
fi

# 4. Structured outputs: 100% JSON against unconstrained, in one engine (bench/structured.py).
if [ -d bench/.device_libs ]; then export PYTHONPATH="$PWD/bench/.device_libs${PYTHONPATH:+:$PYTHONPATH}"; fi
if [ "$platform" = cpu ]; then
  structured_args="--num-requests 4 --max-tokens 8 --prompt-len 4 --max-num-seqs 4
    --max-num-batched-tokens 4 --max-model-len 32 --fractions 0,1 --modes overlapped --repeats 1"
else
  structured_args="--fractions 0,1 --modes overlapped --repeats 3"
fi
if "$python" -c "import llguidance" 2>/dev/null; then
  # shellcheck disable=SC2086  # the arguments, split on purpose
  stage structured 60 "$reserve_e2e" "$python" bench/structured.py \
    ${GPU_CHECK_STRUCTURED_ARGS:-$structured_args} --output "$out/structured.json"
else
  echo "llguidance does not import: see this script's header" | tee "$out/structured.txt"
  record structured skipped 0 0
fi

# 5. End to end: the checkpoint first (normally written by now), then everything left.
s=$(date +%s)
wait "$ckpt_pid"
record checkpoint_wait $? $(($(date +%s) - s)) "$ckpt_limit"
e2e_limit=$(limit 100000 0)
# shellcheck disable=SC2086  # GPU_CHECK_E2E_ARGS: extra options, split on purpose
stage e2e "$e2e_limit" 0 "$python" bench/gpu_e2e.py --preset "$e2e_preset" --cache "$cache" \
  --out "$out/e2e.json" --compile-cache "$out/jax_compile_cache" --budget-s $((e2e_limit - 10)) \
  ${GPU_CHECK_E2E_ARGS:-}
if [ "${GPU_CHECK_KEEP_COMPILE_CACHE:-0}" != 1 ]; then rm -rf "$out/jax_compile_cache"; fi

# 6. The summary: summary.json and the tables.
"$python" - "$out" "$total" "$(($(date +%s) - start))" "$platform" <<'PY'
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, total, wall, platform = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]


def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


stages = {}
for line in (out / "stages.tsv").read_text().splitlines()[1:]:
    name, status, code, wall_s, timeout_s = line.split("\t")
    stages[name] = dict(status=status, exit_code=code, wall_s=int(wall_s), timeout_s=int(timeout_s))

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
LINE = re.compile(r"\b(" + "|".join(OUTCOMES) + r")\b")


def test_counts(xml_name, log_name):
    """Counts and failures from the junit XML, else (pytest cut off) from the -v log lines."""
    path = out / xml_name
    if path.exists():
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError:
            root = None
        if root is not None:
            suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
            get = lambda k: sum(int(s.get(k, 0)) for s in suites)  # noqa: E731
            total_ = get("tests")
            failures = []
            for case in root.iter("testcase"):
                for kind in ("failure", "error"):
                    el = case.find(kind)
                    if el is not None:
                        msg = (el.get("message") or "").splitlines()[:1]
                        failures.append(f"{case.get('name')}: {kind}: {' '.join(msg)[:300]}")
            counts = dict(
                total=total_,
                failed=get("failures"),
                errors=get("errors"),
                skipped=get("skipped"),
                source="junit xml",
            )
            counts["passed"] = total_ - counts["failed"] - counts["errors"] - counts["skipped"]
            return counts, failures[:30]
    log = out / log_name
    if not log.exists():
        return None, []
    counts = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    key = dict(PASSED="passed", FAILED="failed", ERROR="errors", SKIPPED="skipped",
               XFAIL="skipped", XPASS="passed")
    failures = []
    for line in log.read_text(errors="replace").splitlines():
        if "::" not in line:
            continue
        m = LINE.search(line)
        if m and not line.startswith(("FAILED ", "ERROR ", "SKIPPED ")):  # not the -r summary
            counts[key[m.group(1)]] += 1
            if m.group(1) in ("FAILED", "ERROR"):
                failures.append(line.strip()[:300])
    counts["total"] = sum(counts.values())
    counts["source"] = "log lines (no junit xml: cut off)"
    return counts, failures[:30]


for name, xml, log in (
    ("kernel_tests", "pytest_gpu.xml", "kernel_tests.txt"),
    ("kernel_tests_bandwidth", "pytest_gpu_bandwidth.xml", "kernel_tests_bandwidth.txt"),
):
    if name in stages:
        counts, failures = test_counts(xml, log)
        stages[name].update(counts=counts, failures=failures)

attention = load("attention_kernel.json")
if attention and "attention" in stages:
    from_rows = {}
    for row in attention.get("cases", []):
        entry = from_rows.setdefault(row["backend"], {"impl": row.get("impl"), "errors": [], "decode": {}})
        if "error" in row:
            entry["errors"].append(f"P={row['page_size']} {row['kind']}: {row['error'][:300]}")
        elif row.get("kind") == "decode" and "achieved_Bps" in row:
            entry["decode"][str(row["page_size"])] = dict(
                achieved_Bps=row["achieved_Bps"],
                fraction_of_copy=row.get("fraction_of_copy"),
                kernel_us=row["kernel_s"] * 1e6,
                max_abs_err=row.get("max_abs_err"),
                mismatch=row.get("mismatch", False),
                batch=row["batch"],
                context=row["context"],
            )
    stages["attention"].update(
        copy_Bps=attention.get("copy_Bps"),
        complete=attention.get("complete"),
        backends=from_rows,
    )

written = load("e2e_checkpoint.json")
if written and "checkpoint_wait" in stages:
    stages["checkpoint_wait"]["checkpoint"] = written.get("checkpoint")

pre = load("precompiled.json")
if pre and "precompiled" in stages:
    keys = ("ready_s", "compilations", "cache_hits", "refused", "error", "plan")
    stages["precompiled"].update(
        ok=pre.get("ok"),
        target=pre.get("target"),
        compile={k: v for k, v in (pre.get("compile") or {}).items() if k != "stderr_tail"},
        **{n: {k: (pre.get(n) or {}).get(k) for k in keys} for n in ("loaded", "compiled")},
    )

spec = load("spec_decode.json")
if spec and "spec_decode" in stages:
    stages["spec_decode"].update(
        rows=[{k: r.get(k) for k in ("workload", "batch", "engine", "output_tok_s", "ratio",
                                      "acceptance", "steps", "proposer_share")}
              for r in spec.get("rows", [])],
        verification_cost=spec.get("verification_cost"),
        plain_batch_variance=spec.get("plain_batch_variance"),
    )

structured = load("structured.json")
if structured and "structured" in stages:
    keys = ("fraction_constrained", "mode", "output_tok_per_s", "vs_unconstrained",
            "vs_unconstrained_rounds", "constrained_valid", "constrained", "masks_ms_per_step",
            "device_idle_ms_per_step", "cpu_ms_per_step")
    stages["structured"].update(
        rows=[{k: r.get(k) for k in keys} for r in structured.get("rows", [])],
        recompilations_after_warmup=len(structured.get("recompilations_after_warmup", [])),
    )

e2e = load("e2e.json")
if e2e and "e2e" in stages:
    stages["e2e"].update(
        summary=e2e.get("summary"),
        phases=e2e.get("phases"),
        checkpoint=e2e.get("checkpoint"),
        complete=e2e.get("complete"),
        published=e2e.get("published"),
    )

summary = dict(
    platform=platform,
    total_budget_s=total,
    wall_s=wall,
    device=load("devices.json"),
    stages=stages,
)
(out / "summary.json").write_text(json.dumps(summary, indent=1))


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


print(f"\n{'stage':24} {'status':8} {'wall s':>7} {'limit s':>7}  result")
for name, st in stages.items():
    result = ""
    c = st.get("counts")
    if c:
        result = (f"passed {c['passed']}, failed {c['failed']}, errors {c['errors']}, "
                  f"skipped {c['skipped']}")
    elif name == "attention" and st.get("backends"):
        result = f"copy {fmt((st.get('copy_Bps') or 0) / 1e9)} GB/s"
    elif name == "precompiled" and "ok" in st:
        lo = st.get("loaded") or {}
        result = (f"ok {st['ok']}: {st.get('target')}, loaded with {lo.get('compilations')} "
                  f"compilations, {lo.get('cache_hits')} hits {lo.get('refused') or ''}")
    elif name == "spec_decode" and st.get("rows"):
        cost = st.get("verification_cost") or {}
        result = " ".join(f"{r['engine']}@{r['batch']} {fmt(r['ratio'], '.2f')}x"
                          for r in st["rows"])
        result += f"; verify {fmt(cost.get('ratio'), '.2f')}x a decode step"
        result += "".join(f"; plain@{v['batch']} vs @1: {v['differ']}/{v['requests']} differ"
                          for v in st.get("plain_batch_variance") or [])
    elif name == "structured" and st.get("rows"):
        result = " ".join(f"{fmt(100 * r['fraction_constrained'], '.0f')}% {r['mode']} "
                          f"{fmt(r['vs_unconstrained'], '.2f')}x"
                          f" (rounds {fmt(r['vs_unconstrained_rounds'], '.2f')}x)"
                          for r in st["rows"] if r["fraction_constrained"] > 0)
        result += f"; {st['recompilations_after_warmup']} compilations after warm-up"
    elif name == "e2e" and st.get("summary"):
        s = st["summary"]
        result = (f"jaxserve {fmt(s.get('jaxserve_output_tokens_per_s'))} tok/s, "
                  f"transformers {fmt(s.get('hf_output_tokens_per_s'))}, "
                  f"ratio {fmt(s.get('jaxserve_over_hf'), '.2f')}")
    print(f"{name:24} {st['status']:8} {st['wall_s']:>7} {st['timeout_s']:>7}  {result}")
    for failure in st.get("failures", [])[:10]:
        print(f"{'':24}   {failure[:150]}")

att = stages.get("attention", {})
if att.get("backends"):
    pages = sorted({p for b in att["backends"].values() for p in b["decode"]}, key=int)
    print(f"\ndecode attention, achieved K/V GB/s (% of the device copy "
          f"{fmt((att.get('copy_Bps') or 0) / 1e9)} GB/s)")
    print(f"{'backend':20} {'impl':20} " + " ".join(f"{'P=' + p:>16}" for p in pages))
    for backend, b in att["backends"].items():
        cells = []
        for p in pages:
            d = b["decode"].get(p)
            if d is None:
                cells.append(f"{'-':>16}")
            else:
                flag = "!" if d["mismatch"] else ""
                cells.append(f"{d['achieved_Bps'] / 1e9:>8.0f} ({100 * (d['fraction_of_copy'] or 0):>3.0f}%){flag}".rjust(16))
        print(f"{backend:20} {str(b['impl'] or '-'):20} " + " ".join(cells))
        for err in b["errors"][:2]:
            print(f"{'':20}   error: {err[:140]}")

s = stages.get("e2e", {}).get("summary")
if s:
    print("\nend to end")
    rows = [
        ("cold start: construct + warmup, s", fmt(s.get("cold_start_s")),
         f"(construct {fmt(s.get('cold_construct_s'))} + warmup {fmt(s.get('cold_warmup_s'))}, "
         f"{s.get('warmup_compilations')} compilations, complete {s.get('cold_warmup_complete')})"),
        ("warm start: construct + warmup, s", fmt(s.get("warm_start_s")),
         f"(construct {fmt(s.get('warm_construct_s'))} + warmup {fmt(s.get('warm_warmup_s'))}, "
         f"{s.get('warm_cache_hits')} cache hits)"),
        ("jaxserve output tok/s", fmt(s.get("jaxserve_output_tokens_per_s")),
         f"({s.get('jaxserve_num_requests')} requests, complete {s.get('jaxserve_run_complete')}, "
         f"attention {s.get('attention')})"),
        ("transformers output tok/s", fmt(s.get("hf_output_tokens_per_s")),
         f"({s.get('hf_num_requests')} requests, complete {s.get('hf_run_complete')})"),
        ("jaxserve / transformers", fmt(s.get("jaxserve_over_hf"), ".2f"), ""),
        ("vLLM, published (not measured)", fmt(s.get("vllm_published_output_tokens_per_s"), ".0f"),
         f"(jaxserve / that: {fmt(s.get('jaxserve_over_vllm_published'), '.2f')})"),
    ]
    for name, value, note in rows:
        print(f"  {name:36} {value:>10}  {note}")
print(f"\nwall {wall} s of a {total} s budget; summary: {out / 'summary.json'}")
PY

# Exit status: 0 when every stage was ok.
! awk -F'\t' 'NR > 1 && $2 != "ok" {bad = 1} END {exit !bad}' "$stages"
