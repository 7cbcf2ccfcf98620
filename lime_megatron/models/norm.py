"""A plain-PyTorch RMSNorm/LayerNorm for megatron layer specs that also works under sequence
parallelism.

megatron's ``WrappedTorchNorm`` (the norm of the local, non-Transformer-Engine specs) asserts
``not config.sequence_parallel``. :class:`TorchNorm` is built the same way
(``TorchNorm(config=..., hidden_size=..., eps=...)``) and, when ``config.sequence_parallel``, marks
its parameters ``sequence_parallel`` so that megatron's ``finalize_model_grads`` all-reduces their
gradients over the tensor-parallel group. It is meant for CPU runs; GPU runs use the Transformer
Engine norm of the TE specs.
"""

import torch
import torch.nn.functional as F

__all__ = ["TorchNorm"]


class TorchNorm(torch.nn.Module):
    """RMSNorm or LayerNorm (``config.normalization``) over the last dimension."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"TorchNorm supports RMSNorm and LayerNorm, not {config.normalization!r}")
        if config.layernorm_zero_centered_gamma:
            raise ValueError("TorchNorm does not support layernorm_zero_centered_gamma")
        self.normalization = config.normalization
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Normalise ``hidden_states`` over its last dimension."""
        shape = (hidden_states.shape[-1],)
        if self.normalization == "RMSNorm":
            return F.rms_norm(hidden_states, shape, self.weight, self.eps)
        return F.layer_norm(hidden_states, shape, self.weight, self.bias, self.eps)
