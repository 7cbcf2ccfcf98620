#!/usr/bin/env python
"""``lime_megatron.cli.generate``, the ``lime-generate`` command, run by its path."""

import sys

from lime_megatron.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
