"""Packaging: ``nox -s build``'s dist/ installs by name, and AutoPolicy finds the BERT policies only through the
entry point of installed wheels.

The module builds the sdists and wheels of tpcore and every plugin as ``nox -s build`` does (tools/build_dist.py,
each wheel built from its sdist), installs tpcore's third-party requirements into a fresh venv made with uv, then
tpcore and the plugins by name from that folder alone (``--no-index --find-links``: a plugin's ``tpcore`` and
``tp-*`` requirements resolve from it, never from an index), and runs scripts there, away from this checkout:

1. the folder holds one wheel and one sdist of each package, of the version in its ``__version__``; each sdist
   carries its package, README and license metadata, and older builds of these packages were removed;
2. with only tpcore installed and the structural fallback off (``TPCORE_STRUCTURAL=0``), a BertModel is
   unsupported, and the error names the model and ``pip install tp-``;
3. after installing tp-bert, ``tpcore plugins`` lists it, the policy for the model comes from its entry point,
   tp_bert is imported from the venv's site-packages, and a one-rank engine reproduces the unsplit model;
4. two gloo ranks under ``torch.distributed.run`` reproduce BertForMaskedLM's logits;
5. tp-audio installs alone by name too (it needs tpcore only), built from its sdist.

Needs uv (``nox -s tests`` installs it), and an index or a warm uv cache for hatchling and transformers. torch is
pinned by constraints.txt to the local CPU wheel (UV_FIND_LINKS, taken from PIP_FIND_LINKS). About 90 s with a
warm uv cache on 2 idle cores, 15 s of it building the 14 artifacts (first run: a few more seconds for downloads).
Deselect with ``-m "not packaging"``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from build_dist import build, distribution, find_uv
from packaging.requirements import Requirement

pytestmark = [pytest.mark.packaging, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
#: the import (and normalized distribution) names of tpcore and the plugins, each one package
PACKAGES = ["tpcore", *sorted(path.parent.name.replace("-", "_") for path in ROOT.glob("plugins/*/pyproject.toml"))]
#: what an sdist holds beside its package: metadata, README, build settings, hatchling's .gitignore, a plugin's tests
SDIST_BESIDE = {"PKG-INFO", "README.md", "pyproject.toml", ".gitignore", "tests"}
STALE = "tp_bert-0.0.1-py3-none-any.whl"  # in the folder before the build: an older build of a package, replaced

CONFIG = "BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)"

UNSUPPORTED_SCRIPT = f"""
import json
import os
os.environ["TPCORE_STRUCTURAL"] = "0"  # no structural fallback: only a plugin could split it
import tpcore
from transformers import BertConfig, BertModel

model = BertModel({CONFIG})
try:
    tpcore.ParallelEngine(num_gpus=1, backend="gloo").parallelize(model)
except tpcore.UnsupportedModelError as error:
    print(json.dumps({{"raised": True, "message": str(error)}}))
else:
    print(json.dumps({{"raised": False}}))
"""

# Shared by the one-rank and the two-rank scripts: the same seed gives every rank the same weights and inputs.
MODEL_AND_INPUTS = f"""
import copy
import torch
from transformers import BertConfig, BertForMaskedLM

torch.manual_seed(0)
model = BertForMaskedLM({CONFIG}).eval()
reference = copy.deepcopy(model)
input_ids = torch.randint(0, 128, (2, 7))
attention_mask = torch.ones_like(input_ids)
attention_mask[1, 5:] = 0  # padding in the second sequence
with torch.no_grad():
    expected = reference(input_ids=input_ids, attention_mask=attention_mask).logits
"""

ONE_RANK_SCRIPT = (
    """
import importlib.metadata
import json
import sysconfig
import tp_bert
import tpcore
"""
    + MODEL_AND_INPUTS
    + """
entries = tpcore.AutoPolicy().entries_for(model)
tpcore.ParallelEngine(num_gpus=1, backend="gloo").parallelize(model)
with torch.no_grad():
    actual = model(input_ids=input_ids, attention_mask=attention_mask).logits
direct_url = importlib.metadata.distribution("tp-bert").read_text("direct_url.json")
print(json.dumps({
    "entries": [{"policy": e.policy.policy_name(), "distribution": e.distribution} for e in entries],
    "max_diff": (actual - expected).abs().max().item(),
    "tp_bert_file": tp_bert.__file__,
    "tpcore_file": tpcore.__file__,
    "purelib": sysconfig.get_paths()["purelib"],
    "direct_url": json.loads(direct_url) if direct_url else None,
}))
"""
)

TWO_RANK_SCRIPT = (
    """
import json
import sys
from pathlib import Path
import torch.distributed as dist
import tpcore
"""
    + MODEL_AND_INPUTS
    + """
entries = tpcore.AutoPolicy().entries_for(model)
model = tpcore.ParallelEngine(num_gpus=2, backend="gloo").parallelize(model)
with torch.no_grad():
    actual = model(input_ids=input_ids, attention_mask=attention_mask).logits
result = {
    "rank": dist.get_rank(),
    "world_size": dist.get_world_size(),
    "distributions": sorted({e.distribution for e in entries}),
    "query_rows": model.bert.encoder.layer[0].attention.self.query.weight.shape[0],
    "max_diff": (actual - expected).abs().max().item(),
    "scale": expected.abs().max().item(),
}
Path(sys.argv[1], f"rank{result['rank']}.json").write_text(json.dumps(result))
tpcore.destroy_process_group()  # the safe end of an SPMD script (see its docstring)
"""
)


def _env(bin_dir: Path | None = None) -> dict[str, str]:
    """This process's environment without anything that would leak the checkout or a world into a child."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "WORLD_SIZE", "RANK", "LOCAL_RANK"}
        # uv installs no .pyc files; with this set, every process would compile torch afresh (~10 s each)
        and key != "PYTHONDONTWRITEBYTECODE"
        and not key.startswith(("MASTER_", "TPCORE_", "TORCHELASTIC_"))
    }
    env["PYTHONNOUSERSITE"] = "1"
    if os.environ.get("PIP_FIND_LINKS") and not env.get("UV_FIND_LINKS"):
        env["UV_FIND_LINKS"] = ",".join(os.environ["PIP_FIND_LINKS"].split())  # the local CPU torch wheel
    if bin_dir is not None:
        env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    return env


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(map(str, args))} exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-8000:]}"
    )
    return result


def _last_json(result: subprocess.CompletedProcess):
    """The JSON document a script printed last, on one line."""
    return json.loads(result.stdout.strip().splitlines()[-1])


def _versions() -> dict[str, str]:
    """``{package: __version__}`` for tpcore and the plugins, from this checkout (installed editable)."""
    return {name: importlib.import_module(name).__version__ for name in PACKAGES}


def _requirement_pins() -> list[str]:
    """tpcore's third-party requirements (not its extras) pinned to the versions of this interpreter."""
    requirements = [Requirement(text) for text in importlib.metadata.requires("tpcore") or []]
    return [f"{r.name}=={importlib.metadata.version(r.name)}" for r in requirements if r.marker is None]


@dataclass
class FreshVenv:
    path: Path
    bin: Path
    python: Path
    work: Path
    dist: Path  # the built wheels and sdists
    unsupported: dict  # what the BertModel script saw before tp-bert was installed
    plugins_before: list  # `tpcore plugins --json` before tp-bert was installed

    def run(self, *args, timeout: float = 300) -> subprocess.CompletedProcess:
        return _run(list(args), self.work, _env(self.bin), timeout)

    def install(self, *args, timeout: float = 600) -> subprocess.CompletedProcess:
        """``uv pip install ARGS`` into this venv, under constraints.txt."""
        command = [find_uv(), "pip", "install", "--quiet", "--python", self.python, "-c", CONSTRAINTS, *args]
        return _run(command, self.work, _env(), timeout)

    def install_from_dist(self, *args) -> subprocess.CompletedProcess:
        """``pip install --find-links dist ARGS`` with no index: each of our packages can only come from dist."""
        return self.install("--no-index", "--find-links", self.dist, *args)

    def plugins(self) -> list[dict]:
        """``tpcore plugins --json``: one row per plugin."""
        return json.loads(self.run(self.bin / "tpcore", "plugins", "--json").stdout)

    def script(self, name: str, text: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
        path = self.work / name
        path.write_text(textwrap.dedent(text))
        return self.run(self.python, path, *args, timeout=timeout)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The folder ``nox -s build`` writes, built into a temporary one (skips without uv) that held an older tp-bert
    wheel and a file of someone else's."""
    if find_uv() is None:
        pytest.skip("uv is not installed: run `nox -s tests` (it installs uv) or `pip install uv`")
    out = tmp_path_factory.mktemp("dist")
    (out / STALE).write_bytes(b"")
    (out / "notes.txt").write_text("not ours")
    build(out)
    return out


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> FreshVenv:
    """A fresh venv given tpcore by name from dist, checked once without tp-bert and then given tp-bert the same way."""
    work = tmp_path_factory.mktemp("fresh")
    path = work / "venv"
    _run([find_uv(), "venv", "--quiet", "--python", sys.executable, path], work, _env())
    bin_dir = path / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / ("python.exe" if os.name == "nt" else "python")
    fresh = FreshVenv(path, bin_dir, python, work, dist, {}, [])
    fresh.install(*_requirement_pins(), timeout=900)  # from the index (torch: the local wheel), as pip would
    fresh.install_from_dist("tpcore")

    fresh.unsupported = _last_json(fresh.script("unsupported.py", UNSUPPORTED_SCRIPT))
    fresh.plugins_before = fresh.plugins()

    fresh.install_from_dist("tpcore", "tp-bert")  # pip install --find-links dist tpcore tp-bert
    return fresh


def test_build_writes_one_wheel_and_one_sdist_of_each_package(dist):
    versions = _versions()
    expected = [
        f"{name}-{version}{end}" for name, version in versions.items() for end in ("-py3-none-any.whl", ".tar.gz")
    ]
    assert sorted(path.name for path in dist.iterdir()) == sorted([*expected, "notes.txt"])


def test_each_sdist_holds_its_package_readme_and_license(dist):
    for sdist in dist.glob("*.tar.gz"):
        name, top = distribution(sdist), sdist.name.removesuffix(".tar.gz")
        package = name if name == "tpcore" else f"src/{name}"
        with tarfile.open(sdist) as archive:
            files = {member.removeprefix(f"{top}/") for member in archive.getnames()}
            info = archive.extractfile(f"{top}/PKG-INFO").read().decode()
        assert {"README.md", "pyproject.toml", f"{package}/__init__.py"} <= files, sdist.name
        others = sorted(file for file in files if file.split("/")[0] not in {*SDIST_BESIDE, package.split("/")[0]})
        assert not others, f"{sdist.name} holds files of no package of its own: {others}"
        assert "License-Expression: Apache-2.0" in info.splitlines(), sdist.name


def test_without_plugin_bert_is_unsupported(venv):
    assert venv.plugins_before == []
    assert venv.unsupported["raised"], "a BertModel was parallelized with no plugin installed"
    message = venv.unsupported["message"]
    assert "BertModel" in message
    assert "pip install tp-" in message


def test_plugins_command_lists_tp_bert(venv):
    rows = venv.plugins()
    tp_bert = [row for row in rows if row["distribution"] == "tp-bert"]
    assert len(tp_bert) == 1, rows
    assert tp_bert[0]["error"] is None
    assert tp_bert[0]["version"] == _versions()["tp_bert"]
    assert "BertPolicy" in [policy["name"] for policy in tp_bert[0]["policies"]]


def test_policy_comes_from_installed_wheel(venv):
    result = _last_json(venv.script("one_rank.py", ONE_RANK_SCRIPT))
    assert result["entries"], "AutoPolicy found no policy for BertForMaskedLM"
    assert result["entries"][0] == {"policy": "BertPolicy", "distribution": "tp-bert"}
    assert result["max_diff"] <= 1e-6

    # Imported from the fresh venv's site-packages, from a wheel, not an editable install of this checkout.
    purelib = Path(result["purelib"]).resolve()
    for name in ("tp_bert_file", "tpcore_file"):
        module_file = Path(result[name]).resolve()
        assert module_file.is_relative_to(purelib), f"{name}={module_file} is not under {purelib}"
        assert not module_file.is_relative_to(ROOT)
    assert not (result["direct_url"] or {}).get("dir_info", {}).get("editable")
    for pth in purelib.glob("*.pth"):
        assert str(ROOT) not in pth.read_text(), f"{pth} points into the checkout"


def test_two_gloo_ranks_match_unsplit_model(venv):
    out = venv.work / "two_ranks"
    out.mkdir(exist_ok=True)
    script = venv.work / "two_ranks.py"
    script.write_text(TWO_RANK_SCRIPT)
    launch = [venv.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, out]
    venv.run(*launch, timeout=300)

    results = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert result["world_size"] == 2
        assert result["distributions"] == ["tp-bert"]
        assert result["query_rows"] == 32, "the query projection was not split in two"
        assert result["max_diff"] <= 1e-5 * max(1.0, result["scale"]), result


EXAMPLE = ROOT / "examples" / "tp-biogpt"  # the third-party plugin of docs/writing-a-policy.md
EXAMPLE_SCRIPT = """
import json
import torch
import transformers
import tpcore
from tpcore.testing import ModelSpec, check_equivalence

if __name__ == "__main__":
    config = transformers.BioGptConfig(
        vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    spec = ModelSpec(transformers.BioGptForCausalLM, config, seed=0)
    entries = tpcore.AutoPolicy().entries_for(spec.build())
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    report = check_equivalence(spec, {"input_ids": ids}, world_sizes=(1, 2))
    print(json.dumps({"entries": [[e.policy.__name__, e.distribution] for e in entries], "report": report}))
"""


def test_a_third_party_plugin_from_the_docs_is_found_and_equivalent(venv, tmp_path):
    """examples/tp-biogpt, built as a wheel and installed: found through its entry point, proven equivalent."""
    _run([find_uv(), "build", "--wheel", "--out-dir", tmp_path, EXAMPLE], tmp_path, _env(), timeout=600)
    (wheel,) = tmp_path.glob("tp_biogpt-*.whl")
    _run([find_uv(), "pip", "install", "--quiet", "--python", venv.python, "--no-deps", wheel], tmp_path, _env())
    result = _last_json(venv.script("example.py", EXAMPLE_SCRIPT, timeout=600))
    assert result["entries"] == [["BioGptPolicy", "tp-biogpt"]]
    assert sorted(result["report"]) == ["1", "2"]
    assert result["report"]["2"]["logits"] <= 1e-5
    report = venv.run(venv.bin / "tpcore", "check", "BioGptForCausalLM", "--world-sizes", "1", "2", timeout=600).stdout
    assert "policy BioGptPolicy from tp-biogpt 0.1.0" in report
    assert "2 ranks: PASS" in report and report.rstrip().endswith("PASS")


def test_a_plugin_installs_alone_from_dist_and_builds_from_its_sdist(venv):
    """tp-audio needs tpcore alone: by name from dist with no index, built from its sdist (by the venv's hatchling:
    without an index, uv cannot make an isolated build environment), it brings no other plugin and registers its
    policies (its encoder/decoder blocks are tpcore's)."""
    venv.install("hatchling")
    venv.install_from_dist("--no-build-isolation", "--no-binary", "tp-audio", "tp-audio")
    rows, versions = {row["distribution"]: row for row in venv.plugins()}, _versions()
    requires = venv.run(venv.python, "-c", "import importlib.metadata as m; print(m.requires('tp-audio'))").stdout
    assert ast.literal_eval(requires) == ["tpcore>=0.1"]
    assert "tp-bart" not in rows  # (tp-bert is there: an earlier test installed it)
    assert rows["tp-audio"]["error"] is None, rows["tp-audio"]
    assert rows["tp-audio"]["version"] == versions["tp_audio"]
    assert rows["tp-audio"]["policies"], "tp-audio registered no policy"
