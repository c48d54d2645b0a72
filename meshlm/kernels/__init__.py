"""Optional fast paths (Triton kernels on CUDA) behind the models' interfaces, each tested against
the PyTorch path it replaces (on CPU with Triton's interpreter, ``TRITON_INTERPRET=1``)."""
