"""The paged store: raw K/V tensors in one pool, attended by the paged kernels."""
