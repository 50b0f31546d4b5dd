#!/usr/bin/env bash
# One command for a lent GPU: versions, patch-embed timings (fp32/bf16/fp16; cuDNN on, off, channels_last_3d),
# vlfast doctor, verify and extract, each step under its own timeout, all in OUT as JSON plus summary.md.
# The logic is in benchmarks/gpu.py; `bash benchmarks/gpu.sh --help` lists the options.
#
#   bash benchmarks/gpu.sh [OUT]             # OUT defaults to ./gpu-run-YYYYmmdd-HHMMSS
#   bash benchmarks/gpu.sh OUT --cpu-smoke   # the steps on CPU at tiny sizes: checks the plumbing
#
# Exit status: 0 all passed, 1 a step failed or timed out, 2 bad usage, 3 no CUDA device (facts only),
# 130 interrupted (what ran is written).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-$(command -v python || command -v python3)}"
exec "$python" "$here/gpu.py" "$@"
