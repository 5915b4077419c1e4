#!/usr/bin/env bash
# The one prepared GPU check (benchmarks/gpu_check.py): every GPU test and the GPU benchmarks under one deadline
# (default 540 s, inside the device machine's 600 s per command), each step capped at the time left and its JSON
# written as it finishes; a smoke step first (versions, one compiled kernel against its reference, under 30 s); a
# one-screen summary at the end; all figures in $OUT/gpu_check.json.
#
# On the lent GPU machine (the `device` tool's `run`; it copies the working tree, and nothing is installed there:
# the image has torch, triton, transformers, onnx(runtime) and lightning, the project runs from PYTHONPATH):
#
#   1. here, build the tiny world once (`make demo`), so artifacts/tiny holds the target and the drafters;
#      the steps need its world directory and drafters only (about 38 MiB; all of artifacts/tiny, with the
#      offline features and checkpoints, is past the 64 MiB a call carries);
#   2. run:   command: OUT=$OUT bash benchmarks/gpu_check.sh
#             carry:   ["artifacts/tiny/world-<hash>", "artifacts/tiny/drafter"]
#             timeout_s: 600
#   3. the results come back under the call's files_at (gpu_check.json, one <step>.txt/.json per step).
#
# Without artifacts/tiny the world-dependent steps (adaptive, trees, static_adaptive, d2sd, trt) are skipped and say so.
# DEADLINE overrides the budget in seconds; ONLY=smoke,kernels runs a subset.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py --out "${OUT:-artifacts/gpu}" --deadline "${DEADLINE:-540}" \
  ${ONLY:+--only "$ONLY"}
