"""Print C++ for the flash-attn 2.x kernels build.sh does not build: flash_api.cpp dispatches over every
dtype and head dim (and compiles its backward dispatch even with backward disabled), so each missing
instantiation gets a body that raises a clear error instead."""
BUILT = {("cutlass::bfloat16_t", 64), ("cutlass::bfloat16_t", 128)}
DTYPES = ("cutlass::half_t", "cutlass::bfloat16_t")
HEAD_DIMS = (32, 64, 96, 128, 192, 256)  # static_switch.h HEADDIM_SWITCH


def stub(fn: str, params: str, template_args: str, message: str) -> str:
    return (f"template<> void {fn}<{template_args}>({params} &, cudaStream_t) "
            f'{{ throw std::runtime_error("{message}"); }}')


def main() -> None:
    print('#include <cuda_runtime.h>\n#include <cutlass/numeric_types.h>\n#include "namespace_config.h"\n#include "flash.h"\n#include <stdexcept>\n'
          "namespace FLASH_NAMESPACE {")
    for dtype in DTYPES:
        for hdim in HEAD_DIMS:
            for causal in ("false", "true"):
                args = f"{dtype}, {hdim}, {causal}"
                print(stub("run_mha_bwd_", "Flash_bwd_params", args, "this flash-attn build has no backward pass"))
                if (dtype, hdim) in BUILT:
                    continue
                message = f"this flash-attn build has bfloat16 head dims 64 and 128 only, not {dtype} {hdim}"
                for fn in ("run_mha_fwd_", "run_mha_fwd_splitkv_dispatch"):
                    print(stub(fn, "Flash_fwd_params", args, message))
    print("}  // namespace FLASH_NAMESPACE")


if __name__ == "__main__":
    main()
