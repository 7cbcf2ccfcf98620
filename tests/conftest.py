"""Fixtures shared by modules.

Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``) for every test, and every replayed
routing launch is verified against a build (``LIME_VERIFY_LAUNCH_PLANS=1``,
``kernels.launch_plans``).

``megatron``: torch.distributed and megatron's parallel state of one process (TP=1, PP=1), for
modules that build models outside ``lime_megatron.testing.distributed``'s ranks; use it with
``pytest.mark.usefixtures("megatron")``.  ``tokenizer``: the character tokenizer of
``tests.decoding_fixtures`` (96 tokens, the tiny models' vocabulary).

What collecting imported (torch, megatron-core, every test module) is frozen out of the cyclic
collector's sight once collection ends (``gc.freeze``), as each spawned rank freezes what its fork
server imported (``lime_megatron.testing.distributed``).
"""

import gc
import os

import pytest

# Triton's CPU interpreter runs the routing kernels on CPU tensors; it is chosen when triton is
# imported, so before any test imports it (spawned ranks inherit it).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Every replayed routing launch is checked against a build of it (``kernels.launch_plans``).
os.environ.setdefault("LIME_VERIFY_LAUNCH_PLANS", "1")


@pytest.fixture(scope="module")
def megatron():
    from lime_megatron.parallel.process_groups import initialize_parallel

    initialize_parallel()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tests.decoding_fixtures import char_tokenizer

    return char_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def pytest_collection_finish(session):
    """Freeze what collection left alive: the trainer's ``destroy_parallel`` collects after every
    in-process run (``gc.collect()``: 0.5 s a run over the whole heap on the 2-core VM), and
    Python's own full collections walk it too; frozen, they walk only what the tests made
    (training, interop, analysis and model tests, one process: 251-256 -> 162-172 s).  Frozen
    objects are still freed by reference counting."""
    gc.collect()
    gc.freeze()
