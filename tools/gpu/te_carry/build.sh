#!/usr/bin/env bash
# TransformerEngine's PyTorch API for ONE Hopper GPU (sm_90/sm_90a), torch 2.11.0+cu130, CPython
# 3.12, x86_64, as wheels of about 32 MiB -- built on a CPU-only machine (about 5 minutes of
# compiling on 2 idle cores with the precompiled header, up to 40 without).
#
#   bash tools/gpu/te_carry/build.sh OUT_DIR      (OUT_DIR/wheels/*.whl)
#
# tools/gpu/prepare.py --build-te runs it and takes the wheels into the carry; prepare.py --check
# installs that carry into a clean Python 3.12 venv with torch 2.11.0+cu130 and imports
# transformer_engine.pytorch and megatron.core there, as far as a machine without a GPU can.
#
# What it does (all big files under $TE_CARRY_WORK, default /tmp/te_carry; re-runs reuse them):
#  1. a build venv (CPython 3.12): torch==2.11.0 (the +cu130 build) with its CUDA 13.0 wheels,
#     plus nvcc/crt/cccl/nvvm of cuda-toolkit 13.0.2 (headers; nvcc only for version checks);
#  2. downloads transformer-engine, transformer-engine-cu13 (wheels) and transformer-engine-torch
#     (sdist) $TE_VERSION, and pydantic + its deps (TE's recipes import pydantic; the image lacks it);
#  3. compiles transformer-engine-torch (a CppExtension: g++ only, no device code) against that
#     torch into a cp312 wheel;
#  4. repacks transformer-engine and transformer-engine-cu13 (same version, build tag "1sm$KEEP_SM"):
#     without transformer_engine/jax/; in libtransformer_engine.so and libnccl_ep.so every fatbin
#     keeps only its sm_$KEEP_SM cubins (sm_90 and sm_90a), the rest is zero-filled in place (no ELF
#     layout change), and the libraries are stripped;
#  5. writes OUT_DIR/wheels and checks them: size <= $MAX_MIB MiB, cubin archs (cuobjdump), NEEDED
#     libraries, the extension's torch ABI.
set -euo pipefail

OUT=${1:?usage: bash build.sh OUT_DIR}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK=${TE_CARRY_WORK:-/tmp/te_carry}
PY312=${PY312:-$HOME/.pyenv/versions/3.12.1/bin/python}
TE_VERSION=${TE_VERSION:-2.20.2}
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
CUDA_TOOLKIT=${CUDA_TOOLKIT:-13.0.2}       # torch 2.11.0+cu130 pins cuda-toolkit[...]==13.0.2
KEEP_SM=${KEEP_SM:-90}
MAX_MIB=${MAX_MIB:-60}
JOBS=${MAX_JOBS:-$(nproc)}
PLAT=(--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

log() { printf '\n=== %s  %s\n' "$(date +%H:%M:%S)" "$*"; }
mkdir -p "$WORK"/dl "$WORK"/deps
"$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
    || { echo "PY312 must be a CPython 3.12 (set PY312=...)"; exit 1; }

# ---------------------------------------------------------------- 1. build venv
BENV=${TE_CARRY_BUILDENV:-$WORK/buildenv}
if [ ! -f "$BENV/.ready" ]; then
    log "build venv $BENV (torch $TORCH_VERSION + CUDA $CUDA_TOOLKIT wheels, several GB)"
    rm -rf "$BENV"
    "$PY312" -m venv "$BENV"
    "$BENV/bin/pip" install -q "torch==$TORCH_VERSION" \
        "cuda-toolkit[nvcc,crt,cccl,nvvm,cudart,cublas,nvrtc,nvtx]==$CUDA_TOOLKIT" \
        "setuptools<82" wheel ninja packaging nvidia-cuda-cuobjdump
    "$BENV/bin/python" - <<EOF
import torch
assert torch.__version__ == "$TORCH_VERSION+cu130", torch.__version__
assert torch._C._GLIBCXX_USE_CXX11_ABI
EOF
    touch "$BENV/.ready"
fi
BPY=$BENV/bin/python
NV=$("$BPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia
CUOBJDUMP=$NV/cu13/bin/cuobjdump

# ---------------------------------------------------------------- 2. downloads
log "downloads (TE $TE_VERSION wheels + sdist, pydantic)"
cd "$WORK/dl"
META_WHL=transformer_engine-$TE_VERSION-py3-none-any.whl
CORE_WHL=transformer_engine_cu13-$TE_VERSION-py3-none-manylinux_2_28_x86_64.whl
SDIST=transformer_engine_torch-$TE_VERSION.tar.gz
[ -f "$META_WHL" ] && [ -f "$CORE_WHL" ] || "$BENV/bin/pip" download -q --no-deps "${PLAT[@]}" \
    "transformer-engine==$TE_VERSION" "transformer-engine-cu13==$TE_VERSION" -d .
# the sdist's metadata step imports torch: hence the build venv and --no-build-isolation
[ -f "$SDIST" ] || "$BENV/bin/pip" download -q --no-deps --no-binary=:all: --no-build-isolation \
    "transformer-engine-torch==$TE_VERSION" -d .
ls "$META_WHL" "$CORE_WHL" "$SDIST" > /dev/null
cd "$WORK/deps"
ls pydantic-*.whl > /dev/null 2>&1 || "$BENV/bin/pip" download -q "${PLAT[@]}" pydantic -d .

# ---------------------------------------------------------------- 3. transformer-engine-torch
EXT_DIST=$WORK/extdist
if ! ls "$EXT_DIST"/transformer_engine_torch-"$TE_VERSION"-cp312-cp312-*.whl > /dev/null 2>&1; then
    log "compile transformer-engine-torch $TE_VERSION ($JOBS jobs; ~33 C++ files against torch headers)"
    # an interrupted build resumes (ninja keeps its objects); a finished one removed its sources
    mkdir -p "$EXT_DIST"
    if [ ! -d "$WORK/extsrc/transformer_engine_torch-$TE_VERSION/common_headers" ]; then
        rm -rf "$WORK/extsrc" "$WORK/pch" && mkdir -p "$WORK/extsrc"
        tar xzf "$WORK/dl/$SDIST" -C "$WORK/extsrc"
    fi
    cd "$WORK/extsrc/transformer_engine_torch-$TE_VERSION"
    # FORCE_BUILD: never try setup.py's prebuilt-wheel download; USE_NVIDIA_WHEELS: take the
    # headers (cuda, cudnn.h, nccl.h, cublasLt.h) from the build venv's nvidia-* packages.
    # NVTE_CUDA_ARCHS only decides NCCL-EP support here (>= 90: on, as in the released wheels).
    # TE_PCH=1 (default): CXX=pch_cxx.sh, a precompiled header of csrc/extensions.h (see there);
    # it cuts the compile several-fold.  TE_PCH=0 builds exactly as pip would.
    pch=()
    if [ "${TE_PCH:-1}" = 1 ]; then
        pch=(CXX="$HERE/pch_cxx.sh" PCH_DIR="$WORK/pch" PCH_HEADER="$PWD/csrc/extensions.h")
    fi
    start=$(date +%s)
    env PATH="$BENV/bin:$PATH" NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_BUILD_USE_NVIDIA_WHEELS=1 \
        NVTE_CUDA_ARCHS="$KEEP_SM" MAX_JOBS="$JOBS" "${pch[@]}" \
        "$BPY" setup.py bdist_wheel -d "$EXT_DIST" > "$WORK/ext_build.log" 2>&1 \
        || { tail -40 "$WORK/ext_build.log"; exit 1; }
    rm -rf "$WORK/pch"
    echo "compiled in $(( $(date +%s) - start )) s (log: $WORK/ext_build.log)"
fi
EXT_WHL=$(ls "$EXT_DIST"/transformer_engine_torch-"$TE_VERSION"-cp312-cp312-*.whl)

# ---------------------------------------------------------------- 4. repack the TE wheels
# Both lose transformer_engine/jax/ (else `import transformer_engine` imports the image's jax and
# warns that TE's jax extension is missing); the core wheel's libraries keep sm_$KEEP_SM only.
NEW_META=transformer_engine-$TE_VERSION-1sm$KEEP_SM-py3-none-any.whl
NEW_CORE=transformer_engine_cu13-$TE_VERSION-1sm$KEEP_SM-py3-none-manylinux_2_28_x86_64.whl
repack() {  # SRC_WHEEL NEW_NAME
    local d=$WORK/pk/${2%%-*}
    rm -rf "$d" && mkdir -p "$d" && cd "$d"
    "$BPY" -m zipfile -e "$WORK/dl/$1" .
    rm -rf transformer_engine/jax
    for so in transformer_engine/wheel_lib/*.so; do
        [ -f "$so" ] || continue
        "$BPY" "$HERE/fatbin.py" prune "$so" "$so.new" --keep "sm_$KEEP_SM"
        strip --strip-unneeded "$so.new"
        chmod 755 "$so.new" && mv "$so.new" "$so"
    done
    find . -name '*.so' -exec chmod 755 {} +
    "$BPY" "$HERE/repack_wheel.py" . "$WORK/repacked" "$2"
}
if [ ! -f "$WORK/repacked/$NEW_CORE" ] || [ ! -f "$WORK/repacked/$NEW_META" ]; then
    log "repack $META_WHL and $CORE_WHL (no jax/; sm_$KEEP_SM cubins only, stripped)"
    rm -rf "$WORK/repacked" && mkdir -p "$WORK/repacked"
    repack "$META_WHL" "$NEW_META"
    repack "$CORE_WHL" "$NEW_CORE"
    rm -rf "$WORK/pk"
fi

# ---------------------------------------------------------------- 5. assemble OUT
log "assemble $OUT"
rm -rf "$OUT" && mkdir -p "$OUT/wheels"
cp "$WORK/repacked/$NEW_META" "$WORK/repacked/$NEW_CORE" "$EXT_WHL" "$WORK"/deps/*.whl "$OUT/wheels/"
du -ab "$OUT" | sort -n | tail -12 | awk '{printf "%8.2f MiB  %s\n", $1/2^20, $2}'
total=$(du -sb "$OUT" | cut -f1)
[ "$total" -le $((MAX_MIB * 1024 * 1024)) ] || { echo "FAIL: $OUT is over $MAX_MIB MiB"; exit 1; }

# ---------------------------------------------------------------- 6. checks
log "checks"
chk=$WORK/check && rm -rf "$chk" && mkdir -p "$chk"
cd "$chk" && for w in "$OUT"/wheels/transformer_engine*.whl; do "$BPY" -m zipfile -e "$w" .; done
LIB=$chk/transformer_engine/wheel_lib/libtransformer_engine.so
EXT=$(ls "$chk"/transformer_engine/wheel_lib/transformer_engine_torch*.so)
echo "-- cubins per arch in libtransformer_engine.so (cuobjdump --list-elf / --list-ptx):"
elfs=$("$CUOBJDUMP" --list-elf "$LIB" | grep -oE 'sm_[0-9]+[af]?')
sort <<< "$elfs" | uniq -c
ptx=$("$CUOBJDUMP" --list-ptx "$LIB" 2>/dev/null | grep -c ptx || true); echo "   ptx entries: $ptx"
bad=$(grep -cvE "^sm_${KEEP_SM}a?$" <<< "$elfs" || true)
[ "$bad" -eq 0 ] || { echo "FAIL: cubins for other archs remain"; exit 1; }
"$CUOBJDUMP" --list-elf "$chk/transformer_engine/wheel_lib/libnccl_ep.so" | grep -oE 'sm_[0-9]+[af]?' | sort | uniq -c
echo "-- NEEDED (must come from the image: torch's nvidia-* wheels, glibc, libstdc++):"
for f in "$LIB" "$chk/transformer_engine/wheel_lib/libnccl_ep.so" "$EXT"; do
    echo "   $(basename "$f"): $(readelf -dW "$f" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
done
echo "-- highest symbol versions needed by the extension:"
readelf -VW "$EXT" | grep -oE '(GLIBC|GLIBCXX|CXXABI)_[0-9.]+' | sort -uV | awk -F_ '{v[$1]=$0} END {for (k in v) print "   " v[k]}'
echo "-- extension ABI vs torch $TORCH_VERSION:"
"$BPY" - "$EXT" <<'EOF'
import subprocess, sys, torch
ext = sys.argv[1]
dyn = subprocess.run(["nm", "-D", "--defined-only", ext], capture_output=True, text=True).stdout
assert " PyInit_transformer_engine_torch" in dyn, "no PyInit_transformer_engine_torch"
und = subprocess.run(["nm", "-D", "--undefined-only", ext], capture_output=True, text=True).stdout
cxx11 = sum("__cxx11" in l for l in und)
print(f"   PyInit_transformer_engine_torch exported; {cxx11} undefined symbols use the C++11 string ABI "
      f"(torch._C._GLIBCXX_USE_CXX11_ABI={torch._C._GLIBCXX_USE_CXX11_ABI})")
strings = subprocess.run(["strings", ext], capture_output=True, text=True).stdout
print("   TORCH_EXTENSION_NAME=transformer_engine_torch:", "transformer_engine_torch" in strings)
EOF

log "done: $OUT ($(du -sh "$OUT" | cut -f1))"
