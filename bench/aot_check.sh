#!/usr/bin/env bash
# Compile Llama-3.1-8B (its config.json, written here: no download, no weights) for TPUs we do
# not have, deviceless, with `jaxserve compile`, and tabulate the results (bench/aot_report.py):
#   v6e-1            tensor_parallel_size 1
#   v5e-8            tensor_parallel_size 8
# (AOT_MODEL=mixtral-8x7b compiles Mixtral-8x7B instead, e.g. AOT_TARGETS="v6e-8:8".)
# Each run: compile status of every compilation, compile seconds, the compiled memory per
# device against the memory plan and the chip, whether the donated KV pages alias, and the
# roofline's predicted decode and prefill tok/s. Needs the TPU compiler: pip install
# "jaxserve[tpu]" (libtpu); GPU targets (AOT_TARGETS="h200:1 a100-80g:1") need the CUDA one:
# pip install "jaxserve[cuda12]" (~5 GB). Engine settings: the defaults (max_num_seqs 256,
# max_num_batched_tokens 2048) with max_model_len 8192 (Llama-3.1's 131072 needs 16 GiB of KV
# for one sequence: more than a v6e-1 has beside the weights).
#
# Environment: OUT (default aot_check_out), PYTHON (default python3), AOT_TARGETS (default
# "v6e-1:1 v5e-8:8", target:tp pairs), AOT_TOKEN_BUCKETS (default 4,64,2048: a one-token
# decode bucket, the decode batch the roofline predicts at, the full prefill chunk; "all" for
# every bucket, ~29 compilations of 1-4 minutes each on a 2-core machine), AOT_EXTRA_ARGS
# (more `jaxserve compile` flags, e.g. "--kv-cache-dtype fp8"), AOT_MODEL (llama-3.1-8b, the
# default, or mixtral-8x7b), AOT_NAME_SUFFIX (appended to each report's name, e.g. _fp8).
# Usage, from anywhere:  bash bench/aot_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-aot_check_out}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python=${PYTHON:-python3}
targets=${AOT_TARGETS:-"v6e-1:1 v5e-8:8"}
buckets=${AOT_TOKEN_BUCKETS:-4,64,2048}
export TPU_SKIP_MDS_QUERY=1 JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1

model_name=${AOT_MODEL:-llama-3.1-8b}
model="$out/$model_name"
mkdir -p "$model"
case "$model_name" in
  llama-3.1-8b) cat > "$model/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
 "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
 "num_hidden_layers": 32, "head_dim": 128, "vocab_size": 128256,
 "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
 "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
 "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
 "tie_word_embeddings": false, "attention_bias": false, "mlp_bias": false, "hidden_act": "silu"}
JSON
  ;;
  # mistralai/Mixtral-8x7B-v0.1's config.json: 8 experts of Mistral-7B's FFN, 2 per token.
  mixtral-8x7b) cat > "$model/config.json" <<'JSON'
{"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
 "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
 "num_hidden_layers": 32, "vocab_size": 32000, "max_position_embeddings": 32768,
 "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-05,
 "rope_theta": 1000000.0, "sliding_window": null, "router_aux_loss_coef": 0.02,
 "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
 "tie_word_embeddings": false, "hidden_act": "silu"}
JSON
  ;;
  *) echo "AOT_MODEL must be llama-3.1-8b or mixtral-8x7b, got $model_name" >&2; exit 2 ;;
esac

bucket_args=()
[ "$buckets" != all ] && bucket_args=(--token-buckets "$buckets")
reports=()
for pair in $targets; do
  target=${pair%%:*} tp=${pair##*:}
  name="${model_name}_${target}_tp${tp}${AOT_NAME_SUFFIX:-}"
  echo "== $name"
  start=$(date +%s)
  rm -f "$out/$name.json"
  # shellcheck disable=SC2086
  "$python" -m jaxserve.cli compile --model "$model" --target "$target" \
    --tensor-parallel-size "$tp" --max-model-len 8192 "${bucket_args[@]}" ${AOT_EXTRA_ARGS:-} \
    --json "$out/$name.json" > "$out/$name.log" 2>&1
  rc=$?
  echo "   exit $rc in $(( $(date +%s) - start )) s (log: $out/$name.log)"
  last=$(grep '^compiling ' "$out/$name.log" | tail -n 1)
  if [ ! -f "$out/$name.json" ] && [ -n "$last" ]; then  # ended mid-compile: a fatal error
    echo "   no report: the process ended while $last"
    grep -m 1 -E 'Fatal Error|^F[0-9]{4} ' "$out/$name.log" | cut -c 1-300
  fi
  grep -v -e '^WARNING' -e '^compiling ' -e 'Source Location' -e 'libtpu_init' -e '^E0000' -e 'Failed to find host' \
    "$out/$name.log" | tail -n 12
  [ -f "$out/$name.json" ] && reports+=("$out/$name.json")
done
[ ${#reports[@]} -gt 0 ] && "$python" bench/aot_report.py "${reports[@]}" --markdown "$out/table.md"
