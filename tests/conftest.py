"""pytest set-up: make the helper modules in tests/ importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
