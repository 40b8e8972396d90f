#!/usr/bin/env bash
# Transformer Engine 2.20.2 for JAX, for a GPU node without internet or the NGC image:
#   tools/te_offline/build.sh [OUT]        (default build/te; on any x86-64 Linux with pip access, no GPU)
# OUT gets the wheels `tools/te_offline/install.sh` installs (~36 MB, under the 64 MiB one transfer takes):
#   transformer_engine         the Python package (PyPI wheel)
#   transformer_engine_cu13    the core library, pruned to sm_90 (PyPI: 276 MB, eight SM generations, no PTX)
#   transformer_engine_jax     the JAX extension, built here from PyPI's sdist (24 C++ files, no nvcc)
#   pydantic & co.             TE imports pydantic; the image has none
# The extension is compiled against the headers of exactly the node's run-time libraries (IMAGE_* below):
# built against cuDNN 9.28 headers, cudnn-frontend calls cudnnGetExecutionPlanWorkspaceSize (cuDNN >= 9.23)
# and the import fails on the image's 9.19. ~6 min on 2 cores; the build venv takes 3.3 GB under OUT/work.
set -euo pipefail
TE=2.20.2
IMAGE_CUDNN=9.19.0.56 IMAGE_CUBLAS=13.1.0.3 IMAGE_CUDART=13.0.96   # the GPU image's pip CUDA libraries
CUDA_HEADERS=(nvidia-cuda-crt==13.0.88 nvidia-cuda-nvrtc==13.0.88 nvidia-nvtx==13.0.85 nvidia-cuda-cccl==13.0.85
              nvidia-nvml-dev==13.0.87 nvidia-nccl-cu13 nvidia-cudnn-frontend==1.32.0)
ARCH=90
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$(mkdir -p "${1:-build/te}" && cd "${1:-build/te}" && pwd)"
work="$out/work"
py=
for candidate in ${MAXTEXT_MOE_PYTHON:-} python3.12 ~/.pyenv/versions/3.12*/bin/python; do  # the first that runs 3.12
  if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py=$candidate; break; fi
done
[ -n "$py" ] || { echo "te_offline: needs Python 3.12 (set MAXTEXT_MOE_PYTHON)" >&2; exit 2; }
mkdir -p "$work/src" "$work/dist"
cd "$work"
"$py" -m pip download -q --no-deps -d . "transformer-engine==$TE" "transformer-engine-cu13==$TE" "transformer-engine-jax==$TE"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  -d "$out" pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0

# 1) the JAX extension, against the node's library versions
[ -x venv/bin/pip ] || "$py" -m venv venv
venv/bin/pip install -q setuptools wheel pybind11 packaging "jax==0.11.2" "jaxlib==0.11.2" "${CUDA_HEADERS[@]}" \
  "nvidia-cudnn-cu13==$IMAGE_CUDNN" "nvidia-cublas==$IMAGE_CUBLAS" "nvidia-cuda-runtime==$IMAGE_CUDART"
rm -rf "src/transformer_engine_jax-$TE" && tar xzf "transformer_engine_jax-$TE.tar.gz" -C src
# Two edits to its setup.py: the CUDA major comes from jax's CUDA plugin (absent on a CPU host: take NVTE_CUDA_MAJOR),
# and the 24 files compile in parallel.
"$py" - "src/transformer_engine_jax-$TE/setup.py" <<'PY'
import sys
p = sys.argv[1]; s = open(p).read()
a = "    assert (\n        jax._src.lib.cuda_versions is not None\n"
b = "from pybind11.setup_helpers import build_ext as BuildExtension\n"
assert a in s and b in s, "transformer_engine_jax's setup.py changed: re-read it"
s = s.replace(a, '    if os.getenv("NVTE_CUDA_MAJOR"):\n        return int(os.environ["NVTE_CUDA_MAJOR"])\n' + a, 1)
s = s.replace(b, b + 'from pybind11.setup_helpers import ParallelCompile\nParallelCompile("NVTE_BUILD_MAX_JOBS", default=0).install()\n', 1)
open(p, "w").write(s)
PY
(cd src && env NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_NO_LOCAL_VERSION=1 NVTE_CUDA_ARCHS=$ARCH NVTE_CUDA_MAJOR=13 \
   NVTE_FRAMEWORK=jax NVTE_BUILD_MAX_JOBS="$(nproc)" \
   "$work/venv/bin/pip" wheel -q --no-build-isolation --no-deps -w "$work/dist" "./transformer_engine_jax-$TE")
cp "$work"/dist/transformer_engine_jax-$TE-*.whl "transformer_engine-$TE-py3-none-any.whl" "$out/"

# 2) the core library with sm_$ARCH code only, repacked (RECORD regenerated)
core="transformer_engine_cu13-$TE-py3-none-manylinux_2_28_x86_64.whl"
rm -rf core && mkdir core && (cd core && unzip -q "../$core")
for lib in libtransformer_engine.so libnccl_ep.so; do
  "$py" "$here/prune_fatbin.py" "core/transformer_engine/wheel_lib/$lib" "core/transformer_engine/wheel_lib/$lib" $ARCH
done
"$py" "$here/repack_wheel.py" core "$out/$core"
du -sh "$out"/*.whl
