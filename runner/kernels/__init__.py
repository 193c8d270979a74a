"""Native CPU kernels MLX lacks, built from C source with the system compiler on first use."""
