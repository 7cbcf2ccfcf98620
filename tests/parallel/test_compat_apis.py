"""The private megatron-core / torch APIs the project relies on (listed in ``lime_megatron.parallel.compat``'s
docstring) have the signatures and behaviour the code expects under the installed versions; a
difference fails with the API's name."""

from __future__ import annotations

import pytest

from lime_megatron.parallel import compat

LISTED = (  # every private/internal API the code touches, as the docstring names it
    "micro-batch order", "``context`` threading", "TransformerBlock._checkpointed_forward",
    "SelfAttention._checkpointed_attention_forward", "SelfAttention.get_query_key_value_tensors",
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK", "get_schedule_table", "deallocate_output_tensor",
    "_top_saved_tensors_default_hooks", "_get_cuda_rng_state", "_build_model_and_main_param_groups",
    "_set_main_param_and_optimizer_states", "setup_embeddings_and_output_layer", "fused_apply_rotary_pos_emb",
)


@pytest.mark.parametrize("patched", [False, True], ids=["as-installed", "after-enable_cpu_support"])
def test_private_apis_hold(patched):
    if patched:
        compat.enable_cpu_support()
    assert compat.private_api_problems() == []


def test_every_private_api_is_listed_in_compat():
    assert all(name in compat.__doc__ for name in LISTED), [name for name in LISTED if name not in compat.__doc__]


def test_a_changed_signature_names_the_api():
    def communicate(self, *, tensor_send_next, recv_prev, tensor_shape, recv_next=False):
        pass

    problem = compat.missing_parameters("schedules.function", communicate, "tensor_send_next",
                                        "tensor_send_prev", "recv_prev", keyword_only=True)
    assert problem.startswith("schedules.function:") and "tensor_send_prev" in problem

    def positional(self, recv_prev, recv_next):
        pass

    problem = compat.missing_parameters("schedules.function", positional, "recv_prev", keyword_only=True)
    assert "not keyword-only: ['recv_prev']" in problem
    assert compat.missing_parameters("x", communicate, "recv_next", keyword_only=True) is None
