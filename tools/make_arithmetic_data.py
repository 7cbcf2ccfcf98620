#!/usr/bin/env python
"""``lime_megatron.cli.make_arithmetic_data``, the ``lime-make-arithmetic-data`` command, run by its path."""

import sys

from lime_megatron.cli.make_arithmetic_data import main

if __name__ == "__main__":
    sys.exit(main())
