"""scripts/readme_tables.py loaded as a module (scripts/ is not a package)."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_readme_tables():
    path = REPO / "scripts" / "readme_tables.py"
    spec = importlib.util.spec_from_file_location("readme_tables", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
