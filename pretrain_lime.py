#!/usr/bin/env python
"""``lime_megatron.cli.pretrain`` (installed as ``lime-pretrain``), run by its path: ``torchrun pretrain_lime.py``."""

import sys

from lime_megatron.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
