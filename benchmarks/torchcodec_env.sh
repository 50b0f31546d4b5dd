#!/usr/bin/env bash
# A venv where transformers' default video reader, torchcodec, loads: for the "transformers with
# torchcodec" rows of benchmarks/preprocess.py (issue 44 item 3).
#
#   bash benchmarks/torchcodec_env.sh [VENV]        # default .reference/torchcodec-venv (~3 GB, minutes)
#   VLFAST_REFERENCE_TORCHVISION=VENV/reference-torchvision PYTHONPATH=VENV/reference-torchcodec \
#     OMP_NUM_THREADS=1 VENV/bin/python benchmarks/preprocess.py --only video
#
# Why a venv of its own: PyPI's torchcodec wheels (0.16, 0.17) are CUDA 13 builds, every library linking
# libtorch_cuda and libnvrtc, so they do not load beside the CPU torch wheel this project tests with (the CPU
# wheels are on download.pytorch.org). They do load beside PyPI's default torch, itself a CUDA 13 build,
# which runs on a machine without a GPU; torchcodec then decodes on the CPU. torch 2.14.1 pairs with
# torchvision 0.29 and torchcodec 0.17. torchvision and torchcodec go into folders of their own (as
# .reference/ does for the test environment), so the vlfast rows run without them. Downloads at set-up only.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.reference/torchcodec-venv}
python -m venv "$venv"
"$venv/bin/pip" install -q torch==2.14.1
"$venv/bin/pip" install -q -e ".[extract]" qwen-vl-utils==0.0.14 requests
"$venv/bin/pip" install -q --no-deps --target "$venv/reference-torchvision" torchvision==0.29.0
"$venv/bin/pip" install -q --no-deps --target "$venv/reference-torchcodec" torchcodec==0.17.0
PYTHONPATH="$venv/reference-torchcodec" "$venv/bin/python" -c '
import torch, torchcodec.decoders
print(f"torch {torch.__version__}, torchcodec {torchcodec.__version__}: loads")'
