"""Run one fuzz harness under atheris (libFuzzer):

    python tests/fuzz/run.py NAME [--seeds DIR] [libFuzzer options, corpus directories]

``--seeds DIR`` writes the harness's seed corpus into DIR first (one file per seed) and exits.
gpumem's Python modules are instrumented for coverage (imported inside
``atheris.instrument_imports``); the Cython core is not (it is compiled C: its memory safety
is ci/sanitize.sh's job), so the fuzzer steers by the Python paths around it.
"""
from __future__ import annotations

import hashlib
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: `import fuzz`


def write_seeds(name: str, folder: Path) -> int:
    harness = importlib.import_module(f"fuzz.{name}")
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for data in harness.seeds():
        (folder / f"seed-{hashlib.sha1(data).hexdigest()[:16]}").write_bytes(data)
        n += 1
    return n


def main(argv: list[str]) -> int:
    from fuzz import HARNESSES
    if len(argv) < 2 or argv[1] not in HARNESSES:
        print(f"usage: {argv[0]} NAME [--seeds DIR | libFuzzer args]; NAME in "
              f"{', '.join(HARNESSES)}", file=sys.stderr)
        return 2
    name = argv[1]
    if len(argv) == 4 and argv[2] == "--seeds":
        print(f"{name}: {write_seeds(name, Path(argv[3]))} seeds")
        return 0
    import atheris
    with atheris.instrument_imports(include=["gpumem", "gpumem_sim", "fuzz"]):
        harness = importlib.import_module(f"fuzz.{name}")
    atheris.Setup([argv[0], *argv[2:]], harness.check)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
