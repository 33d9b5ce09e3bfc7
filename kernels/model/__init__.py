"""Models built on zerokl.kernels."""
