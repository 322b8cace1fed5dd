import sys
from pathlib import Path

# Shared test helpers (tiny configs, the HF oracle) live in tests/models.
sys.path.insert(0, str(Path(__file__).parent / "models"))
