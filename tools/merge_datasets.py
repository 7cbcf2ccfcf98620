#!/usr/bin/env python
"""``lime_megatron.cli.merge_datasets``, the ``lime-merge-datasets`` command, run by its path."""

import sys

from lime_megatron.cli.merge_datasets import main

if __name__ == "__main__":
    sys.exit(main())
