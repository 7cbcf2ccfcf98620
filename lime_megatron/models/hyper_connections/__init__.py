"""Hyper-Connections (Zhu et al. 2024), the paper's second baseline, as the official code has it
(corl-team/lime ``src/lm/hc.py``, ``model_type: hc``): ``connection`` (one hyper-connection and
its parameter-free norm), ``layer`` (megatron's ``TransformerLayer`` with n residual streams) and
``spec`` (the layer spec derived from megatron's LLaMA spec)."""
