#!/usr/bin/env bash
# The kernels' GPU evidence in one call: the compiled-kernel agreement check and the kernel benchmark.
# One process per sequence length, one for FLA's kernels and one for the check run side by side; they
# compile in parallel (compilation dominates) and take turns timing (`--lock`: compiling and checking
# hold it shared, timing exclusively, since XLA's autotuner and the checks run kernels on the device).
# Every process writes its rows to a JSONL in DIR as it measures them, and a rerun with the same DIR
# measures only what is missing, so a time limit loses nothing measured.
#
#   bash scripts/bench_gpu.sh DIR [SECONDS]      # SECONDS: the wall-clock budget (default 540)
#
# Environment (defaults in brackets): OPS, the ops timed per T [softmax,sanatan_p1,gated,taylor,sanatan_p2];
# CHECK_OPS, the ops checked [sanatan_p1,sanatan_p2,gated,taylor]; FLA_OPS, FLA's kernels timed
# [sanatan_p1,taylor,gated; '' = none]; TUNE, ops whose kernel settings are tried at T = 8192 ['' = none];
# BACKENDS=1 also runs scripts/bench_backends.py (Pallas-Triton vs Mosaic GPU).
#
# Then: python scripts/bench_report.py DIR (prints the agreement and kernel tables; to publish them, copy
# the rows to docs/bench/ and run python scripts/bench_report.py).
set -u
dir=${1:?usage: bash scripts/bench_gpu.sh DIR [SECONDS]}
end=$(( $(date +%s) + ${2:-540} ))
mkdir -p "$dir"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1  # several processes share the device
lock="$dir/timing.lock"
ops=${OPS-softmax,sanatan_p1,gated,taylor,sanatan_p2}
check_ops=${CHECK_OPS-sanatan_p1,sanatan_p2,gated,taylor}
fla_ops=${FLA_OPS-sanatan_p1,taylor,gated}

until_end() {  # runs "$@" with whatever is left of the budget
  local left=$(( end - $(date +%s) ))
  (( left > 10 )) && timeout "$left" "$@"
}

until_end python3 scripts/check_kernels.py --length=1000 --batch=2 --ops="$check_ops" \
  --jsonl="$dir/agreement.jsonl" --out= --lock="$lock" > "$dir/agreement.log" 2>&1 &
for length in 2048 8192 32768; do
  until_end python3 scripts/bench_kernels.py --lengths="$length" --ops="$ops" \
    --fla_ops= --repeats=20 --lock="$lock" --jsonl="$dir/kernels_$length.jsonl" --out= > "$dir/kernels_$length.log" 2>&1 &
done
if [[ -n "${TUNE-}" ]]; then
  until_end python3 scripts/bench_kernels.py --lengths=8192 --ops= --fla_ops= --tune="$TUNE" --repeats=20 \
    --lock="$lock" --jsonl="$dir/tuning.jsonl" --out= > "$dir/tuning.log" 2>&1 &
fi
if [[ -n "${BACKENDS-}" ]]; then
  until_end python3 scripts/bench_backends.py --tokens=6291456 --repeats=50 --lock="$lock" --child_timeout=300 \
    --jsonl="$dir/backends.jsonl" > "$dir/backends.log" 2>&1 &
fi
{  # FLA's chunk_gla autotunes for minutes: last
  for fla_op in ${fla_ops//,/ }; do
    until_end python3 scripts/bench_kernels.py --ops= --fla_ops="$fla_op" --repeats=20 --lock="$lock" \
      --jsonl="$dir/fla.jsonl" --out=
  done
} > "$dir/fla.log" 2>&1 &
wait
tail -n 4 "$dir"/*.log
