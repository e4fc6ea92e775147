import os
import sys
from pathlib import Path

# tests/helpers is importable as `helpers` from every test module.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
