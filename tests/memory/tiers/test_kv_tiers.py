"""The KV tiers end to end: the disk tier below the host tier, wired into the memory core, the
scheduler and the engine; persistence across restarts; faults of the disk; reload or recompute
by measured cost; preemption_mode=auto and its thrash guard; the bounded offload queue.

Every output is compared with a run that has no tiers at all (greedy, identical tokens), and KV
reloaded from disk with the bytes the first run computed.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.cli import main as cli_main
from pagedkv.engine import LLMEngine
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.engine.sequence import Sequence, SequenceGroup
from pagedkv.memory import KVCacheManager
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.errors import OutOfBlocksError
from pagedkv.memory.prefix_hash import chain_hashes, root_hash
from pagedkv.memory.tiers.costs import DISK_READ, HOST_READ, HOST_WRITE, TierCosts
from pagedkv.memory.tiers.disk import DiskTier
from pagedkv.memory.tiers.disk_files import DiskTierError
from pagedkv.memory.tiers.disk_store import DiskStore
from pagedkv.memory.tiers.host import HostTier
from pagedkv_testing.hf_checkpoints import make_hf_checkpoint

B = 4
PREFIX = [(7 * i + 3) % 97 + 5 for i in range(48)]  # 12 blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_hf_checkpoint(tmp_path_factory.mktemp("tiers"), "llama", seed=5))


def _prompts(n: int = 4) -> list[list[int]]:
    return [PREFIX + [200 + 3 * i, 201 + i, 150 + i] for i in range(n)]


def _options(**kw):
    return {"block_size": B, "num_kv_blocks": 40, "kv_offloading_size": 0.002, "debug_integrity": True, **kw}


@pytest.fixture(scope="module")
def reference(model):
    llm = LLM(model, block_size=B, num_kv_blocks=200, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]


def _run(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]


def _warm(model: str, kv_dir, **kw) -> None:
    with LLM(model, **_options(kv_offload_dir=str(kv_dir), **kw)) as llm:
        _run(llm)


def _block_files(kv_dir) -> list:
    return sorted((kv_dir / "blocks").glob("*/*.kvb"))


def test_restart_hits_from_disk_with_the_same_bytes_and_outputs(model, reference, tmp_path):
    kv_dir = tmp_path / "kv"
    first = LLMEngine.from_options(model, **_options(kv_offload_dir=str(kv_dir)))
    first.add_request("a", _prompts(1)[0], GREEDY)
    while first.has_unfinished_requests():
        first.step()
    hashes = chain_hashes(root_hash(None, None), PREFIX, B, 0, len(PREFIX) // B)
    cached = [first.kv.pool.cached[h].block_id for h in hashes]
    computed = first.runner.block_payloads(cached)
    first.close()
    assert len(_block_files(kv_dir)) >= len(hashes)

    with LLM(model, **_options(kv_offload_dir=str(kv_dir))) as second:
        assert _run(second) == reference
        s = second.stats().kv
        assert s.disk_hit_tokens == len(PREFIX) and s.tier_hit_tokens["disk"] == len(PREFIX)
        assert s.host_hit_tokens >= len(PREFIX)  # disk -> host -> device
        reloaded = [second.engine.kv.pool.cached[h].block_id for h in hashes]
        assert second.engine.runner.block_payloads(reloaded) == computed  # bit-identical KV
        costs = second.stats().tier_costs
        assert costs["decisions_disk_reload"] >= 1 and costs["disk_read_s_per_block"] is not None


def test_eviction_writes_through_to_disk_and_reloads(model, reference, tmp_path):
    """No restart: a small device and host pool evict the prefix; the disk brings it back."""
    kv_dir = tmp_path / "kv"
    with LLM(model, **_options(kv_offload_dir=str(kv_dir), num_kv_blocks=24)) as llm:
        assert _run(llm) == reference
        other = [[(11 * i + j) % 90 + 3 for j in range(60)] for i in range(6)]
        llm.generate(other, GREEDY)  # pushes the prefix out of the device and the tiny host tier
        llm.engine.kv.host_pool.evict_cached()
        assert llm.engine.kv.disk.flush(timeout=30)
        before = llm.stats().kv.disk_hit_tokens
        assert _run(llm) == reference
        s = llm.stats().kv
        assert s.disk_hit_tokens > before and s.disk_bytes_written > 0 and s.disk_writes_dropped == 0


@pytest.mark.parametrize("change", [{"kv_cache_dtype": "bfloat16"}, {"dtype": "bfloat16"}])
def test_changed_fingerprint_is_ignored_and_said(model, tmp_path, caplog, change):
    kv_dir = tmp_path / "kv"
    _warm(model, kv_dir)
    # the same engine without a disk tier: 16-bit numerics depend on how the steps batch the work
    want = _run(LLM(model, **_options(**change)))
    with caplog.at_level(logging.WARNING):
        with LLM(model, **_options(kv_offload_dir=str(kv_dir), **change)) as llm:
            assert _run(llm) == want
            assert llm.stats().kv.disk_hit_tokens == 0
    assert any("removed" in r.message and "another setup" in r.message for r in caplog.records)


def test_other_weights_change_the_fingerprint(tmp_path):
    from pagedkv.models.identity import model_identity

    a = make_hf_checkpoint(tmp_path / "a", "llama", seed=1)
    b = make_hf_checkpoint(tmp_path / "b", "llama", seed=2)
    assert model_identity(a)["weights"] != model_identity(b)["weights"]
    assert model_identity(a) == model_identity(a)


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_damaged_block_files_fall_back_to_recompute(model, reference, tmp_path, damage):
    kv_dir = tmp_path / "kv"
    _warm(model, kv_dir)
    files = _block_files(kv_dir)
    for path in files:
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-3] ^= 0x01
        elif damage == "truncate":
            data = data[:len(data) // 2]
        else:  # another block's file under this name
            data = bytearray(files[0].read_bytes()) if path != files[0] else bytearray(files[1].read_bytes())
        path.write_bytes(bytes(data))
    with LLM(model, **_options(kv_offload_dir=str(kv_dir))) as llm:
        assert _run(llm) == reference
        s = llm.stats().kv
        assert s.disk_corrupt_discarded >= 1 and s.disk_hit_tokens == 0


def test_missing_directory_stops_offload_and_serving_goes_on(model, reference, tmp_path, caplog):
    import shutil

    kv_dir = tmp_path / "kv"
    with LLM(model, **_options(kv_offload_dir=str(kv_dir), num_kv_blocks=24)) as llm:
        shutil.rmtree(kv_dir)
        with caplog.at_level(logging.WARNING):
            assert _run(llm) == reference
            llm.generate([[(5 * j) % 80 + 2 for j in range(70)]], GREEDY)  # evicts: writes fail
            llm.engine.kv.disk.flush(timeout=30)
            assert _run(llm) == reference
        s = llm.stats().kv
        assert not s.disk_enabled and s.disk_write_errors >= 1


def test_full_disk_and_other_tier_faults_keep_outputs(model, reference, tmp_path):
    kv_dir = tmp_path / "kv"
    _warm(model, kv_dir)
    faults = "seed=3,rate=0.5,kinds=recompute+evict+disk_read+disk_corrupt+disk_slow+disk_full"
    with LLM(model, **_options(kv_offload_dir=str(kv_dir), num_kv_blocks=24, fault_injection=faults)) as llm:
        for _ in range(3):
            assert _run(llm) == reference
        fired = llm.engine.faults.fired
        assert sum(fired[k] for k in ("disk_read", "disk_corrupt", "disk_slow")) >= 1
    # a disk that is full from the first write: offload stops, serving and reads go on
    faults = "seed=1,rate=1.0,kinds=disk_full"
    with LLM(model, **_options(kv_offload_dir=str(tmp_path / "full"), num_kv_blocks=24,
                               fault_injection=faults)) as llm:
        assert _run(llm) == reference
        llm.generate([[(5 * j) % 80 + 2 for j in range(70)]], GREEDY)
        llm.engine.kv.disk.flush(timeout=30)
        assert _run(llm) == reference
        s = llm.stats().kv
        assert s.disk_write_errors >= 1 and not s.disk_enabled and s.disk_blocks == 0


def test_second_engine_on_one_directory_gets_a_clear_error(model, tmp_path):
    kv_dir = tmp_path / "kv"
    with LLM(model, **_options(kv_offload_dir=str(kv_dir))):
        with pytest.raises(DiskTierError, match="in use by another pagedkv engine"):
            LLM(model, **_options(kv_offload_dir=str(kv_dir)))
    with LLM(model, **_options(kv_offload_dir=str(kv_dir))):  # free again once closed
        pass


def test_directory_writable_by_others_is_refused(model, tmp_path):
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    os.chmod(kv_dir, 0o777)
    with pytest.raises(DiskTierError, match="writable"):
        LLM(model, **_options(kv_offload_dir=str(kv_dir)))


def test_files_are_private_and_the_clear_command_empties_the_directory(model, tmp_path, capsys):
    kv_dir = tmp_path / "kv"
    _warm(model, kv_dir)
    files = _block_files(kv_dir)
    assert files and (kv_dir.stat().st_mode & 0o777) == 0o700
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    assert cli_main(["kv-cache", "info", str(kv_dir)]) == 0
    assert f"{len(files)} KV block file(s)" in capsys.readouterr().out
    with LLM(model, **_options(kv_offload_dir=str(kv_dir))):  # in use: refused, nothing removed
        assert cli_main(["kv-cache", "clear", str(kv_dir)]) == 2
        assert "another pagedkv engine" in capsys.readouterr().err
    assert cli_main(["kv-cache", "clear", str(kv_dir)]) == 0
    assert _block_files(kv_dir) == [] and not (kv_dir / "fingerprint.json").exists()
    assert cli_main(["kv-cache", "clear", str(tmp_path / "nope")]) == 2


def test_options_are_checked():
    from pagedkv.engine.config import EngineConfig

    with pytest.raises(ValueError, match="give kv_offload_dir"):
        EngineConfig(kv_offload_disk_size="1GiB")
    with pytest.raises(ValueError, match="kv_offloading_size > 0"):
        EngineConfig(kv_offload_dir="/tmp/x", kv_offloading_size=0)
    with pytest.raises(ValueError, match="kv_offload_disk_size"):
        EngineConfig(kv_offload_dir="/tmp/x", kv_offload_disk_size="lots")
    assert EngineConfig(kv_offload_dir="/tmp/x").disk_tier_bytes == 20 << 30
    assert EngineConfig(kv_offload_dir="/tmp/x", kv_offload_disk_size="1MiB").disk_tier_bytes == 1 << 20
    assert EngineConfig().preemption_mode == "auto"


# ---------------------------------------------------------------------- the memory core with a disk


class _Runner:
    """Plays the runner for the memory core: a block's payload is its key, so a load proves that
    the right bytes reached the right host block."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.host: dict[int, bytes] = {}

    def step(self) -> None:
        copies = self.kv.take_tier_copies()
        for _, key in copies.to_disk:
            self.kv.disk.offer_write(key, b"kv:" + key)
        for host_id, payload in copies.from_disk:
            self.host[host_id] = payload
        for host_id, _ in copies.reloads:
            key = self.kv.host_pool.blocks[host_id].block_hash
            assert self.host.get(host_id, b"kv:" + key) == b"kv:" + key
        self.kv.finish_step()
        self.kv.check_integrity()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_operations_over_three_tiers_keep_integrity(tmp_path, seed):
    rng = random.Random(seed)
    store = DiskStore(tmp_path / "kv", 40 * 80, {"m": "x"})
    kv = KVCacheManager(8, B, num_host_blocks=4, offload_to_host=True, disk=store, disk_write_queue=8)
    runner = _Runner(kv)
    live: list[str] = []
    for step in range(300):
        op = rng.random()
        if op < 0.45:
            sid = f"s{step}"
            tokens = [rng.randrange(3) for _ in range(rng.randint(2, 20))]
            for _ in range(200):  # wait for its disk reads, as the scheduler does
                if not kv.prefetch(sid, tokens):
                    break
                runner.step()
                time.sleep(0.002)
            try:
                cached = kv.allocate_prompt(sid, tokens)
            except OutOfBlocksError:
                kv.forget(sid)
            else:
                kv.mark_computed(sid, len(tokens) - cached)
                live.append(sid)
        elif op < 0.8 and live:
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            kv.evict_cached(rng.choice([None, 1, 3]))
        runner.step()
        assert kv.disk.store.stats().bytes_used <= 40 * 80
    kv.disk.close()


def test_full_offload_queue_drops_and_never_stalls(tmp_path):
    store = DiskStore(tmp_path / "kv", 1 << 20, {"m": "x"})
    gate = threading.Event()
    real_put = store.put

    def slow_put(key, payload):
        gate.wait(30)
        return real_put(key, payload)

    store.put = slow_put
    disk = DiskTier(store, host=HostTier(BlockPool(4, name="host")), costs=TierCosts(B), block_size=B,
                    max_queued_writes=2)
    results: list[bool] = []
    offers = threading.Thread(target=lambda: results.extend(disk.offer_write(bytes([i]) * 8, b"x" * 100)
                                                            for i in range(10)))
    offers.start()
    offers.join(8)  # the disk is held until the gate opens: an offer that waited for it is still waiting
    assert not offers.is_alive() and len(results) == 10
    assert results.count(True) <= 3 and disk.io_stats().writes_dropped >= 7
    gate.set()
    assert disk.flush(timeout=10)
    disk.close()


# ---------------------------------------------------------------------- costs, auto preemption, thrash guard


def test_reload_or_recompute_follows_the_measured_costs():
    costs = TierCosts(block_size=16)
    assert costs.reload_cheaper("host", 4)  # nothing measured yet: reload
    costs.observe_prefill(1000, 1.0)  # 1 ms per token: 16 ms per block
    costs.observe(HOST_READ, 10, 0.001)
    costs.observe(DISK_READ, 10, 0.01)
    assert costs.reload_cheaper("host", 4) and costs.reload_cheaper("disk", 4)
    costs.observe(DISK_READ, 1, 1.0)  # a very slow disk
    costs.observe(DISK_READ, 1, 1.0)
    assert costs.reload_cheaper("host", 4) and not costs.reload_cheaper("disk", 4)
    d = costs.as_dict()
    assert d["decisions_disk_recompute"] == 1 and d["decisions_host_reload"] == 3
    assert d["prefill_tokens_per_s"] == pytest.approx(1000.0)


def _group(rid: str, n_prompt: int, arrival: int) -> SequenceGroup:
    ids = [(arrival * 31 + i) % 50 + 1 for i in range(n_prompt)]
    g = SequenceGroup(rid, None, ids, SamplingParams(max_tokens=50), arrival, max_tokens=50)
    g.seqs.append(Sequence(f"{rid}#0", 0, n_prompt, list(ids)))
    return g


def _step(sched: Scheduler) -> None:
    """Run one plan as the engine would: its tokens computed, and a token sampled for each
    sequence whose chunk reached its end."""
    from pagedkv.engine.scheduler import StepResult

    out = sched.schedule()
    sched.update_from_output(out, StepResult())
    for s in out.scheduled:
        if s.samples:
            s.seq.token_ids.append(1)
    return out


@pytest.mark.parametrize("fast_copies", [True, False])
def test_auto_preemption_picks_the_cheaper_of_swap_and_recompute(fast_copies):
    kv = KVCacheManager(10, B, num_host_blocks=20)
    costs = kv.costs
    costs.observe_prefill(1000, 1.0)  # 1 ms per token
    per_block = 1e-5 if fast_copies else 1.0  # a copy far cheaper (or dearer) than 4 tokens' prefill
    costs.observe(HOST_WRITE, 1, per_block)
    costs.observe(HOST_READ, 1, per_block)
    sched = Scheduler(SchedulerConfig(8, 64, "auto"), kv)
    for i in range(2):
        sched.add(_group(f"r{i}", 15, i))  # 4 blocks each, growing
    for _ in range(8):
        _step(sched)
        kv.check_integrity()
    mode = "swap" if fast_copies else "recompute"
    assert sched.preemptions[mode] >= 1 and sched.preemptions["swap" if mode == "recompute" else "recompute"] == 0
    assert costs.decisions[f"preempt_{mode}"] >= 1


def test_thrash_guard_skips_a_victim_that_has_not_progressed():
    kv = KVCacheManager(64, B)
    sched = Scheduler(SchedulerConfig(8, 256, "recompute"), kv)
    a, b, c = _group("a", 8, 0), _group("b", 8, 1), _group("c", 8, 2)
    for g in (a, b, c):
        sched.add(g)
    _step(sched)
    assert [g.request_id for g in sched.running] == ["a", "b", "c"]
    c.preempted_at = c.total_tokens  # c was just preempted and has not sampled since
    assert c.preemption_guarded and sched._victim(a) is b and sched.thrash_guarded == 1
    b.preempted_at = b.total_tokens
    assert sched._victim(a) is None  # only guarded requests are left: a preempts itself
    c.seqs[0].token_ids.append(3)  # c progressed: it may be preempted again
    assert not c.preemption_guarded and sched._victim(a) is c


def test_thrash_guard_under_pressure_keeps_every_request_progressing(model):
    """A pool so small that requests preempt each other all the time: every request finishes,
    with the outputs of an unpressured run, and no request is preempted twice without a token
    in between."""
    prompts = [[(13 * i + j) % 70 + 4 for j in range(14 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = LLM(model, block_size=B, num_kv_blocks=200)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    # chunked prefills of 6 tokens: a re-admitted request needs steps before it samples again
    llm = LLM(model, block_size=B, num_kv_blocks=12, max_num_batched_tokens=6, preemption_mode="recompute",
              debug_integrity=True)
    sched = llm.engine.scheduler
    real_preempt, real_schedule = sched._preempt, sched._schedule_running
    marks: dict[str, int] = {}
    growing: list = [None]  # the request being planned: it may preempt itself, guarded or not

    def schedule_running(group, *args):
        growing[0] = group
        return real_schedule(group, *args)

    def preempt(group, mode, swap_out, preempted):
        if marks.get(group.request_id) == group.total_tokens:
            assert group is growing[0], f"{group.request_id} preempted again without progress"
        marks[group.request_id] = group.total_tokens
        real_preempt(group, mode, swap_out, preempted)

    sched._preempt, sched._schedule_running = preempt, schedule_running
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    s = llm.stats()
    assert s.preemptions_recompute + s.preemptions_swap >= 3 and s.thrash_guarded >= 1


def test_the_end_of_a_python_process_that_used_llm_writes_the_disk_tier(model, tmp_path):
    import subprocess
    import sys

    kv_dir = tmp_path / "kv"
    script = (f"from pagedkv import LLM, SamplingParams\n"
              f"llm = LLM({model!r}, block_size={B}, num_kv_blocks=40, kv_offloading_size=0.002, "
              f"kv_offload_dir={str(kv_dir)!r})\n"
              f"llm.generate([{PREFIX + [1, 2, 3]!r}], SamplingParams(max_tokens=2))\n")  # no close()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert len(_block_files(kv_dir)) >= len(PREFIX) // B


def test_disk_reads_happen_before_admission_while_others_keep_decoding(model, reference, tmp_path):
    kv_dir = tmp_path / "kv"
    _warm(model, kv_dir)
    engine = LLMEngine.from_options(model, **_options(kv_offload_dir=str(kv_dir)))
    disk = engine.kv.disk.store
    real_get = disk.get

    def slow_get(key):
        time.sleep(0.05)
        return real_get(key)

    disk.get = slow_get
    engine.add_request("busy", [9, 8, 7, 6, 5], SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
    engine.step()
    engine.add_request("cached", _prompts(1)[0], GREEDY)
    decoded_while_waiting = 0
    outputs = {}
    while "cached" not in outputs or not outputs["cached"].finished:
        for out in engine.step():
            outputs[out.request_id] = out
        group = engine.scheduler.groups.get("cached")
        if group is not None and group.status.value == "waiting":
            decoded_while_waiting += 1
    assert decoded_while_waiting >= 3  # 12 reads of 50 ms: the busy request decoded meanwhile
    assert outputs["cached"].outputs[0].token_ids == reference[0]
    assert outputs["cached"].num_cached_tokens == len(PREFIX)  # all of it from disk, none recomputed
    engine.close()
