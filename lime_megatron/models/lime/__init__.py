"""The LIMe method (paper §4): the router R^(l), the layer-integrated memory, the attention that
attends with routed keys/values, the recompute of dropped routed K/V, and key/value head sharding
under tensor parallelism."""
