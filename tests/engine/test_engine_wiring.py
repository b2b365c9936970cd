"""The engine is wiring: it holds a typed ``Runner`` and never probes it, its step's post-processing
is ``StepUpdater``'s (one isolation context), and the server and benchmarks ask it, not its parts,
for KV events, a prefix-cache reset and tenant names."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import pagedkv
from pagedkv import SamplingParams
from pagedkv.engine.scheduler_output import StepResult
from pagedkv.engine.sequence import SequenceGroup
from pagedkv.engine.step_update import StepUpdater
from pagedkv.kv_events import BlockStored
from pagedkv.runner import ModelRunner, Runner
from pagedkv_testing.server import tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

ENGINE = Path(pagedkv.__file__).parent / "engine"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_model_runner_implements_every_member_of_the_runner_protocol(model_dir) -> None:
    members = {name for name in dir(Runner) if not name.startswith("_")} | set(Runner.__annotations__)
    assert {"execute", "kv_groups", "payload_bytes", "model_dtype", "weights_quantization"} <= members
    missing = [name for name in members
               if not hasattr(ModelRunner, name) and name not in ("config", "lora", "write_error")]
    assert missing == []
    engine = tiny_engine(model_dir, block_size=4, num_kv_blocks=32)
    assert isinstance(engine.runner, Runner)
    runner = engine.runner
    assert runner.bytes_per_block > 0 and runner.payload_bytes >= runner.bytes_per_block
    assert runner.model_dtype == "float32" and runner.weights_quantization is None
    assert [g.window for g in runner.kv_groups] == [None]


def test_the_engine_never_probes_its_runner() -> None:
    """No getattr/hasattr anywhere in pagedkv/engine on something named runner."""
    probes = []
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and "runner" in ast.unparse(node.args[0])):
                probes.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert probes == []


def test_build_imports_nothing_from_the_engine_module() -> None:
    from pagedkv.engine import build

    tree = ast.parse(inspect.getsource(build))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "pagedkv.engine.llm_engine" not in imported


def test_kv_events_prefix_cache_reset_and_tenant_names_come_from_the_engine(model_dir) -> None:
    engine = tiny_engine(model_dir, block_size=4, num_kv_blocks=64, kv_events=True,
                         tenant_kv_quota=["team-a=0.5"], default_tenant_kv_quota=0.25)
    assert engine.tenant_names() == frozenset({"team-a"})
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = "the quick brown fox jumps over the lazy dog"
    engine.add_request("a", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    events = engine.take_kv_events()
    assert any(isinstance(e, BlockStored) for e in events)
    assert engine.take_kv_events() == []  # taken once
    engine.reset_prefix_cache()
    engine.add_request("b", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].num_cached_tokens == 0  # the reset forgot the first request's blocks
    quiet = tiny_engine(model_dir, block_size=4, num_kv_blocks=64)
    assert quiet.take_kv_events() == [] and quiet.tenant_names() == frozenset()


def test_isolate_fails_the_request_and_lets_other_work_and_interrupts_through() -> None:
    failed_now: list[str] = []

    class Scheduler:
        groups: dict = {}

        def abort(self, request_id: str, reason: str = "abort") -> None:
            failed_now.append(f"{request_id}:{reason}")

    updater = StepUpdater(None, None, None, None, None, Scheduler())  # isolate needs only the scheduler
    a, b = (SequenceGroup(rid, None, [1, 2], SamplingParams(), i) for i, rid in enumerate("ab"))
    step = StepResult()
    with updater.isolate((a,), "sampling", step) as work:
        raise ValueError("boom")
    assert work.failed and a.error == "sampling failed for this request: ValueError: boom"
    assert step.failed == [a] and list(step.progressed) == ["a"] and b.error is None
    with updater.isolate((b,), "sampling", step) as work:
        pass
    assert not work.failed and b.error is None
    with pytest.raises(KeyboardInterrupt), updater.isolate((b,), "sampling", step):
        raise KeyboardInterrupt
    assert b.error is None
    with updater.isolate((b,), "building the output", None):  # outside a step: ended at once
        raise RuntimeError("x")
    assert failed_now == ["b:error"] and b.error is not None
