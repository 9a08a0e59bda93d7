"""Hot-path kernels: each a Triton kernel with a plain PyTorch reference, chosen by one switch."""
