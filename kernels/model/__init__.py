X='kernels/model'
