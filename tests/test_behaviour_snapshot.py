"""scripts/behaviour_snapshot.py: two runs of the same code give the same snapshot (a reduced case
list: forks, preemption with fault injection and the host tier), its compare mode reports a changed
token id or counter and exits 1, and the key map turns a renamed stats field back into its base name.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest


def _load_script() -> ModuleType:
    here = Path(__file__).resolve()
    root = next(p for p in here.parents if (p / "scripts" / "behaviour_snapshot.py").is_file())
    spec = importlib.util.spec_from_file_location("behaviour_snapshot", root / "scripts" / "behaviour_snapshot.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


snap = _load_script()

CASES = ["n_best", "faults"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    return [snap.snapshot(CASES, workdir=tmp_path_factory.mktemp(f"run{i}")) for i in range(2)]


def test_two_runs_are_equal(two_runs):
    first, second = two_runs
    assert set(first) == set(CASES)
    assert snap.differences(first, second) == []
    faults = first["faults"]["seed=1,rate=0.15"]["stats"]
    assert faults["faults_fired"] > 0 and faults["preemptions_recompute"] > 0  # the case does what it says
    assert not any(key.startswith("step_costs.s_per_") for key in faults)  # timings left out


def test_compare_reports_a_changed_token_and_counter(two_runs, tmp_path, capsys):
    first, _ = two_runs
    a, b, same = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "same.json"
    a.write_text(json.dumps({"cases": first}))
    same.write_text(json.dumps({"cases": first, "meta": {"pagedkv": "elsewhere"}}))  # meta is not compared
    changed = json.loads(json.dumps(first))
    changed["n_best"]["requests"][1]["outputs"][2]["token_ids"][3] += 1
    changed["faults"]["seed=4,rate=0.3"]["stats"]["num_steps"] += 1
    b.write_text(json.dumps({"cases": changed}))

    assert snap.main(["--compare", str(a), str(same)]) == 0
    assert "equal" in capsys.readouterr().out
    assert snap.main(["--compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "n_best.requests[1].outputs[2].token_ids[3]:" in out
    assert "faults.seed=4,rate=0.3.stats.num_steps:" in out
    assert "2 difference(s)" in out


def test_key_map_gives_base_names_and_drops_timings(monkeypatch):
    monkeypatch.setattr(snap, "KEY_MAP", {"kv.hit_tokens": "kv.prefix_hit_tokens", "kv.tiers": "kv.tier"})
    stats = SimpleNamespace(as_dict=lambda: {
        "kv": {"hit_tokens": 12, "tiers": {"disk": 3}, "disk_queue_depth": 5},
        "step_costs": {"s_per_token": 0.001, "steps_observed": 4, "mean_error_factor": 1.2},
        "tier_costs": {"host_read_s_per_block": 1e-5, "decisions_host_reload": 2}, "num_steps": 9})
    assert snap.record_stats(stats) == {"kv.prefix_hit_tokens": 12, "kv.tier.disk": 3, "num_steps": 9,
                                        "step_costs.steps_observed": 4, "tier_costs.decisions_host_reload": 2}
    assert "num_steps" not in snap.record_stats(stats, disk_reads=True)
