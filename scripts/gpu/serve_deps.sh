#!/usr/bin/env bash
# The server's packages for the GPU machine's image (Python 3.12, no network there; it lacks
# fastapi, uvicorn, httptools, starlette, pydantic, prometheus-client and httpx), installed into ./gpu_serve_deps (git-ignored) to
# travel with the working tree. Run on a machine with PyPI, then on the GPU:
#   PYTHONPATH=.:gpu_serve_deps python3 scripts/gpu/serve_vs_engine.py --out $OUT
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf gpu_serve_deps
${PIP:-python3 -m pip} install --quiet --disable-pip-version-check --target gpu_serve_deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
    fastapi==0.165.0 uvicorn==0.54.0 httptools==0.9.0 pydantic==2.14.4 prometheus-client==0.26.0 httpx==0.28.1
du -sh gpu_serve_deps
