#!/usr/bin/env bash
# The llama.cpp source the H200's `lbuild` stage compiles (scripts/h200.sh): the tree vendored in a
# llama-cpp-python sdist (default: the version pyproject's `oracle` extra pins; 0.3.36 has glm4moe's
# MTP drafts, `--spec-type draft-mtp`), without its models, docs, tests and server, as
# .llama-src/llama.cpp-VERSION.tar.gz (git-ignored; carry .llama-src).
#   bash scripts/llama_src.sh [VERSION]     # downloads the sdist with pip (needs the network)
set -euo pipefail
ver=${1:-$(grep -oE 'llama-cpp-python==[0-9.]+' pyproject.toml | head -1 | cut -d= -f3)}
work=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d "$work"
tar -xzf "$work"/llama_cpp_python-"$ver".tar.gz -C "$work"
mkdir -p .llama-src
# examples/ and pocs/ stay: the speculative-simple example is how llama.cpp drafts from a file
tar -czf ".llama-src/llama.cpp-$ver.tar.gz" -C "$work/llama_cpp_python-$ver/vendor/llama.cpp" \
  --exclude=./models --exclude=./docs --exclude=./media --exclude=./tests \
  --exclude=./tools/server --exclude=./gguf-py --exclude=./.git .
rm -rf "$work"
ls -l ".llama-src/llama.cpp-$ver.tar.gz"
