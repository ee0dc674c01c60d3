#!/usr/bin/env bash
# Upstream flash-attn 2.x, forward only, bfloat16 head dims 64 and 128, for sm_90: enough to run the
# `flash-attn` backend on the H200 host, which has no wheel for its torch (2.11, cu130) and no network,
# and where `pip install flash-attn` builds every kernel from source for hours.
#
#   bash benchmarks/flash_attn2/build.sh kernels SDIST OUT   # here: nvcc the 8 kernel files (~2 min each)
#   bash benchmarks/flash_attn2/build.sh link OUT SITE       # on the GPU host: flash_api.cpp + link
#
# SDIST: flash_attn-2.8.3.tar.gz from PyPI. OUT: a folder to carry (.carry/fa2). SITE: where the
# `flash_attn` package and `flash_attn_2_cuda` land (put it on PYTHONPATH).
# The kernels use only header-level torch (a CUDA-error check), so they build against any torch's headers;
# flash_api.cpp is compiled against the host's own torch. Unbuilt dtypes and head dims raise at call time.
set -euo pipefail
mode=$1
FLAGS=(-O3 -std=c++17 --use_fast_math -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__
       -U__CUDA_NO_HALF2_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr
       --expt-extended-lambda -DFLASHATTENTION_DISABLE_BACKWARD -DFLASHATTENTION_DISABLE_DROPOUT
       -DFLASHATTENTION_DISABLE_ALIBI -DFLASHATTENTION_DISABLE_SOFTCAP -DFLASHATTENTION_DISABLE_UNEVEN_K
       -DFLASHATTENTION_DISABLE_LOCAL -diag-suppress 3306 -Xcompiler -fPIC)
KERNELS="flash_fwd_hdim64_bf16_sm80 flash_fwd_hdim64_bf16_causal_sm80 flash_fwd_hdim128_bf16_sm80
         flash_fwd_hdim128_bf16_causal_sm80 flash_fwd_split_hdim64_bf16_sm80
         flash_fwd_split_hdim64_bf16_causal_sm80 flash_fwd_split_hdim128_bf16_sm80
         flash_fwd_split_hdim128_bf16_causal_sm80"
torch_inc() { python3 -c "import torch.utils.cpp_extension as c; print(' '.join('-I'+p for p in c.include_paths()))"; }

if [ "$mode" = kernels ]; then
  sdist=$2; out=$3
  out=$(realpath -m "$out"); mkdir -p "$out/obj" "$out/shim/c10/cuda/impl"
  cp "$sdist" "$out/flash_attn.tar.gz"
  src=$(mktemp -d); tar xzf "$sdist" -C "$src" --strip-components=1
  # A CPU build of torch lacks this generated header; the kernels need nothing from it.
  echo '#pragma once' > "$out/shim/c10/cuda/impl/cuda_cmake_macros.h"
  cd "$src/csrc/flash_attn"
  for k in $KERNELS; do
    nvcc -c "src/$k.cu" -o "$out/obj/$k.o" "${FLAGS[@]}" -gencode arch=compute_90,code=sm_90 \
      -I. -Isrc -I../cutlass/include $(torch_inc) -I"$out/shim" &
    while [ "$(jobs -r | wc -l)" -ge "$(nproc)" ]; do sleep 1; done
  done
  wait
  ls -la "$out/obj"
elif [ "$mode" = link ]; then
  out=$(realpath "$2"); site=$(realpath -m "$3"); here=$(dirname "$(realpath "$0")")
  src=$(mktemp -d); tar xzf "$out/flash_attn.tar.gz" -C "$src" --strip-components=1
  python3 "$here/stubs.py" > "$src/stubs.cpp"
  ext=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  tlib=$(python3 -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
  pyinc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  cuda=$(dirname "$(dirname "$(command -v nvcc)")")
  cd "$src/csrc/flash_attn"
  g++ -O2 -std=c++17 -fPIC -shared -o "$site/flash_attn_2_cuda$ext" flash_api.cpp "$src/stubs.cpp" "$out"/obj/*.o \
    -DFLASHATTENTION_DISABLE_BACKWARD -DFLASHATTENTION_DISABLE_DROPOUT -DFLASHATTENTION_DISABLE_ALIBI \
    -DFLASHATTENTION_DISABLE_SOFTCAP -DFLASHATTENTION_DISABLE_UNEVEN_K -DFLASHATTENTION_DISABLE_LOCAL \
    -DTORCH_EXTENSION_NAME=flash_attn_2_cuda -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1 \
    -I. -Isrc -I../cutlass/include $(torch_inc) -I"$pyinc" -I"$cuda/include" \
    -L"$tlib" -L"$cuda/lib64" -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda -ltorch_cuda -lcudart \
    -Wl,-rpath,"$tlib"
  # Only once the extension links (flash_attn/__init__.py imports it, and flash-attn-4's flash_attn.cute
  # shares the package): beside cute, as pip lays the two out; the sdist's own (older) cute stays out.
  cp "$src"/flash_attn/{__init__.py,flash_attn_interface.py,bert_padding.py} "$site/flash_attn/"
  ls -la "$site/flash_attn" "$site"/flash_attn_2_cuda*
else
  echo "usage: build.sh kernels SDIST OUT | link OUT SITE" >&2; exit 2
fi
