X='kernels/triton'
