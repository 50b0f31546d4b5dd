#!/usr/bin/env bash
# A venv where transformers' default video reader, torchcodec, loads: for the "transformers with
# torchcodec" rows of benchmarks/preprocess.py (issue 44 item 3).
#
#   bash benchmarks/torchcodec_env.sh [VENV]        # default .reference/torchcodec-venv (~6 GB, minutes)
#   LD_LIBRARY_PATH=VENV/ffmpeg-from-pyav:VENV/lib/python3.11/site-packages/av.libs \
#     VLFAST_REFERENCE_TORCHVISION=VENV/reference-torchvision \
#     PYTHONPATH=VENV/reference-torchcodec OMP_NUM_THREADS=1 \
#     VENV/bin/python benchmarks/preprocess.py --only video --name preprocess-torchcodec
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
# torchcodec decodes with the system's FFmpeg (libavutil.so.N, ...); where there is none, PyAV's wheel brings
# FFmpeg 8 under hashed names: VENV/ffmpeg-from-pyav names them as torchcodec looks for them (with av.libs
# itself on the path too, for what they load in turn)
libs=$(ls -d "$venv"/lib/python3*/site-packages/av.libs)
mkdir -p "$venv/ffmpeg-from-pyav"
for f in "$libs"/lib{avutil,avcodec,avformat,avdevice,avfilter,swscale,swresample}-*.so.*; do
  ln -sf "$f" "$venv/ffmpeg-from-pyav/$(basename "$f" | sed -E 's/-[0-9a-f]{8}\.so\.([0-9]+)\..*/.so.\1/')"
done
LD_LIBRARY_PATH="$venv/ffmpeg-from-pyav:$libs" PYTHONPATH="$venv/reference-torchcodec" "$venv/bin/python" -c '
import torch, torchcodec.decoders, vlfast.demo, tempfile, pathlib
clip = vlfast.demo.make_video(pathlib.Path(tempfile.mkdtemp()) / "a.mp4", frames=4, fps=30, width=64, height=48)
torchcodec.decoders.VideoDecoder(str(clip))[0]  # the core library loads with an FFmpeg only when it decodes
print(f"torch {torch.__version__}, torchcodec {torchcodec.__version__}: decodes")'
