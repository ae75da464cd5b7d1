"""Build the sdist and the wheel of tpcore and of every plugin in plugins/ into one folder.

    python tools/build_dist.py [OUT]     # OUT defaults to dist/; `nox -s build` runs this

Each package is built by ``uv build``: its sdist, then its wheel from that sdist, so a wheel that works proves its
sdist complete. The artifacts of these distributions already in OUT (any version) are replaced, so OUT holds one
version of each; other files there are left alone. tests/packaging/test_packaging.py builds with ``build`` too.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: tpcore (the repository root), then the plugin distributions
PROJECTS = [ROOT, *sorted(path.parent for path in ROOT.glob("plugins/*/pyproject.toml"))]


def find_uv() -> str | None:
    """uv's executable: the one of the ``uv`` Python package (as nox installs it), else the one on PATH."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def artifacts(folder: Path) -> list[Path]:
    """The wheels and sdists in ``folder``."""
    return sorted([*folder.glob("*.whl"), *folder.glob("*.tar.gz")])


def distribution(artifact: Path) -> str:
    """The normalized distribution name a wheel or sdist file is named after (``tp_bert`` for tp-bert)."""
    return artifact.name.split("-")[0]


def build(out: Path) -> list[Path]:
    """Build every project into ``out``, replacing the artifacts of the same distributions there; the new ones.

    Raises ``subprocess.CalledProcessError`` (uv's output went to stderr) and leaves ``out`` as it was if a build fails.
    """
    uv = find_uv()
    if uv is None:
        raise FileNotFoundError("uv is not installed: pip install uv")
    with tempfile.TemporaryDirectory() as staging:
        for project in PROJECTS:
            subprocess.run([uv, "build", "--python", sys.executable, "--out-dir", staging, project], check=True)
        built = artifacts(Path(staging))
        names = {distribution(artifact) for artifact in built}
        out.mkdir(parents=True, exist_ok=True)
        for stale in artifacts(out):
            if distribution(stale) in names:
                stale.unlink()
        return [Path(shutil.move(artifact, out / artifact.name)) for artifact in built]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / "dist", help="the folder (default: dist/)")
    out = parser.parse_args().out
    try:
        built = build(out)
    except (FileNotFoundError, subprocess.CalledProcessError) as error:
        sys.exit(f"build failed: {error}")
    print("\n".join(str(artifact) for artifact in built))


if __name__ == "__main__":
    main()
