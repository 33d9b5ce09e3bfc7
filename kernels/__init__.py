X='kernels'
