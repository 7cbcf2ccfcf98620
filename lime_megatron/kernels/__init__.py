"""Fused GPU kernels (Triton): LIMe's routing products (``routing_kernels``), their operands and
launches (``operands``), and which path a run takes (``routing_path``)."""
