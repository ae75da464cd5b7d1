"""bench/gpu.sh's parts on CPU: ``gpu_probe.py --cpu`` runs every probe that means something without CUDA
and gets the unsplit model's numbers and tokens, a failing probe is recorded and the rest go on, and the
source-tree fallback makes the plugins' entry points visible without installing anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import gpu_env  # noqa: E402
import gpu_probe  # noqa: E402

from tpcore.testing import DEFAULT_RTOL  # noqa: E402

CUDA_ONLY = {"caller_model_on_cuda", "gloo_two_ranks_one_gpu", "nccl_two_ranks_one_gpu"}
PARALLELIZE_CHECKS = {
    "ranks_on_device",
    "forward_within_tolerance",
    "greedy_identical",
    "beam_identical",
    "sampling_first_identical",
    "sampling_second_identical",
    "sampling_draws_differ",
    "memory_per_rank",
    "memory_allocated_positive",
    "deparallelize_returns_model",
    "deparallelize_stops_ranks",
    "deparallelized_runs_unsplit",
}


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    """probe.json of one ``python bench/gpu_probe.py --cpu OUT`` (five small rank pools)."""
    out = tmp_path_factory.mktemp("probe")
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_probe.py"), "--cpu", str(out)],
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a speed bound
    )
    report = json.loads((out / "probe.json").read_text())
    return done, report


@pytest.mark.slow
def test_cpu_run_records_every_probe_and_exits_0(cpu_report):
    done, report = cpu_report
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["environment"]["mode"] == "cpu"
    probes = report["probes"]
    assert list(probes) == list(gpu_probe.PROBES)
    skipped = {name for name, record in probes.items() if record["status"].startswith("skipped: ")}
    assert skipped == CUDA_ONLY
    assert all(probes[name]["status"] in ("skipped: no CUDA", "skipped: CUDA only (--cpu)") for name in CUDA_ONLY)
    assert all(record["status"] == "pass" for name, record in probes.items() if name not in CUDA_ONLY)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["parallelize_llama", "parallelize_gpt2", "parallelize_t5"])
def test_cpu_parallelize_probes_match_the_unsplit_model(cpu_report, name):
    record = cpu_report[1]["probes"][name]
    assert set(record["checks"]) == PARALLELIZE_CHECKS and all(record["checks"].values())
    assert record["backend"] == "gloo" and record["rank_devices"] == [["cpu"]]
    for compared in (record["forward"], record["after_deparallelize"]):
        assert compared["max_abs_diff"] <= DEFAULT_RTOL * compared["scale"]
    assert set(record["memory"]["memory_allocated"]) == {"cpu:0"}


@pytest.mark.slow
def test_cpu_collectives_and_shard_on_load_are_exact(cpu_report):
    probes = cpu_report[1]["probes"]
    ranks = probes["collectives"]["ranks"]
    assert probes["collectives"]["world_size"] == 2 and len(ranks) == 2
    for rank in ranks:
        assert set(rank) == set(gpu_probe.DTYPES)
        errors = [result["error"] for ops in rank.values() for result in ops.values()]
        assert len(errors) == 4 * len(gpu_probe.DTYPES) and set(errors) == {0.0}
    loaded = probes["shard_on_load"]
    assert loaded["checks"]["caller_holds_no_weights"] and loaded["checks"]["greedy_identical"]
    assert loaded["checks"]["beam_identical"] and loaded["forward"]["max_abs_diff"] <= DEFAULT_RTOL


@pytest.mark.slow
def test_a_failing_probe_is_recorded_and_the_others_still_run(tmp_path):
    def raises(mode, record):
        record["checks"]["reached"] = True
        raise ValueError("no such kernel")

    def fails(mode, record):
        record["checks"].update(good=True, bad=False)

    def passes(mode, record):
        record["checks"]["good"] = True

    def skips(mode, record):
        mode.need_cuda()

    probes = {"raises": raises, "fails": fails, "skips": skips, "passes": passes}
    output = tmp_path / "probe.json"
    mode = gpu_probe.Mode(cuda=False, workdir=tmp_path)
    report = gpu_probe.run_probes(list(probes), mode, output, probes)
    records = json.loads(output.read_text())["probes"]
    assert records == json.loads(json.dumps(report["probes"]))
    assert records["raises"]["status"] == "error" and records["raises"]["error"] == "ValueError: no such kernel"
    assert "no such kernel" in records["raises"]["traceback"] and records["raises"]["checks"] == {"reached": True}
    assert records["fails"]["status"] == "fail" and records["fails"]["failed"] == ["bad"]
    assert records["skips"]["status"].startswith("skipped: ")
    assert records["passes"]["status"] == "pass"
    text, ok = gpu_env.summary(tmp_path, [("probe", "ok", "3")])
    assert not ok and "SOMETHING FAILED" in text and "no such kernel" in text


def test_source_tree_metadata_makes_the_entry_points_visible(tmp_path):
    """With ``python -S`` (no site-packages, so no installed tpcore) only the generated metadata can answer."""
    query = (
        "import importlib.metadata as m, json; "
        "print(json.dumps(sorted(f'{g}:{e.value}' for g in ('tpcore', 'pytest11') for e in m.entry_points(group=g))))"
    )

    def entry_points(paths: list[str]) -> list[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        done = subprocess.run([sys.executable, "-S", "-c", query], env=env, capture_output=True, text=True, check=True)
        return json.loads(done.stdout)

    paths = gpu_env.source_paths(tmp_path / "site")
    assert entry_points(paths[:-1]) == []  # the sources alone carry no metadata
    assert entry_points(paths) == [
        "pytest11:tpcore.testing.pytest_plugin",
        "tpcore:tp_audio",
        "tpcore:tp_bart",
        "tpcore:tp_bert",
        "tpcore:tp_gpt",
        "tpcore:tp_t5",
        "tpcore:tp_vision",
    ]


def test_wheels_are_taken_only_when_every_distribution_has_one(tmp_path):
    names = ["tpcore-0.1.0-py3-none-any.whl", "tp_audio-0.1.0-py3-none-any.whl", "tp_bart-0.1.0-py3-none-any.whl"]
    names += ["tp_bert-0.1.0-py3-none-any.whl", "tp_gpt-0.1.0-py3-none-any.whl"]
    for name in names:
        (tmp_path / name).touch()
    with pytest.raises(SystemExit, match="no wheel of tp-t5"):
        gpu_env._wheels(tmp_path)
    (tmp_path / "tp_t5-0.1.0-py3-none-any.whl").touch()
    with pytest.raises(SystemExit, match="no wheel of tp-vision"):
        gpu_env._wheels(tmp_path)
    (tmp_path / "tp_vision-0.1.0-py3-none-any.whl").touch()
    assert [wheel.name.split("-")[0] for wheel in gpu_env._wheels(tmp_path)] == [
        "tpcore",
        "tp_audio",
        "tp_bart",
        "tp_bert",
        "tp_gpt",
        "tp_t5",
        "tp_vision",
    ]
    assert gpu_env._wheels(tmp_path / "absent") == []


def test_scrubbed_results_name_no_path_of_this_machine():
    text = f'{ROOT}/tpcore/x.py {sys.prefix}/lib/torch hostname="{gpu_env.socket.gethostname()}"'
    assert gpu_env.scrub_paths(text) == './tpcore/x.py $PYTHON_PREFIX/lib/torch hostname="host"'
