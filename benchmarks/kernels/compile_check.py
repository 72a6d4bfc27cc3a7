"""`python -m benchmarks.kernels.compile_check`: compile every kernel for a Hopper GPU (sm_90) without one and
print what the compiler reports: registers, spills, shared memory, and whether the dots became
wgmma/mma instructions. Catches code that only the real compiler rejects (the interpreter is lenient).
"""

import argparse
import re
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.decode import _decode_kernel, _decode_reduce_kernel
from kernels.prefill import _prefill_kernel
from kernels.store import _store_kv_kernel


def _signature(fn: Any, types: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    """Every argument's type: pointers and floats as given, other runtime args i32, constexprs marked."""
    return {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}


def _report(name: str, fn: Any, types: dict[str, str], constexprs: dict[str, Any], **options: Any) -> str:
    signature = _signature(fn, types, constexprs)
    # As a launch on real tensors specializes them: 16-byte aligned pointers, strides divisible by 16.
    aligned = [
        i for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") or (n.startswith("stride_") and "lut" not in n)
    ]
    src = ASTSource(fn, signature, constexprs, {(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    ops = {
        op: len(re.findall(rf"\b{op}\b", ptx))
        for op in ("wgmma.mma_async", "mma.sync", "ld.global.v4", "cp.async.cg.shared.global")
    }
    text = f"{name:<40} shared {compiled.metadata.shared:>6} B  " + "  ".join(f"{k} {v}" for k, v in ops.items())
    ptxas_info = _ptxas_info(ptx)
    return text + (f"\n{'':<40} {ptxas_info}" if ptxas_info else "")


def _ptxas_info(ptx: str) -> str:
    """ptxas -v's summary (registers, spill stores/loads) from Triton's bundled ptxas."""
    import os
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia

    # Triton 3.9 emits PTX 9.x, which only its newer bundled ptxas (named for Blackwell) accepts.
    bin_dir = os.path.join(os.path.dirname(nvidia.__file__), "bin")
    path = next(p for p in (os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas")) if os.path.exists(p))
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = os.path.join(tmp, "k.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        arch = "sm_90a"
        out = subprocess.run(
            [path, "-v", f"--gpu-name={arch}", ptx_path, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
        )
    lines = [ln.split("info    : ")[-1] for ln in out.stderr.splitlines() if "registers" in ln or "spill" in ln]
    if out.returncode:
        lines.append(f"ptxas failed: {out.stderr.strip()[-300:]}")
    return " | ".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels.compile_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = parser.parse_args(argv)
    dt = args.dtype
    floats = {"scale": "fp32", "softcap": "fp32"}
    attn_ptrs = {"q_ptr": f"*{dt}", "blocks_ptr": f"*{dt}", "lut_ptr": "*i32", "cache_lengths_ptr": "*i32"}
    attn_ptrs |= {"out_ptr": f"*{dt}", "lse_ptr": "*fp32", "query_start_loc_ptr": "*i32"}
    dots = {"DOT_PRECISION": "ieee" if dt == "fp32" else "tf32", "UPCAST_DOT": False}
    for page, group, splits in ((16, 4, 1), (16, 4, 16), (128, 4, 1), (1, 8, 1)):
        constexprs: dict[str, Any] = {"GROUP": group, "HEAD_DIM": 128, "PAGE_SIZE": page, "BLOCK_G": 16, "BLOCK_D": 128}
        constexprs |= {"BLOCK_N": 64, "NUM_SPLITS": splits, "USE_SOFTCAP": True, "RETURN_LSE": True, **dots}
        types = attn_ptrs | floats | {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
        name = f"decode page {page} group {group} splits {splits}"
        print(_report(name, _decode_kernel, types, constexprs, num_warps=4, num_stages=3), flush=True)
    reduce_types = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{dt}", "lse_ptr": "*fp32"}
    reduce_consts = {"HEAD_DIM": 128, "BLOCK_D": 128, "NUM_SPLITS": 16, "RETURN_LSE": True}
    print(_report("decode reduce splits 16", _decode_reduce_kernel, reduce_types, reduce_consts, num_warps=4))
    for page, block_m in ((16, 128), (128, 128), (16, 64)):
        constexprs = {"GROUP": 4, "HEAD_DIM": 128, "PAGE_SIZE": page, "BLOCK_M": block_m, "BLOCK_Q": block_m // 4}
        constexprs |= {"BLOCK_D": 128, "BLOCK_N": 64, "BLOCK_B": 64, "USE_SOFTCAP": False, "RETURN_LSE": False}
        constexprs |= dots
        warps = 8 if block_m >= 128 else 4
        name = f"prefill page {page} block_m {block_m}"
        print(_report(name, _prefill_kernel, attn_ptrs | floats, constexprs, num_warps=warps, num_stages=2))
    store_types = {"k_ptr": "*fp32", "v_ptr": "*fp32", "slots_ptr": "*i64", "blocks_ptr": f"*{dt}"}
    store_consts = {"NUM_HEADS": 8, "HEAD_DIM": 128, "PAGE_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128}
    print(_report("store 8 heads x 128", _store_kv_kernel, store_types, store_consts, num_warps=4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
