"""The parts of ``bench/gpu.sh`` around its probes: tpcore importable offline, versions, the summary.

Standard library only (it runs before anything is known to import), except ``versions``, which imports torch.

    python3 bench/gpu_env.py pythonpath --wheels dist --site DIR   # print what goes in front of PYTHONPATH
    python3 bench/gpu_env.py versions OUT/versions.json --site DIR
    printf 'step\\tstatus\\tseconds\\n' | python3 bench/gpu_env.py summary OUT

``pythonpath`` makes tpcore and the plugins in ``plugins/`` importable, with their entry points visible to
``importlib.metadata`` (plugins are found through them), in this order:

1. wheels in ``--wheels`` (one per distribution, built beforehand): installed into ``--site`` with
   ``pip install --no-index --no-deps --target`` (or unpacked there if this Python has no pip);
2. else, if every distribution is installed already: nothing;
3. else the source tree itself, with a generated ``.dist-info`` per distribution in ``--site``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import zipfile
from datetime import datetime, timezone
from pathlib import Path
from xml.etree import ElementTree

from _common import git_commit, installed_version

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml"))]
#: the text files bench/gpu.sh writes into its output folder, in the order the summary reads them
OUTPUTS = (
    "versions.json",
    "pytest-gpu.xml",
    "pytest-gpu.log",
    "probe.json",
    "probe.log",
    "spmd.json",
    "spmd.log",
    "peers.md",
    "peers.log",
    "summary.txt",
)
#: and the chart beside peers.md (where matplotlib is installed), listed but not scrubbed
CHART = "peers.png"


def _project(pyproject: Path) -> dict:
    """The ``[project]`` table of a pyproject.toml (name, version and entry points are all that is read), with
    a dynamic version read where ``[tool.hatch.version]`` points (its ``__version__ = "..."`` line)."""
    if tomllib is None:
        raise RuntimeError("Python 3.11 or newer is needed to read pyproject.toml without tomli")
    toml = tomllib.loads(pyproject.read_text())
    project = dict(toml["project"])
    if "version" not in project:
        source = pyproject.parent / toml["tool"]["hatch"]["version"]["path"]
        project["version"] = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", source.read_text(), re.M)[1]
    return project


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def distribution_names() -> list[str]:
    """tpcore and every plugin distribution in plugins/."""
    return [_project(pyproject)["name"] for pyproject in PYPROJECTS]


# -- pythonpath ----------------------------------------------------------------------------------


def _wheels(folder: Path) -> list[Path]:
    """One wheel per distribution of this repository from ``folder``; [] if it holds none."""
    found = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not found:
        return []
    by_name: dict[str, list[Path]] = {}
    for wheel in found:
        by_name.setdefault(_normalized(wheel.name.split("-")[0]), []).append(wheel)
    wanted = {_normalized(name): name for name in distribution_names()}
    missing = [name for key, name in wanted.items() if key not in by_name]
    several = [", ".join(w.name for w in by_name[key]) for key in wanted if len(by_name.get(key, ())) > 1]
    if missing or several:
        problems = ([f"no wheel of {', '.join(missing)}"] if missing else []) + [f"several: {s}" for s in several]
        raise SystemExit(
            f"{folder}: {'; '.join(problems)}. Rebuild them all: rm -rf {folder} && "
            f"python3 -m pip wheel --no-deps -w {folder} . plugins/*"
        )
    return [by_name[key][0] for key in wanted]


def _install_wheels(wheels: list[Path], site: Path) -> None:
    """``pip install --no-index --no-deps --target site``; without a working pip the (pure-Python) wheels are
    unpacked there, which is what that install amounts to for them."""
    site.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("pip") is not None:
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(site)]
        if subprocess.run([*command, *map(str, wheels)], stdout=sys.stderr).returncode == 0:
            return
        print("pip install failed (above); unpacking the wheels instead", file=sys.stderr)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)


def _installed() -> bool:
    """tpcore imports and every distribution of this repository has metadata (so its entry points)."""
    if importlib.util.find_spec("tpcore") is None:
        return False
    try:
        for name in distribution_names():
            importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def write_dist_info(site: Path, pyproject: Path) -> None:
    """A minimal .dist-info, enough for importlib.metadata to see a distribution and its entry points."""
    project = _project(pyproject)
    info = site / f"{_normalized(project['name'])}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = dict(project.get("entry-points", {}))
    if "scripts" in project:
        groups["console_scripts"] = project["scripts"]
    lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) for group, points in groups.items()]
    (info / "entry_points.txt").write_text("\n".join(lines))


def source_paths(site: Path) -> list[str]:
    """The source tree on the path, with generated metadata in ``site`` for every distribution."""
    site.mkdir(parents=True, exist_ok=True)
    for pyproject in PYPROJECTS:
        write_dist_info(site, pyproject)
    return [str(ROOT), *(str(p.parent / "src") for p in PYPROJECTS[1:]), str(site)]


def pythonpath(wheel_folder: Path, site: Path) -> tuple[list[str], str]:
    """``(paths to put in front of PYTHONPATH, how tpcore is provided)``."""
    wheels = _wheels(wheel_folder)
    if wheels:
        _install_wheels(wheels, site)
        return [str(site)], "wheels: " + ", ".join(wheel.name for wheel in wheels)
    if _installed():
        return [], "installed: " + ", ".join(f"{n} {importlib.metadata.version(n)}" for n in distribution_names())
    return source_paths(site), "source tree (no wheels, not installed): generated entry-point metadata"


# -- versions ------------------------------------------------------------------------------------


def _nvidia_smi() -> list[str] | str:
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"n/a ({type(error).__name__})"
    return done.stdout.strip().splitlines() if done.returncode == 0 else f"n/a (exit {done.returncode})"


def _origin(module: str, site: Path) -> str:
    """Where ``module`` is imported from: the wheel site, the source tree or an installed copy."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return "not importable"
    origin = Path(spec.origin).resolve()
    for place, label in ((site.resolve(), "wheel site"), (ROOT, "source tree")):
        if origin.is_relative_to(place):
            return label
    return "installed"


def versions(site: Path, provided: str) -> dict:
    """What the results depend on (no host names, no paths)."""
    import torch

    info = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "tpcore provided by": provided,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu cores": os.cpu_count(),
        "torch": torch.__version__,
        "cuda (torch build)": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nvidia-smi (name, driver, memory)": _nvidia_smi(),
        "nccl": None,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except (AttributeError, RuntimeError) as error:
        info["nccl"] = f"n/a ({error})"
    for name in ("transformers", "safetensors", "pytest", "hypothesis", "cloudpickle", "pluggy"):
        info[name] = installed_version(name)
    modules = {"tpcore": "tpcore", **{n: _normalized(n) for n in distribution_names()[1:]}}
    for name, module in modules.items():
        info[name] = f"{installed_version(name)} ({_origin(module, site)})"
    return info


# -- summary -------------------------------------------------------------------------------------


def scrub_paths(text: str) -> str:
    """``text`` without this machine's paths and name: the checkout becomes ``.``, Python's prefix
    ``$PYTHON_PREFIX``, the temporary folder ``$TMPDIR``, the home folder ``$HOME`` and the host name (in
    pytest's junit report) ``host``. The placeholders are valid in JSON, XML and logs alike."""
    places = {str(ROOT): ".", sys.prefix: "$PYTHON_PREFIX", sys.base_prefix: "$PYTHON_PREFIX"}
    places.update({tempfile.gettempdir(): "$TMPDIR", str(Path.home()): "$HOME"})
    places[f'hostname="{socket.gethostname()}"'] = 'hostname="host"'
    for path, name in sorted(places.items(), key=lambda item: -len(item[0])):
        if len(path) > 1:
            text = text.replace(path, name)
    return text


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pytest_counts(path: Path) -> str:
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return "no junit report"
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"


def _probe_line(name: str, record: dict) -> str:
    status = record.get("status", "?")
    detail = record.get("summary") or record.get("error") or ", ".join(record.get("failed", []))
    return f"  {name:<26} {status:<18} {str(detail)[:90]}"


def summary(out: Path, steps: list[tuple[str, str, str]]) -> tuple[str, bool]:
    """The closing screen of bench/gpu.sh, and whether everything that ran passed."""
    info = _load_json(out / "versions.json") or {}
    gpus = ", ".join(info.get("gpus") or []) or "no CUDA device"
    lines = [
        f"tpcore GPU probe {info.get('date', '')} (commit {info.get('commit', '?')}): {gpus}",
        f"python {info.get('python')}, torch {info.get('torch')} (CUDA {info.get('cuda (torch build)')}, "
        f"NCCL {info.get('nccl')}), transformers {info.get('transformers')}, driver "
        f"{info.get('nvidia-smi (name, driver, memory)')}",
        f"tpcore {info.get('tpcore', '?')}; {info.get('tpcore provided by', '')}"[:160],
        "",
    ]
    ok = True
    for name, status, seconds in steps:
        detail = ""
        if name == "gpu-tests" and (out / "pytest-gpu.xml").exists():
            detail = _pytest_counts(out / "pytest-gpu.xml")
        lines.append(f"{name:<12} {status:<22} {seconds:>5} s  {detail}")
        ok &= status == "ok" or status.startswith("skipped")
        if name == "probe":
            records = (_load_json(out / "probe.json") or {}).get("probes", {})
            lines += [_probe_line(probe, record) for probe, record in records.items()]
            ok &= all(r.get("status") == "pass" or r.get("status", "").startswith("skipped") for r in records.values())
        if name == "torchrun":
            record = _load_json(out / "spmd.json")
            if record:
                lines.append(_probe_line("ParallelEngine(1)(path)", record))
                ok &= record.get("status") == "pass"
    present = [file for file in (*OUTPUTS, CHART) if (out / file).exists() or file == "summary.txt"]
    lines += ["", f"{'all passed' if ok else 'SOMETHING FAILED'}; files in {out}: {' '.join(present)}"]
    return "\n".join(lines) + "\n", ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    path = commands.add_parser("pythonpath", help="make tpcore and the plugins importable; print the paths")
    path.add_argument("--wheels", type=Path, default=ROOT / "dist")
    path.add_argument("--site", type=Path, required=True)
    path.add_argument("--provided", type=Path, help="also write how tpcore is provided to this file")
    path.add_argument("--path-file", type=Path, help="also write the paths to this file")
    version = commands.add_parser("versions", help="write the versions as JSON")
    version.add_argument("output", type=Path)
    version.add_argument("--site", type=Path, required=True)
    version.add_argument("--provided", default="")
    report = commands.add_parser("summary", help="scrub paths from OUT, print and write OUT/summary.txt")
    report.add_argument("out", type=Path)
    args = parser.parse_args(argv)

    if args.command == "pythonpath":
        paths, provided = pythonpath(args.wheels, args.site)
        print(f"tpcore from {provided}", file=sys.stderr)
        if args.provided:
            args.provided.write_text(provided)
        if args.path_file:
            args.path_file.write_text(os.pathsep.join(paths))
        print(os.pathsep.join(paths))
    elif args.command == "versions":
        args.output.write_text(json.dumps(versions(args.site, args.provided), indent=2) + "\n")
    else:
        steps = [tuple(line.split("\t")[:3]) for line in sys.stdin.read().splitlines() if line.count("\t") >= 2]
        for file in OUTPUTS:
            target = args.out / file
            if target.is_file():
                target.write_text(scrub_paths(target.read_text(errors="replace")))
        text, ok = summary(args.out, steps)
        text = scrub_paths(text)
        (args.out / "summary.txt").write_text(text)
        print(text, end="")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
