"""One request's failure is that request's alone; a failed forward pass fails only its batch.

A request whose sampling, stop check or detokenization raises finishes with ``error`` set and its
blocks freed, in the same step, while every other request produces exactly the tokens of a clean
run. A forward pass that raises fails the requests of that plan; the engine keeps serving, keeps
its invariants (check_integrity after every step) and leaks no block.
"""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv_testing.server import run_engine, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

PROMPTS = [f"request {i}: the quick brown fox" for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def make_engine(model_dir):
    return tiny_engine(model_dir, block_size=4, num_kv_blocks=128, max_model_len=128, debug_integrity=True)


run = run_engine


@pytest.fixture(scope="module")
def clean(model_dir):
    return run(make_engine(model_dir), [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])


def test_a_raising_stop_check_fails_that_request_alone(model_dir, clean) -> None:
    engine = make_engine(model_dir)
    check_stop = engine.outputs.check_stop

    def flaky(group, seq, token):
        if group.request_id == "r2" and seq.num_output_tokens == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        check_stop(group, seq, token)

    engine.outputs.check_stop = flaky
    done = run(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    assert done["r2"].error and "UnicodeDecodeError" in done["r2"].error
    assert done["r2"].outputs[0].finish_reason == "error"
    for rid, out in done.items():
        if rid != "r2":
            assert out.error is None and out.outputs[0].token_ids == clean[rid].outputs[0].token_ids


def test_a_row_of_nan_logits_fails_that_request_alone(model_dir, clean) -> None:
    engine = make_engine(model_dir)
    execute = engine.runner.execute
    calls = {"n": 0}

    def poisoned(chunks, *args, **kwargs):
        logits = execute(chunks, *args, **kwargs).clone()
        calls["n"] += 1
        if calls["n"] == 4:
            logits[0] = float("nan")  # the first sequence of the fourth step
        return logits

    engine.runner.execute = poisoned
    done = run(engine, [(f"r{i}", p, SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True))
                        for i, p in enumerate(PROMPTS)])
    failed = [rid for rid, out in done.items() if out.error]
    assert len(failed) == 1 and "no finite logits" in done[failed[0]].error
    assert all(len(out.outputs[0].token_ids) == 12 for rid, out in done.items() if rid not in failed)


def test_tiny_temperature_among_others_changes_nothing(model_dir, clean) -> None:
    engine = make_engine(model_dir)
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    requests.append(("tiny-t", "x", SamplingParams(temperature=1e-40, max_tokens=4)))
    done = run(engine, requests)
    assert all(out.error is None for out in done.values())
    assert all(done[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids for rid in clean)


def test_a_failed_forward_pass_fails_its_batch_and_the_engine_goes_on(model_dir, clean) -> None:
    engine = make_engine(model_dir)
    execute = engine.runner.execute
    calls = {"n": 0}

    def broken(chunks, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward failure")
        return execute(chunks, *args, **kwargs)

    engine.runner.execute = broken
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"a{i}", p, GREEDY)
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 2:  # joins the running batch, then shares its fate in the failing step
            engine.add_request("late", PROMPTS[3], GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    failed = {rid for rid, out in done.items() if out.error}
    assert failed and all("injected forward failure" in done[r].error for r in failed)
    assert engine.stats().kv.used_blocks == 0
    # The engine keeps serving: the same prompts again give the clean run's tokens.
    again = run(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    assert all(again[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids for rid in clean)


def test_llm_generate_returns_the_failed_request_among_the_others(model_dir, clean) -> None:
    from pagedkv import LLM

    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=128, max_model_len=128)
    check_stop = llm.engine.outputs.check_stop

    def flaky(group, seq, token):
        if group.prompt == PROMPTS[1]:
            raise RuntimeError("injected")
        check_stop(group, seq, token)

    llm.engine.outputs.check_stop = flaky
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.error is not None for o in outs] == [i == 1 for i in range(len(PROMPTS))]
    assert outs[1].outputs[0].finish_reason == "error" and "injected" in outs[1].error
    for i in (0, 2, 3, 4, 5):
        assert outs[i].outputs[0].token_ids == clean[f"r{i}"].outputs[0].token_ids


def test_a_raising_output_build_fails_that_request_alone(model_dir, clean) -> None:
    """Building r3's output raises mid-run (e.g. its detokenization): r3 ends at once with the error,
    the outputs of the requests after it in the same step are still built, every other request
    produces the clean run's tokens."""
    engine = make_engine(model_dir)
    make_output = engine.outputs.make_output

    def flaky(group):
        if group.request_id == "r3" and group.error is None and group.seqs[0].num_output_tokens == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return make_output(group)

    engine.outputs.make_output = flaky
    done = run(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    assert done["r3"].error and "UnicodeDecodeError" in done["r3"].error
    assert done["r3"].outputs[0].finish_reason == "error"
    for rid, out in done.items():
        if rid != "r3":
            assert out.error is None and out.outputs[0].token_ids == clean[rid].outputs[0].token_ids


@pytest.mark.parametrize("num_blocks,faults", [(28, "seed=2,rate=0.6,kinds=swap+evict"),
                                               (40, "seed=5,rate=0.5,kinds=swap"),
                                               (24, "seed=1,rate=0.4,kinds=swap+recompute")])
def test_a_failed_swap_in_leaves_no_stale_prefix_in_the_cache(model_dir, clean, num_blocks, faults) -> None:
    """swap_in registers its blocks in the prefix cache when planned: after the copy fails, the
    same prompts run again must not hit those (undefined) blocks."""
    engine = tiny_engine(model_dir, block_size=4, num_kv_blocks=num_blocks, max_model_len=128,
                         debug_integrity=True, preemption_mode="swap", fault_injection=faults)
    swap_in = engine.runner.swap_in
    calls = {"n": 0}

    def broken(pairs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected swap-in failure")
        return swap_in(pairs)

    engine.runner.swap_in = broken
    first = run(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    assert calls["n"] >= 1 and any(out.error for out in first.values())
    again = run(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    assert all(again[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids for rid in clean)
