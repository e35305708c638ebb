#!/usr/bin/env bash
# The llama.cpp source the H200's `lbuild` stage compiles (scripts/h200.sh): the tree vendored in the
# pinned oracle's sdist (llama-cpp-python, the version pyproject's `oracle` extra pins), without its
# models, docs, tests, examples and server, as .llama-src/llama.cpp.tar.gz (git-ignored; carry it).
#   bash scripts/llama_src.sh            # downloads the sdist with pip (needs the network)
set -euo pipefail
ver=$(grep -oE 'llama-cpp-python==[0-9.]+' pyproject.toml | head -1 | cut -d= -f3)
work=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d "$work"
tar -xzf "$work"/llama_cpp_python-"$ver".tar.gz -C "$work"
mkdir -p .llama-src
tar -czf .llama-src/llama.cpp.tar.gz -C "$work/llama_cpp_python-$ver/vendor/llama.cpp" \
  --exclude=./models --exclude=./docs --exclude=./media --exclude=./tests --exclude=./examples \
  --exclude=./tools/server --exclude=./gguf-py --exclude=./pocs --exclude=./.git .
rm -rf "$work"
grep -qx '/.llama-src/' .git/info/exclude 2>/dev/null || echo /.llama-src/ >> .git/info/exclude
grep -qx '/.llama-build/' .git/info/exclude 2>/dev/null || echo /.llama-build/ >> .git/info/exclude
ls -l .llama-src/llama.cpp.tar.gz
