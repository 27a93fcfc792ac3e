import sys
from pathlib import Path

# Spawned ranks import test modules by name: make the tests folder importable for them as well.
sys.path.insert(0, str(Path(__file__).parent))
