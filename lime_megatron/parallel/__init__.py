"""Parallelism around megatron-core: process groups, the pipeline side channel that carries the
layer-integrated memory across stages, the CPU/gloo compatibility layer (with the registry of the
private APIs it touches) and the choice of fused kernels."""
