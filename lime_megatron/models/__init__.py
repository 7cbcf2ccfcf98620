"""Model families as megatron-core layer specs: the config, the specs, the GPT model that carries
LIMe's memory through the decoder, layout-invariant initialisation and norms.

The LIMe method itself (router, layer-integrated memory, routed attention, recompute of routed
K/V, tensor-parallel head sharding) is the ``lime`` subpackage.
"""
