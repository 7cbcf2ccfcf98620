"""pytest set-up: make the helper modules in tests/ importable; fixtures shared by modules.

``megatron``: torch.distributed and megatron's parallel state of one process (TP=1, PP=1), for
modules that build models outside ``tests/distributed.py``'s ranks; use it with
``pytest.mark.usefixtures("megatron")``.  ``tokenizer``: the character tokenizer of
``decoding_fixtures`` (96 tokens, the tiny models' vocabulary).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def megatron():
    from lime_megatron.parallel.process_groups import initialize_parallel

    initialize_parallel()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from decoding_fixtures import char_tokenizer

    return char_tokenizer(tmp_path_factory.mktemp("tokenizer"))
