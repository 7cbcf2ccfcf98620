#!/usr/bin/env python
"""``lime_megatron.cli.make_prosqa_data``, the ``lime-make-prosqa-data`` command, run by its path."""

import sys

from lime_megatron.cli.make_prosqa_data import main

if __name__ == "__main__":
    sys.exit(main())
