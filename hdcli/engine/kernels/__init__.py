"""Kernels: the arithmetic under hd's own forward, and the measurements that choose among it.

    build.py      compiles csrc/*.cpp once per machine (torch.utils.cpp_extension), cached
    quants.py     a GGUF's blocks multiplied in their own bits (csrc/qmm.cpp); exact dequantization
    dense.py      oneDNN-packed dense Linear layers; the --kernels values
    fused.py      the M-invariant attention as one compiled function (csrc/attend.cpp)
    invariant.py  the M-invariant attention in torch ops, per-shape row calibration, and which of
                  the two attentions this process runs (decide, pinned, require)

Nothing here knows a model family or the decode loop: kernels take tensors and shapes.
"""
