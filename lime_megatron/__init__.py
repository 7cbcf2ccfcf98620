"""lime-megatron: LIMe (Layer-Integrated Memory) transformers on megatron-core."""
