"""The FP8 and MLA kernels (and the decode kernel, which reads FP8 pages too) compile for an H100/H200
(sm_90) with no GPU present.

The interpreter runs the kernels' semantics on the CPU but never lowers them; this compiles them
ahead of time through Triton's own pipeline (TTIR -> PTX -> ptxas, bundled with the wheel) in a
subprocess without TRITON_INTERPRET, so a construct only the GPU compiler rejects fails here too.
"""

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

SCRIPT = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.attention_fp8 import _attention_fp8_kernel
from kernels.store_fp8 import _store_kv_fp8_kernel
from kernels.mla import _mla_kernel, _store_latent_kernel
from kernels.decode import _decode_kernel

def build(fn, ptrs, consts, num_warps=4):
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in ("sm_scale", "scale", "softcap") else "i32")
           for n in fn.arg_names}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    assert kernel.asm["cubin"], fn.__name__

idx = dict(lut_ptr="*i32", cache_len_ptr="*i64", qsl_ptr="*i64")
for is_fp8, groups, block_m, block_h in ((True, 1, 1, 16), (True, 4, 16, 4), (False, 1, 1, 16)):
    build(_attention_fp8_kernel,
          dict(q_ptr="*bf16", out_ptr="*bf16", blocks_ptr="*fp8e4nv" if is_fp8 else "*bf16", scales_ptr="*fp32", **idx),
          dict(GROUP=4, BLOCK_H=block_h, BLOCK_M=block_m, HEAD_DIM=128, BLOCK_D=128, QUANT_GROUP=128 // groups,
               NUM_SCALE_GROUPS=groups, PAGE_SIZE=16, BLOCK_N=32, IS_FP8=is_fp8, USE_SOFTCAP=True,
               USE_WINDOW=True, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32"))
for bf16_scales in (False, True):
    build(_store_kv_fp8_kernel,
          dict(k_ptr="*bf16", v_ptr="*bf16", slot_ptr="*i64", blocks_ptr="*fp8e4nv",
               scales_ptr="*bf16" if bf16_scales else "*fp32"),
          dict(PAGE_SIZE=16, NUM_GROUPS=1, GROUP=128, BLOCK_NG=1, BLOCK_G=128, SCALE_BF16=bf16_scales))
build(_mla_kernel, dict(q_ptr="*bf16", out_ptr="*bf16", lat_ptr="*bf16", **idx),
      dict(NUM_Q_HEADS=16, BLOCK_H=16, BLOCK_M=1, RANK=512, BLOCK_R=512, ROPE=64, BLOCK_ROPE=64, PAGE_SIZE=32,
           BLOCK_N=32, USE_SOFTCAP=False, USE_WINDOW=True, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32"), num_warps=8)
build(_store_latent_kernel, dict(src_ptr="*bf16", slot_ptr="*i64", blocks_ptr="*bf16"),
      dict(PAGE_SIZE=32, HEAD_DIM=576, BLOCK_D=1024))
for is_fp8, groups, splits, as_f16 in ((True, 1, 1, False), (True, 4, 16, False), (True, 1, 1, True),
                                      (False, 1, 16, False)):
    build(_decode_kernel,
          dict(q_ptr="*bf16", blocks_ptr="*fp8e4nv" if is_fp8 else "*bf16", scales_ptr="*fp32", lut_ptr="*i32",
               cache_lengths_ptr="*i32", out_ptr="*bf16", lse_ptr="*fp32", part_o_ptr="*fp32", part_lse_ptr="*fp32"),
          dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, NUM_SPLITS=splits,
               USE_SOFTCAP=True, RETURN_LSE=True, DOT_PRECISION="tf32", UPCAST_DOT=False, IS_FP8=is_fp8,
               QUANT_GROUP=128 // groups, NUM_SCALE_GROUPS=groups, FP8_AS_F16=as_f16))
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the gpu-marked tests run the kernels")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "compiled"
