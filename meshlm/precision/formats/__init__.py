"""Low-precision number formats and their quantizers, emulated exactly in PyTorch.

Each quantizer rounds a tensor to the exact values of a format and returns them dequantized, in
the input's dtype, together with the raw codes and scales; a GEMM on the dequantized tensors in
the run's dtype then computes what a low-precision GEMM computes, up to its accumulation order.
Inputs may be any float dtype; all arithmetic is fp32. One file per job:

- ``fp8.py``: E4M3 / E5M2 with one scale, amax -> scale (optionally a power of two), current
  per-tensor scaling and delayed scaling from an amax history (``AmaxHistory``);
- ``blocks.py``: cutting a tensor into 1 x n tiles or n x m blocks and back (ragged last blocks);
- ``blockwise.py``: DeepSeek-V3 FP8, one fp32 scale per 1 x 128 tile or 128 x 128 block;
- ``mxfp8.py``: MXFP8, one E8M0 power-of-two scale per 32 elements;
- ``e2m1.py``: the 4-bit E2M1 element, round-to-nearest-even and stochastic rounding;
- ``nvfp4.py``: NVFP4, E2M1 in 1 x 16 or 16 x 16 blocks with E4M3 block scales and an fp32
  tensor scale;
- ``hadamard.py``: the 16 x 16 random Hadamard transform for the weight-gradient GEMM;
- ``hashed_noise.py``: stochastic-rounding noise hashed from the rounded values (layout-free).

The training recipes that use them are ``meshlm/precision/recipes.py``.
"""
