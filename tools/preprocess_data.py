#!/usr/bin/env python
"""``lime_megatron.cli.preprocess_data``, the ``lime-preprocess-data`` command, run by its path."""

import sys

from lime_megatron.cli.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
