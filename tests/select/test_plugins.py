"""The plugin manager (lazy entry-point loading, broken plugins, env switches) and AutoPolicy."""

from __future__ import annotations

import importlib
import importlib.metadata
import types
import warnings
from dataclasses import dataclass, field

import pytest
from transformers import BertModel, ResNetConfig, ResNetModel

import tpcore
from tpcore import AutoPolicy, Policy, UnsupportedModelError
from tpcore.load.quantized_formats import BUILT_IN_FORMATS
from tpcore.select import plugins as tp_plugins
from tpcore.select.plugins import (
    PluginLoadWarning,
    get_plugin_manager,
    plugin_infos,
    quantized_formats,
    registered_policies,
    reset_plugins,
)
from tpcore.testing import tiny_bert
from tpcore.tools.cli import main

# Policies tp-bert has registered since its first release (it may add more).
BERT_POLICIES = [
    "BertPolicy",
    "RobertaPolicy",
    "XLMRobertaPolicy",
    "CamembertPolicy",
    "ElectraPolicy",
    "DistilBertPolicy",
]


pytestmark = pytest.mark.usefixtures("fresh_plugins")  # tests/conftest.py


# -- fake entry points ---------------------------------------------------------------------------


class FakeDist:
    def __init__(self, name: str, version: str):
        self.metadata = {"Name": name}
        self.version = version


@dataclass
class FakeEntryPoint:
    """What tpcore.select.plugins uses of an importlib.metadata.EntryPoint: name, dist, load()."""

    name: str
    target: object
    dist: FakeDist | None
    group: str = "tpcore"
    loads: list[str] = field(default_factory=list)

    @property
    def value(self) -> str:
        return f"tp_{self.name}"

    def load(self):
        self.loads.append(self.name)
        if isinstance(self.target, BaseException):
            raise self.target
        return self.target


class ImportingEntryPoint(FakeEntryPoint):
    """An entry point that imports its module (``target``, a module name), as importlib.metadata's does."""

    def load(self):
        self.loads.append(self.name)
        return importlib.import_module(self.target)


class FakeLayer:
    """Stands for a layer class; policies only need its qualified name."""


class FakePolicy(Policy):
    layer_class = FakeLayer


class OtherFakePolicy(Policy):
    layer_class = "some.module.OtherLayer"
    name = "other-fake"


def plugin_module(name: str, *policies, formats: tuple = ()) -> types.ModuleType:
    """A plugin module registering ``policies`` and, where given, quantized ``formats``."""
    module = types.ModuleType(name)

    @tpcore.hookimpl
    def tpcore_register_policies():
        return list(policies)

    module.tpcore_register_policies = tpcore_register_policies
    if formats:
        module.tpcore_register_quantized_formats = tpcore.hookimpl(lambda: list(formats))
    return module


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Replace the installed entry points by a list the test fills; records every call."""
    points: list[FakeEntryPoint] = []
    calls: list[str | None] = []

    def entry_points(**params):
        calls.append(params.get("group"))
        assert params == {"group": "tpcore"}
        return list(points)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return types.SimpleNamespace(points=points, calls=calls)


@pytest.fixture
def good_and_broken(fake_entry_points):
    """Two fake entry points: one that fails to import (listed first), and a good one with two policies."""
    broken = FakeEntryPoint("broken", ImportError("boom: no module named tp_missing"), FakeDist("tp-broken", "9.9.9"))
    good = FakeEntryPoint("fake", plugin_module("tp_fake", FakePolicy, OtherFakePolicy), FakeDist("tp-fake", "1.2.3"))
    fake_entry_points.points.extend([broken, good])  # the broken one first: it must not stop the good one
    return types.SimpleNamespace(broken=broken, good=good, calls=fake_entry_points.calls)


def load_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)
        return registered_policies()


# -- lazy loading ------------------------------------------------------------------------------


def test_nothing_is_loaded_until_first_use(good_and_broken):
    auto = AutoPolicy()  # building an AutoPolicy is not a use of the registry
    assert good_and_broken.calls == []
    assert good_and_broken.good.loads == [] and good_and_broken.broken.loads == []
    assert tp_plugins._manager is None

    entries = load_quietly()

    assert good_and_broken.calls == ["tpcore"]
    assert good_and_broken.good.loads == ["fake"]
    assert good_and_broken.broken.loads == ["broken"]
    assert [entry.policy for entry in entries] == [FakePolicy, OtherFakePolicy]

    # later uses reuse the loaded registry
    assert [entry.policy for entry in auto.available()] == [FakePolicy, OtherFakePolicy]
    plugin_infos()
    assert get_plugin_manager() is get_plugin_manager()
    assert good_and_broken.calls == ["tpcore"]
    assert good_and_broken.good.loads == ["fake"]


def test_reset_plugins_makes_the_next_use_reload(good_and_broken):
    load_quietly()
    first = get_plugin_manager()
    reset_plugins()
    assert good_and_broken.good.loads == ["fake"]
    load_quietly()
    assert get_plugin_manager() is not first
    assert good_and_broken.good.loads == ["fake", "fake"]
    assert good_and_broken.calls == ["tpcore", "tpcore"]


# -- broken plugins ----------------------------------------------------------------------------


def test_broken_plugin_warns_with_distribution_and_version_and_the_good_one_loads(good_and_broken):
    with pytest.warns(PluginLoadWarning) as record:
        entries = registered_policies()

    assert len(record) == 1
    message = str(record[0].message)
    assert "'broken'" in message
    assert "tp-broken 9.9.9" in message
    assert "boom: no module named tp_missing" in message
    assert issubclass(PluginLoadWarning, UserWarning)

    assert [(e.policy, e.plugin, e.distribution, e.version) for e in entries] == [
        (FakePolicy, "fake", "tp-fake", "1.2.3"),
        (OtherFakePolicy, "fake", "tp-fake", "1.2.3"),
    ]
    infos = {info.name: info for info in plugin_infos()}
    assert infos["broken"].distribution == "tp-broken"
    assert infos["broken"].version == "9.9.9"
    assert infos["broken"].error == "ImportError: boom: no module named tp_missing"
    assert infos["broken"].policies == []
    assert infos["fake"].error is None
    assert infos["fake"].policies == ["FakePolicy", "other-fake"]
    assert get_plugin_manager().get_plugin("broken") is None
    assert get_plugin_manager().get_plugin("fake") is good_and_broken.good.target


def test_plugin_returning_a_non_policy_is_reported_and_unregistered(fake_entry_points):
    bad = FakeEntryPoint("bad", plugin_module("tp_bad", FakePolicy, "not a policy"), FakeDist("tp-bad", "0.0.1"))
    good = FakeEntryPoint("fake", plugin_module("tp_fake", OtherFakePolicy), FakeDist("tp-fake", "1.2.3"))
    fake_entry_points.points.extend([bad, good])

    with pytest.warns(PluginLoadWarning, match=r"'bad' from tp-bad 0\.0\.1 failed to load: TypeError: .*not a Policy"):
        entries = registered_policies()

    assert [entry.policy for entry in entries] == [OtherFakePolicy]  # nothing at all from the bad plugin
    assert get_plugin_manager().get_plugin("bad") is None


def test_plugin_with_a_wrong_hook_signature_is_reported(fake_entry_points):
    module = types.ModuleType("tp_wrong")

    @tpcore.hookimpl
    def tpcore_register_policies(config):  # the hookspec takes no arguments
        return [FakePolicy]

    module.tpcore_register_policies = tpcore_register_policies
    wrong = FakeEntryPoint("wrong", module, FakeDist("tp-wrong", "2.0"))
    good = FakeEntryPoint("fake", plugin_module("tp_fake", OtherFakePolicy), FakeDist("tp-fake", "1.2.3"))
    fake_entry_points.points.extend([wrong, good])

    with pytest.warns(PluginLoadWarning, match=r"tp-wrong 2\.0"):
        entries = registered_policies()
    assert [entry.policy for entry in entries] == [OtherFakePolicy]


def test_entry_point_without_distribution_uses_its_name(fake_entry_points):
    fake_entry_points.points.append(FakeEntryPoint("loose", plugin_module("tp_loose", FakePolicy), None))
    (entry,) = registered_policies()
    assert (entry.policy, entry.plugin, entry.distribution, entry.version) == (FakePolicy, "loose", "loose", "?")


def test_plugin_with_an_unknown_hook_does_not_take_the_others_down(fake_entry_points):
    module = types.ModuleType("tp_typo")

    @tpcore.hookimpl
    def tpcore_register_policy():  # misspelled hook name
        return [FakePolicy]

    module.tpcore_register_policy = tpcore_register_policy
    typo = FakeEntryPoint("typo", module, FakeDist("tp-typo", "0.3"))
    good = FakeEntryPoint("fake", plugin_module("tp_fake", OtherFakePolicy), FakeDist("tp-fake", "1.2.3"))
    fake_entry_points.points.extend([typo, good])

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        entries = registered_policies()
    assert [entry.policy for entry in entries] == [OtherFakePolicy]
    assert any("tp-typo 0.3" in str(w.message) for w in record if issubclass(w.category, PluginLoadWarning))


@pytest.fixture
def exits_on_import(tmp_path, monkeypatch):
    """The name of an importable module that calls ``sys.exit(1)`` when imported."""
    (tmp_path / "tp_exits_on_import.py").write_text("import sys\n\nsys.exit(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tp_exits_on_import"


def exiting_hook_module() -> types.ModuleType:
    module = types.ModuleType("tp_exits_in_hook")

    @tpcore.hookimpl
    def tpcore_register_policies():
        raise SystemExit("tp_exits_in_hook gives up")

    module.tpcore_register_policies = tpcore_register_policies
    return module


def test_a_plugin_that_exits_on_import_or_in_its_hook_is_reported_and_the_good_one_loads(
    fake_entry_points, exits_on_import
):
    fake_entry_points.points.extend(
        [
            ImportingEntryPoint("exits", exits_on_import, FakeDist("tp-exits", "0.1")),
            FakeEntryPoint("hook", exiting_hook_module(), FakeDist("tp-hook", "0.2")),
            FakeEntryPoint("fake", plugin_module("tp_fake", FakePolicy), FakeDist("tp-fake", "1.2.3")),
        ]
    )
    with pytest.warns(PluginLoadWarning) as record:
        entries = registered_policies()

    assert [str(w.message) for w in record] == [
        "tpcore plugin 'exits' from tp-exits 0.1 failed to load: SystemExit: 1",
        "tpcore plugin 'hook' from tp-hook 0.2 failed to load: SystemExit: tp_exits_in_hook gives up",
    ]
    assert [(entry.policy, entry.plugin) for entry in entries] == [(FakePolicy, "fake")]
    errors = {info.name: info.error for info in plugin_infos()}
    assert errors == {"exits": "SystemExit: 1", "hook": "SystemExit: tp_exits_in_hook gives up", "fake": None}
    assert get_plugin_manager().get_plugin("hook") is None


class PluginBaseException(BaseException):
    """A BaseException of a plugin's own, not one of Python's."""


@pytest.mark.parametrize("exception", [SystemExit(), GeneratorExit("closed"), PluginBaseException("odd")])
def test_any_base_exception_but_keyboard_interrupt_is_a_broken_plugin(fake_entry_points, exception):
    fake_entry_points.points.extend(
        [
            FakeEntryPoint("odd", exception, FakeDist("tp-odd", "3.0")),
            FakeEntryPoint("fake", plugin_module("tp_fake", FakePolicy), FakeDist("tp-fake", "1.2.3")),
        ]
    )
    with pytest.warns(
        PluginLoadWarning, match=rf"'odd' from tp-odd 3\.0 failed to load: ([\w.]+\.)?{type(exception).__name__}"
    ):
        entries = registered_policies()
    assert [entry.policy for entry in entries] == [FakePolicy]
    assert type(exception).__name__ in plugin_infos()[0].error


def test_keyboard_interrupt_while_loading_a_plugin_goes_through(fake_entry_points):
    fake_entry_points.points.extend(
        [
            FakeEntryPoint("fake", plugin_module("tp_fake", FakePolicy), FakeDist("tp-fake", "1.2.3")),
            FakeEntryPoint("interrupted", KeyboardInterrupt(), FakeDist("tp-interrupted", "1.0")),
        ]
    )
    with pytest.raises(KeyboardInterrupt):
        registered_policies()
    assert tp_plugins._manager is None  # nothing half-loaded is kept: the next use loads again


def test_policy_lookup_survives_a_plugin_that_exits_on_import(monkeypatch, exits_on_import):
    from tp_bert.policies import BertPolicy

    real = importlib.metadata.entry_points
    exits = ImportingEntryPoint("exits", exits_on_import, FakeDist("tp-exits", "0.1"))
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **params: [exits, *real(**params)])
    with pytest.warns(PluginLoadWarning, match=r"tp-exits 0\.1 failed to load: SystemExit: 1"):
        assert AutoPolicy().get_policy(bert()) == [BertPolicy]


def test_tpcore_plugins_lists_a_plugin_that_exits_on_import_as_failed(fake_entry_points, exits_on_import, capsys):
    fake_entry_points.points.extend(
        [
            ImportingEntryPoint("exits", exits_on_import, FakeDist("tp-exits", "0.1")),
            FakeEntryPoint("fake", plugin_module("tp_fake", FakePolicy), FakeDist("tp-fake", "1.2.3")),
        ]
    )
    with pytest.warns(PluginLoadWarning, match="tp-exits 0.1"):
        assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "tp-exits 0.1 (entry point 'exits')  FAILED: SystemExit: 1" in lines
    assert "tp-fake 1.2.3 (entry point 'fake')" in lines


# -- env switches ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_disable_autoload_loads_no_entry_point(good_and_broken, monkeypatch, value):
    monkeypatch.setenv("TPCORE_DISABLE_PLUGIN_AUTOLOAD", value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even the broken plugin is touched
        assert registered_policies() == []
        assert plugin_infos() == []
    assert good_and_broken.good.loads == [] and good_and_broken.broken.loads == []


@pytest.mark.parametrize("value", ["0", ""])
def test_disable_autoload_off_values_load_normally(good_and_broken, monkeypatch, value):
    monkeypatch.setenv("TPCORE_DISABLE_PLUGIN_AUTOLOAD", value)
    assert [entry.policy for entry in load_quietly()] == [FakePolicy, OtherFakePolicy]


@pytest.mark.parametrize("value", ["fake", "tp-fake", " fake , tp-unknown "])
def test_only_named_plugins_are_loaded(good_and_broken, monkeypatch, value):
    monkeypatch.setenv("TPCORE_PLUGINS", value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the broken plugin is not loaded, so nothing warns
        entries = registered_policies()
    assert [entry.policy for entry in entries] == [FakePolicy, OtherFakePolicy]
    assert [info.name for info in plugin_infos()] == ["fake"]
    assert good_and_broken.broken.loads == []


def test_only_a_broken_plugin_named(good_and_broken, monkeypatch):
    monkeypatch.setenv("TPCORE_PLUGINS", "tp-broken")
    with pytest.warns(PluginLoadWarning, match="tp-broken 9.9.9"):
        assert registered_policies() == []
    assert good_and_broken.good.loads == []


@pytest.mark.parametrize("value", ["", " ", ","])
def test_empty_plugin_list_loads_none(good_and_broken, monkeypatch, value):
    monkeypatch.setenv("TPCORE_PLUGINS", value)
    assert registered_policies() == []
    assert plugin_infos() == []
    assert good_and_broken.good.loads == [] and good_and_broken.broken.loads == []


def test_env_is_read_on_first_use_not_later(good_and_broken, monkeypatch):
    assert [entry.policy for entry in load_quietly()] == [FakePolicy, OtherFakePolicy]
    monkeypatch.setenv("TPCORE_PLUGINS", "")
    assert [entry.policy for entry in registered_policies()] == [FakePolicy, OtherFakePolicy]
    reset_plugins()
    assert registered_policies() == []


def test_only_named_with_real_entry_points(monkeypatch):
    monkeypatch.setenv("TPCORE_PLUGINS", "tp-bert")
    assert [info.distribution for info in plugin_infos()] == ["tp-bert"]
    reset_plugins()
    monkeypatch.setenv("TPCORE_PLUGINS", "tp-nonexistent")
    assert plugin_infos() == []


# -- the real, installed tp-bert plugin ----------------------------------------------------------


def test_installed_tp_bert_plugin_is_found_via_its_entry_point():
    points = [ep for ep in importlib.metadata.entry_points(group="tpcore") if ep.name == "bert"]
    assert [ep.value for ep in points] == ["tp_bert"]

    infos = {info.name: info for info in plugin_infos()}
    info = infos["bert"]
    assert info.distribution == "tp-bert"
    assert info.version == importlib.metadata.version("tp-bert")
    assert info.error is None
    assert set(BERT_POLICIES) <= set(info.policies)

    from tp_bert import policies

    assert info.policies == [policy.policy_name() for policy in policies.POLICIES]
    entries = [entry for entry in registered_policies() if entry.plugin == "bert"]
    assert [entry.policy for entry in entries] == list(policies.POLICIES)
    assert {(entry.distribution, entry.version) for entry in entries} == {("tp-bert", info.version)}
    assert policies.BertPolicy.layer_class_name() == "transformers.models.bert.modeling_bert.BertLayer"


def bert() -> BertModel:
    """A tiny BERT whose policy is asked for."""
    return tiny_bert(seed=None, num_attention_heads=4, max_position_embeddings=16)


def tiny_uncovered() -> ResNetModel:
    """A model nothing covers: no plugin, no tp plan, and no attention or MLP of Linears for a structural policy
    (ResNet's blocks are convolutions)."""
    return ResNetModel(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]))


def test_auto_policy_finds_bert_policy():
    from tp_bert.policies import BertPolicy

    model = bert()
    assert AutoPolicy().get_policy(model) == [BertPolicy]
    (entry,) = AutoPolicy().entries_for(model)
    assert (entry.policy, entry.plugin, entry.distribution) == (BertPolicy, "bert", "tp-bert")


def test_auto_policy_on_an_uncovered_model_raises_a_helpful_error():
    with pytest.raises(UnsupportedModelError) as info:
        AutoPolicy().get_policy(tiny_uncovered())
    message = str(info.value)
    assert "No installed tpcore policy covers ResNetModel (model_type 'resnet')." in message
    assert "No structural split of ResNetModel" in message
    installed = next(line for line in message.splitlines() if line.startswith("Installed plugins: "))
    assert f"tp-bert {importlib.metadata.version('tp-bert')}" in installed
    assert "pip install tp-" in message
    assert "custom_policies=" in message
    assert isinstance(info.value, LookupError)


def test_uncovered_model_error_lists_failed_plugins(monkeypatch):
    real = importlib.metadata.entry_points

    def entry_points(**params):
        broken = FakeEntryPoint("broken", RuntimeError("kaput"), FakeDist("tp-broken", "9.9.9"))
        return [*real(**params), broken]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    with pytest.warns(PluginLoadWarning, match="tp-broken 9.9.9"):
        with pytest.raises(UnsupportedModelError) as info:
            AutoPolicy().get_policy(tiny_uncovered())
    message = str(info.value)
    assert "tp-bert" in next(line for line in message.splitlines() if line.startswith("Installed plugins: "))
    assert "Plugins that failed to load: tp-broken 9.9.9 (failed: RuntimeError: kaput)." in message


def test_uncovered_model_with_autoload_disabled_reports_no_plugins(monkeypatch):
    monkeypatch.setenv("TPCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    with pytest.raises(
        UnsupportedModelError, match=r"covers ResNetModel \(model_type 'resnet'\)\.\nInstalled plugins: none\."
    ):
        AutoPolicy().get_policy(tiny_uncovered())


class SameNamePolicy(Policy):
    layer_class = "some.module.ThirdLayer"
    name = "other-fake"  # the name OtherFakePolicy has


class SameLayerPolicy(Policy):
    layer_class = "some.module.OtherLayer"  # the layer class OtherFakePolicy has


CLASHES = [(SameNamePolicy, "name 'other-fake'"), (SameLayerPolicy, "layer class 'some.module.OtherLayer'")]


@pytest.mark.parametrize(("clash", "what"), CLASHES)
def test_a_policy_claimed_by_two_plugins_fails_the_second_naming_both(fake_entry_points, clash, what):
    first = FakeEntryPoint("first", plugin_module("tp_first", OtherFakePolicy), FakeDist("tp-first", "1.0"))
    second = FakeEntryPoint("second", plugin_module("tp_second", clash), FakeDist("tp-second", "2.0"))
    fake_entry_points.points.extend([first, second])
    with pytest.warns(PluginLoadWarning, match=rf"policy {what} is registered by both tp-first 1.0 and tp-second 2.0"):
        entries = registered_policies()
    assert [entry.policy for entry in entries] == [OtherFakePolicy]
    failed = {info.name: info.error for info in plugin_infos()}
    assert failed["first"] is None and "PluginConflictError" in failed["second"]


# -- quantized formats -------------------------------------------------------------------------------------------


class FakeFormat(tpcore.QuantizedFormat):
    quant_method = "fake-int3"
    description = "three bits, for tests"


#: the formats tpcore splits itself, in order
BUILT_IN_METHODS = [form.quant_method for form in BUILT_IN_FORMATS]


def test_a_plugin_s_quantized_format_joins_tpcore_s_own(fake_entry_points, capsys):
    fake = FakeFormat()
    fake_entry_points.points.append(
        FakeEntryPoint("int3", plugin_module("tp_int3", formats=(fake,)), FakeDist("tp-int3", "0.1"))
    )
    formats = quantized_formats()
    assert [form.quant_method for form in formats] == [*BUILT_IN_METHODS, "fake-int3"] and formats[-1] is fake
    (info,) = plugin_infos()
    assert (info.formats, info.policies, info.error) == (["fake-int3"], [], None)
    assert main(["plugins"]) == 0
    assert "tp-int3 0.1 (entry point 'int3')\n    quantized format 'fake-int3'" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("formats", "error"),
    [
        ((FakeFormat(), FakeFormat()), r"'fake-int3' is registered by both tp-int3 0\.1 and tp-int3 0\.1"),
        ((type("Fp8Again", (FakeFormat,), {"quant_method": "fp8"})(),), r"'fp8' is registered by both tpcore itself"),
        (("not a format",), r"returned 'not a format', not a QuantizedFormat"),
    ],
)
def test_a_plugin_whose_format_conflicts_or_is_no_format_is_reported_and_dropped(fake_entry_points, formats, error):
    plugin = FakeEntryPoint("int3", plugin_module("tp_int3", formats=formats), FakeDist("tp-int3", "0.1"))
    good = FakeEntryPoint("fake", plugin_module("tp_fake", FakePolicy), FakeDist("tp-fake", "1.2.3"))
    fake_entry_points.points.extend([plugin, good])
    with pytest.warns(PluginLoadWarning, match=error):
        formats_now = quantized_formats()
    assert [form.quant_method for form in formats_now] == BUILT_IN_METHODS
    assert [entry.policy for entry in registered_policies()] == [FakePolicy]
