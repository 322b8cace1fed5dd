import os
import sys
from pathlib import Path

import torch

# Shared test helpers (tiny configs, the HF oracle) live in tests/models.
sys.path.insert(0, str(Path(__file__).parent / "models"))

# Without a GPU, Triton kernel tests run under Triton's interpreter. It must be chosen before
# anything imports Triton (torch.compile does, in other tests of the same worker): Triton's own
# library functions are decorated at import, and compiled ones cannot run inside the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
