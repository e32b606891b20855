#!/usr/bin/env bash
# Create .venv (Python 3.11) with foudre and its test tools. Idempotent and quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
# The tools tests/native/test_cross.py builds and runs the kernels with (an aarch64 cross
# compiler, qemu-user, clang), from the distribution's packages where this is root on Debian;
# without them those tests skip.
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] &&
  ! { command -v qemu-aarch64 && command -v aarch64-linux-gnu-g++ && command -v clang++; } >/dev/null; then
  pkgs="g++-aarch64-linux-gnu qemu-user clang"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q $pkgs >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $pkgs >/dev/null 2>&1; } ||
    echo "setup: could not install $pkgs; the cross-architecture kernel tests will skip" >&2
fi
# llama.cpp's source (its converter, convert_hf_to_gguf.py, for tests/loading/
# test_llama_cpp_converter.py; the benchmarks build from it too): the llama.cpp vendored in
# llama-cpp-python's sdist, fetched once into the benchmarks' cache. Best effort: without it those
# tests skip.
llama_src=${FOUDRE_LLAMA_CPP_SRC:-${FOUDRE_BENCH_CACHE:-$HOME/.cache/foudre-bench}/llama.cpp/src}
if [ ! -f "$llama_src/convert_hf_to_gguf.py" ]; then
  (
    set -e
    dl=$(mktemp -d)
    trap 'rm -rf "$dl"' EXIT
    pip_py=$PY
    [ -x .venv/bin/python ] && pip_py=.venv/bin/python
    "$pip_py" -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$dl"
    tar -xzf "$dl"/llama_cpp_python-*.tar.gz -C "$dl"
    mkdir -p "$(dirname "$llama_src")"
    rm -rf "$llama_src"
    mv "$dl"/llama_cpp_python-*/vendor/llama.cpp "$llama_src"
  ) >/dev/null 2>&1 ||
    echo "setup: could not fetch llama.cpp's source; the converter tests will skip" >&2
fi
stamp=.venv/.foudre-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# The CPU build of torch 2.13.0 (served locally on our machines); a GPU user installs a CUDA build
# of torch>=2.13 first and this step keeps it.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test]"
# openai-harmony's o200k vocabulary, for the harmony tests offline (they skip without it)
if command -v npm >/dev/null; then .venv/bin/python scripts/o200k_vocab.py .venv/o200k || true; fi
touch "$stamp"
