"""Paged-attention kernels (Triton) and their torch references."""
