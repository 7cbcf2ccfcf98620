#!/usr/bin/env python
"""``lime_megatron.cli.evaluate``, the ``lime-evaluate`` command, run by its path."""

import sys

from lime_megatron.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
