#!/usr/bin/env bash
# Build BigMoeOnEdge's host CLI (bmoe-cli) against llama-cpp-python 0.3.36's vendored llama.cpp, with our
# patches, for bench/bench_peer.py. Not a CI dependency.
#
#   bench/peer/build_bigmoeonedge.sh PEER_SRC LLAMA_SRC BUILD_DIR
#
#   PEER_SRC   a BigMoeOnEdge source tree (git archive of github.com/Helldez/BigMoeOnEdge; its submodule
#              third_party/llama.cpp may be absent: it is not used)
#   LLAMA_SRC  llama.cpp sources: llama_cpp_python-0.3.36/vendor/llama.cpp from the sdist
#              (pip download --no-deps --no-binary llama-cpp-python --no-build-isolation llama-cpp-python==0.3.36)
#   BUILD_DIR  where the patched tree (BUILD_DIR/tree) and the CMake build (BUILD_DIR/build) go
#
# Neither source tree is modified: both are copied into BUILD_DIR/tree (llama.cpp as its third_party/llama.cpp)
# and patched there. A file whose patched content did not change keeps its timestamp, so a rerun rebuilds only
# what changed. Release, CPU only, the same ggml CPU options as the llama-cpp-python build epqlab links
# (GGML_NATIVE, OpenMP, llamafile sgemm, repack), JOBS parallel jobs (default 2) under nice -n 10.
# Prints the path of the built bmoe-cli on its last line.
set -euo pipefail

die() { echo "build_bigmoeonedge: $*" >&2; exit 1; }

[ $# -eq 3 ] || die "usage: $0 PEER_SRC LLAMA_SRC BUILD_DIR"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PEER_SRC="$1"; LLAMA_SRC="$2"; BUILD_DIR="$3"
JOBS="${JOBS:-2}"

[ -d "$PEER_SRC" ] || die "peer source dir '$PEER_SRC' does not exist (git archive of Helldez/BigMoeOnEdge)"
for f in CMakeLists.txt core/src/engine/session.cpp cli/main.cpp; do
    [ -f "$PEER_SRC/$f" ] || die "'$PEER_SRC' is not a BigMoeOnEdge tree: $f missing"
done
[ -d "$LLAMA_SRC" ] || die "llama.cpp source dir '$LLAMA_SRC' does not exist (llama_cpp_python-0.3.36/vendor/llama.cpp)"
for f in CMakeLists.txt ggml/src/ggml-cpu/ggml-cpu.c ggml/include/ggml-cpu.h common/speculative.h; do
    [ -f "$LLAMA_SRC/$f" ] || die "'$LLAMA_SRC' is not a llama.cpp tree: $f missing"
done
for t in cmake patch c++ cmp; do command -v "$t" >/dev/null || die "'$t' not found on PATH"; done
LLAMA_PATCHES=("$HERE/llama-expert-ready-hook.patch")
PEER_PATCHES=("$HERE/bmoe-vendored-llama.patch" "$HERE/bmoe-forced-tokens.patch")
for p in "${LLAMA_PATCHES[@]}" "${PEER_PATCHES[@]}"; do [ -f "$p" ] || die "patch $p missing"; done

mkdir -p "$BUILD_DIR"
BUILD_DIR="$(cd "$BUILD_DIR" && pwd)"
TREE="$BUILD_DIR/tree"
STAGE="$BUILD_DIR/stage"
rm -rf "$STAGE"
mkdir -p "$STAGE/third_party"
# the peer without its (empty) submodule dir and git metadata, then llama.cpp as that submodule
(cd "$PEER_SRC" && tar -c --exclude=./.git --exclude=./third_party/llama.cpp .) | tar -x -C "$STAGE"
rm -rf "$STAGE/third_party/llama.cpp"
mkdir -p "$STAGE/third_party/llama.cpp"
(cd "$LLAMA_SRC" && tar -c --exclude=./.git --exclude=./build .) | tar -x -C "$STAGE/third_party/llama.cpp"
for p in "${LLAMA_PATCHES[@]}"; do
    echo "applying $(basename "$p") to llama.cpp"
    patch -p1 -s -d "$STAGE/third_party/llama.cpp" < "$p" || die "$(basename "$p") does not apply to $LLAMA_SRC"
done
for p in "${PEER_PATCHES[@]}"; do
    echo "applying $(basename "$p") to the peer"
    patch -p1 -s -d "$STAGE" < "$p" || die "$(basename "$p") does not apply to $PEER_SRC"
done

# stage -> tree, copying only files whose content changed (keeps make's timestamps for the rest)
mkdir -p "$TREE"
(cd "$STAGE" && find . -type f) | while IFS= read -r f; do
    if ! cmp -s "$STAGE/$f" "$TREE/$f" 2>/dev/null; then
        mkdir -p "$(dirname "$TREE/$f")"
        cp -p "$STAGE/$f" "$TREE/$f"
    fi
done
(cd "$TREE" && find . -type f) | while IFS= read -r f; do [ -e "$STAGE/$f" ] || rm -f "$TREE/$f"; done
rm -rf "$STAGE"

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
[ -f "$BUILD_DIR/build/CMakeCache.txt" ] && GEN=()  # keep the generator of an existing build
nice -n 10 cmake -S "$TREE" -B "$BUILD_DIR/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBMOE_BUILD_TESTS=OFF -DBMOE_BUILD_CLI=ON -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_LLAMAFILE=ON -DGGML_CPU_REPACK=ON \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_TOOLS=OFF \
    >"$BUILD_DIR/cmake-configure.log" 2>&1 || { tail -30 "$BUILD_DIR/cmake-configure.log" >&2; die "cmake configure failed (log: $BUILD_DIR/cmake-configure.log)"; }
grep -q 'expert-ready hook present' "$BUILD_DIR/cmake-configure.log" \
    || echo "warning: the peer's CMake did not find the expert-ready hook (--overlap unavailable)" >&2
nice -n 10 cmake --build "$BUILD_DIR/build" --target bmoe-cli -j "$JOBS" || die "build failed"
BIN="$BUILD_DIR/build/cli/bmoe-cli"
[ -x "$BIN" ] || die "build finished but $BIN is missing"
"$BIN" --version >/dev/null || die "$BIN does not run"
echo "$BIN"
