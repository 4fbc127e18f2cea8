"""The Python standard library as a corpus: held-out files for the benchmark
workloads (bench/workloads.py) and the SmolLM2 draft's prompts
(training/smollm2_prompts.py); it once trained the retired ``pystd`` toy pair.

The corpus is every ``.py`` file of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), excluding ``site-packages``, test
directories, ``idlelib``, ``lib2to3`` and files larger than 200 kB.  A fixed
list of held-out files (``HELDOUT_FILES``) is excluded from training so that
evaluation and benchmark workloads can use text the models never saw.

This module deliberately has no heavy imports so that benchmark harnesses can
import it cheaply.
"""

from __future__ import annotations

import os
import sysconfig
from typing import List, Optional

#: Held-out files, relative to the stdlib root (exist in Python 3.11+).
HELDOUT_FILES = (
    "json/decoder.py",
    "textwrap.py",
    "heapq.py",
    "bisect.py",
    "fractions.py",
    "shlex.py",
    "dataclasses.py",
    "string.py",
    "calendar.py",
    "csv.py",
    "difflib.py",
    "colorsys.py",
)

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
MAX_FILE_BYTES = 200_000


def stdlib_root() -> str:
    """Absolute path of the running interpreter's standard library."""
    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def _all_files(root: Optional[str] = None) -> List[str]:
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                if os.path.getsize(path) > MAX_FILE_BYTES:
                    continue
            except OSError:
                continue
            out.append(path)
    return sorted(out, key=lambda p: os.path.relpath(p, root))


def relpath(path: str) -> str:
    """Path relative to the stdlib root, with forward slashes."""
    return os.path.relpath(path, stdlib_root()).replace(os.sep, "/")


def heldout_files() -> List[str]:
    """Absolute paths of the held-out files that exist in this interpreter."""
    root = stdlib_root()
    paths = [os.path.join(root, *rel.split("/")) for rel in HELDOUT_FILES]
    return [p for p in paths if os.path.isfile(p)]


def training_files() -> List[str]:
    """Absolute paths of all training files (sorted, held-out files removed)."""
    held = set(HELDOUT_FILES)
    return [p for p in _all_files() if relpath(p) not in held]


def read_text(path: str) -> str:
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        return f.read()


def read_heldout_texts() -> dict:
    """Mapping ``relative path -> file text`` for the held-out files (in order)."""
    return {relpath(p): read_text(p) for p in heldout_files()}


if __name__ == "__main__":  # pragma: no cover - tiny CLI for inspection
    import sys

    tr = training_files()
    ho = heldout_files()
    print(f"stdlib: {stdlib_root()} (Python {sys.version.split()[0]})")
    print(f"training files: {len(tr)}, bytes: {sum(os.path.getsize(p) for p in tr)}")
    print(f"held-out files: {len(ho)}: {[relpath(p) for p in ho]}")
