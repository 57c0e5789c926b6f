"""Quantised weights for CUDA and the CPU: what a checkpoint's quantisation means, and the products over it.

`schemes.py` defines each scheme once, in the form every loader produces and every kernel consumes (a format's
own tensors are read into these, exactly); `compressed_tensors.py` reads a checkpoint's `quantization_config`;
`linear.py` is the module that holds a quantised weight; `int4_kernels.py`, `int8_kernels.py` and
`fp8_kernels.py` are the products (Triton / torch on CUDA, references elsewhere), `grouped_kernels.py` their
grouped forms over MoE experts (rows sorted by expert), `launch.py` where they run, how grids split K and how
grouped grids map tiles to experts. Below `models/`, above the small leaves.
"""
