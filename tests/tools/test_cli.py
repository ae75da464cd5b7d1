"""The ``tpcore`` console script: ``tpcore plugins``, ``--json``, and ``--model`` (the split at a glance)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers

import tpcore
from tpcore import Policy
from tpcore.errors import PluginLoadWarning
from tpcore.select.plugins import reset_plugins
from tpcore.testing import tiny_gpt2
from tpcore.tools.cli import main

BERT_LAYER = "transformers.models.bert.modeling_bert.BertLayer"
DISTILBERT_LAYER = "transformers.models.distilbert.modeling_distilbert.TransformerBlock"


pytestmark = pytest.mark.usefixtures("fresh_plugins")  # tests/conftest.py


@pytest.fixture(scope="module")
def bert_version() -> str:
    """The installed tp-bert's version."""
    return importlib.metadata.version("tp-bert")


@pytest.fixture(scope="module")
def bert_policies() -> list[type[Policy]]:
    """The policies tp-bert registers."""
    from tp_bert.policies import POLICIES

    return list(POLICIES)


def test_plugins_lists_tp_bert_with_version_and_policies(capsys, bert_version, bert_policies):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert f"tp-bert {bert_version} (entry point 'bert')" in lines
    start = lines.index(f"tp-bert {bert_version} (entry point 'bert')")
    policy_lines = [line.split() for line in lines[start + 1 : start + 1 + len(bert_policies)]]
    assert policy_lines == [[policy.policy_name(), policy.layer_class_name()] for policy in bert_policies]
    assert ["BertPolicy", BERT_LAYER] in policy_lines
    assert ["DistilBertPolicy", DISTILBERT_LAYER] in policy_lines
    assert "FAILED" not in out


def test_plugins_json(capsys, bert_version, bert_policies):
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    (bert,) = [row for row in rows if row["name"] == "bert"]
    assert bert == {
        "name": "bert",
        "distribution": "tp-bert",
        "version": bert_version,
        "policies": [
            {"name": policy.policy_name(), "layer_class": policy.layer_class_name()} for policy in bert_policies
        ],
        "quantized_formats": [],
        "error": None,
    }
    assert {"name": "BertPolicy", "layer_class": BERT_LAYER} in bert["policies"]


def test_plugins_shows_a_broken_plugin_and_still_lists_the_others(capsys, monkeypatch, bert_version):
    real = importlib.metadata.entry_points

    class Broken:
        name = "broken"
        dist = types.SimpleNamespace(metadata={"Name": "tp-broken"}, version="9.9.9")

        def load(self):
            raise ImportError("no module named tp_broken_dep")

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **params: [*real(**params), Broken()])

    with pytest.warns(PluginLoadWarning, match="tp-broken 9.9.9"):
        assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "tp-broken 9.9.9 (entry point 'broken')  FAILED: ImportError: no module named tp_broken_dep" in out
    assert f"tp-bert {bert_version} (entry point 'bert')" in out

    assert main(["plugins", "--json"]) == 0  # the registry is loaded: no second warning
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["broken"] == {
        "name": "broken",
        "distribution": "tp-broken",
        "version": "9.9.9",
        "policies": [],
        "quantized_formats": [],
        "error": "ImportError: no module named tp_broken_dep",
    }
    assert rows["bert"]["error"] is None


def test_plugins_with_a_policy_name_override(capsys, monkeypatch):
    class Named(Policy):
        layer_class = "pkg.mod.Block"
        name = "my-named-policy"

    module = types.ModuleType("tp_named")

    @tpcore.hookimpl
    def tpcore_register_policies():
        return [Named]

    module.tpcore_register_policies = tpcore_register_policies

    class Point:
        name = "named"
        dist = types.SimpleNamespace(metadata={"Name": "tp-named"}, version="0.4.2")

        def load(self):
            return module

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **params: [Point()])
    assert main(["plugins", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [
        {
            "name": "named",
            "distribution": "tp-named",
            "version": "0.4.2",
            "policies": [{"name": "my-named-policy", "layer_class": "pkg.mod.Block"}],
            "quantized_formats": [],
            "error": None,
        }
    ]
    reset_plugins()
    assert main(["plugins"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "tp-named 0.4.2 (entry point 'named')",
        f"    {'my-named-policy':<24} pkg.mod.Block",
    ]


def test_plugins_when_none_are_loaded(capsys, monkeypatch):
    monkeypatch.setenv("TPCORE_PLUGINS", "")
    assert main(["plugins"]) == 0
    assert capsys.readouterr().out.startswith("No tpcore plugins installed")
    assert main(["plugins", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "plugins" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter importing torch and transformers
def test_console_script(bert_version, bert_policies):
    script = Path(sys.executable).with_name("tpcore")
    command = [str(script)] if script.exists() else [shutil.which("tpcore") or "tpcore"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPCORE_")}
    result = subprocess.run([*command, "plugins"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = f"tp-bert {bert_version} (entry point 'bert')"
    assert header in lines
    start = lines.index(header) + 1
    listed = [line.split() for line in lines[start : start + len(bert_policies)]]
    assert listed == [[policy.policy_name(), policy.layer_class_name()] for policy in bert_policies]
    assert {"BertPolicy", "RobertaPolicy", "DistilBertPolicy"} <= {name for name, _ in listed}


# -- tpcore plugins --model: the split at a glance ------------------------------------------------------


class ClampedEmbedding(torch.nn.Embedding):
    """An embedding whose forward clamps the rows it looks up: not a lookup times one scale."""

    def forward(self, ids):
        return super().forward(ids).clamp(-1, 1)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A small GPT-2 saved with ``save_pretrained``."""
    directory = tmp_path_factory.mktemp("gpt2")
    tiny_gpt2().save_pretrained(directory)
    return directory


def test_plugins_model_shows_ranks_backend_devices_policies_with_their_plugins_and_bytes_per_rank(capsys, gpt2_dir):
    from tp_gpt.policies import GPT2Policy

    version = importlib.metadata.version("tp-gpt")
    assert main(["plugins", "--model", str(gpt2_dir), "--world-size", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "GPT2LMHeadModel over 2 gloo ranks on cpu (what parallelize(num_gpus=2) uses here):"
    assert lines[1].split() == ["GPT2Policy", GPT2Policy.layer_class_name(), "(from", "tp-gpt", f"{version})"]
    assert lines[2] == "GPT2LMHeadModel over 2 ranks:"
    assert re.fullmatch(r"per rank [\d.]+ KiB of [\d.]+ KiB \(5\d%; [\d.]+ KiB replicated on every rank\)", lines[-1])
    assert main(["plugins", "--model", str(gpt2_dir), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["backend"], shown["devices"]) == ("gloo", ["cpu", "cpu"])
    assert shown["policies"] == [
        {"policy": "GPT2Policy", "layer_class": GPT2Policy.layer_class_name(), "from": f"tp-gpt {version}"}
    ]
    plan = shown["plan"]
    assert plan["whole_bytes"] > max(plan["bytes_per_rank"]) and 0 < plan["replicated_bytes"] < min(
        plan["bytes_per_rank"]
    )
    assert (
        plan["tensors"]["transformer.wpe.weight"]["kept_whole"] == "outside the layers the policies split (GPT2Block)"
    )
    assert "kept_whole" not in plan["tensors"]["transformer.wte.weight"]  # split over the vocabulary


def test_plugins_model_says_what_stays_whole_when_much_does(capsys, monkeypatch, gpt2_dir):
    import tpcore.tools.check

    model = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir)
    model.transformer.wte.__class__ = ClampedEmbedding
    monkeypatch.setattr(tpcore.tools.check, "resolve", lambda name: types.SimpleNamespace(build=lambda: model))
    assert main(["plugins", "--model", "GPT2LMHeadModel"]) == 0
    out = capsys.readouterr().out
    assert (
        "stays whole on every rank; the largest:\n    transformer.wte (ClampedEmbedding, 18.9 KiB) is replicated: "
        in out
    )


@pytest.mark.parametrize(
    "argv", [["--version"], ["--help"], ["plugins", "--help"], ["check", "--help"], ["serve", "--help"]]
)
def test_help_and_version_answer_without_importing_torch_or_transformers(argv):
    code = (
        "import sys\nfrom tpcore.tools.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as end:\n"
        "    assert end.code == 0, end.code\n"
        "print('heavy:', sorted({'torch', 'transformers', 'pluggy'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "heavy: []"
    if argv == ["--version"]:
        assert done.stdout.splitlines()[0] == f"tpcore {tpcore.__version__}"
