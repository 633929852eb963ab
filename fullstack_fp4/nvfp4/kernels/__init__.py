"""The NVFP4 Triton kernels, one module per concept (the pure-PyTorch oracle is ``nvfp4.reference``):

* ``fp4_math`` — the ``@triton.jit`` arithmetic every kernel shares (E4M3 / E2M1 rounding,
  decode of codes, RHT-16 butterflies, Philox draws of the stochastic rounding);
* ``amax`` — the amax passes every tensor scale comes from;
* ``quantize`` — ``quantize_triton``, ``amax_triton``: one tensor to NVFP4 (tiled and flat
  kernels);
* ``quantize_two_ways`` — the NVFP4 linear's operands: one read of ``m [T, C]`` gives its row
  way and its RHT column way, as codes and/or decoded BF16;
* ``decode`` — NVFP4 codes back to FP32 / BF16 / FP16, and the decoded GEMM operands;
* ``gemm_epilogue`` — the two-pass GEMM's scale-and-cast / scale-and-accumulate pass;
* ``cublaslt`` — the emulated GEMM as one cuBLASLt call with the scales read on the device;
* ``launch`` — the lean launcher every Triton launch of the recipes goes through.

Importing this package loads none of them and needs no Triton; the kernel modules import Triton
(``cublaslt`` and ``launch`` run without it), and ``nvfp4.quantize`` and ``nvfp4.gemm`` import
them lazily.
"""
