#!/usr/bin/env bash
# Fetch, on a machine with internet access, the wheels the GPU machine lacks (its image has
# Python 3.12, CUDA torch, torchvision, numpy, scipy, pillow, pyyaml, tqdm, pytest), into .whl/
# (git-ignored). Then, on the GPU machine, from the repository root (see docs/benchmarks.md, "GPU checks"):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_check.py --out gpu-check
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(openslide-python==1.4.7 openslide-bin==4.0.1.2 imagecodecs==2026.3.6 tifffile==2026.3.3
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)
rm -rf .whl && mkdir .whl
for w in "${wheels[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$w"
done
du -sh .whl
