#!/usr/bin/env bash
# GPU readiness check for the Triton attention path: one command, no network, < 9 min on
# one H200. Run from anywhere inside a checkout that has its venv at .venv (or a system
# python with torch + triton):
#
#     bash bench/gpu_check.sh
#
# Parts (each under its own timeout, each logged to $LOG_DIR/<part>.log):
#   1. tests/kernels on CUDA: compiled kernels vs the torch reference in bf16/fp16/fp32,
#      plus the engine's greedy parity with the triton backend;
#   2. bench/kernel_bench.py: copy bandwidth, decode bandwidth % of copy over batch x
#      context, a decode launch-config sweep at 64 x 4096, prefill TFLOP/s;
#   3. bench/engine_e2e.py: engine output tokens/s, random Llama-3-8B-shaped model,
#      batch 1 / 32 / 128, triton backend eager, triton with decode CUDA graphs
#      (tests/kernels/test_cuda_graphs.py in part 1 checks their replay against eager),
#      and the torch backend as baseline.
# Last line: one JSON object merging every part's figures.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOG_DIR="${OUT:-${TMPDIR:-/tmp}}/gpu_check"
mkdir -p "$LOG_DIR"

# Install nothing: make any accidental pip call fail fast instead of reaching out.
export PIP_NO_INDEX=1
# Compiled kernels, not the interpreter.
unset TRITON_INTERPRET PAGEFLEET_KERNEL_DEVICE
# A carried venv's editable install may point at another checkout path: import this one.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

PY=""
for cand in "$ROOT/.venv/bin/python" python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch, triton" >/dev/null 2>&1; then
    PY="$cand"
    break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu_check: no python with torch and triton found (.venv/bin/python, python3)" >&2
  echo '{"gpu_check": "error", "reason": "no python with torch+triton"}'
  exit 2
fi
echo "gpu_check: python $PY ($("$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"
# GPU_CHECK_CPU_DRYRUN=1 walks the same plumbing on a CPU box (tiny parts, interpreter).
DRYRUN="${GPU_CHECK_CPU_DRYRUN:-0}"
if [ "$DRYRUN" != 1 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device; this check needs a GPU" >&2
  echo '{"gpu_check": "error", "reason": "no CUDA device"}'
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true

declare -A RC
# part NAME LIMIT_S CMD...: run with a timeout, tee to the log, never abort the script.
part() {
  local name="$1" limit="$2"
  shift 2
  echo
  echo "=== [$name] limit ${limit}s: $*"
  local t0=$SECONDS rc=0
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log" || rc=${PIPESTATUS[0]}
  RC[$name]=$rc
  echo "=== [$name] rc=$rc after $((SECONDS - t0))s"
}

if [ "$DRYRUN" = 1 ]; then
  part tests 130 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_backend_select.py \
    tests/kernels/test_cuda_graphs.py
  part kernel_bench 190 "$PY" bench/kernel_bench.py --quick
  part engine_e2e 160 "$PY" bench/engine_e2e.py --quick --batches 1 2 --max-tokens 3
else
  part tests 150 "$PY" -m pytest -q -p no:cacheprovider --timeout 120 tests/kernels
  part kernel_bench 170 "$PY" bench/kernel_bench.py
  part engine_e2e 210 "$PY" bench/engine_e2e.py --device cuda --shape llama3-8b \
    --batches 1 32 128 --baseline --cuda-graphs
fi

echo
echo "=== summary (logs in $LOG_DIR)"
RC_TESTS=${RC[tests]} RC_KB=${RC[kernel_bench]} RC_E2E=${RC[engine_e2e]} LOG_DIR="$LOG_DIR" \
  "$PY" - <<'PYEOF'
import json, os, re
from pathlib import Path

logs = Path(os.environ["LOG_DIR"])

def last_json(name):
    path = logs / f"{name}.log"
    if not path.exists():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None

tests_log = (logs / "tests.log").read_text(errors="replace") if (logs / "tests.log").exists() else ""
counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", tests_log)}
kb = last_json("kernel_bench") or {}
e2e = last_json("engine_e2e") or {}
summary = {
    "gpu_check": "done",
    "device": kb.get("device") or e2e.get("device"),
    "tests_rc": int(os.environ["RC_TESTS"]),
    "tests": counts,
    "kernel_bench_rc": int(os.environ["RC_KB"]),
    "copy_GBps": kb.get("copy_GBps"),
    "decode_pct_64x4096": kb.get("decode_pct_64x4096"),
    "decode_min_pct_at_ge_64x4096": kb.get("decode_min_pct_at_ge_64x4096"),
    "decode_target_met": kb.get("decode_target_met"),
    "decode_sweep_best_64x4096": kb.get("decode_sweep_best_64x4096"),
    "decode": [
        {k: r.get(k) for k in ("batch", "ctx", "triton_us", "pct_of_copy", "sdpa_dense_us")}
        for r in kb.get("decode", [])
    ],
    "prefill": [
        {k: r.get(k) for k in ("batch", "q_len", "prefix", "triton_TFLOPs", "sdpa_dense_TFLOPs")}
        for r in kb.get("prefill", [])
    ],
    "engine_e2e_rc": int(os.environ["RC_E2E"]),
    "engine_triton_output_tok_per_s": e2e.get("triton_output_tok_per_s"),
    "engine_torch_output_tok_per_s": e2e.get("torch_output_tok_per_s"),
    "engine_triton_decode_step_ms": e2e.get("triton_decode_step_ms"),
    "engine_triton_graphs_output_tok_per_s": e2e.get("triton_graphs_output_tok_per_s"),
    "engine_triton_graphs_decode_step_ms": e2e.get("triton_graphs_decode_step_ms"),
}
print(json.dumps(summary))
PYEOF
