#!/usr/bin/env python
"""``lime_megatron.cli.train_tokenizer``, the ``lime-train-tokenizer`` command, run by its path."""

import sys

from lime_megatron.cli.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
