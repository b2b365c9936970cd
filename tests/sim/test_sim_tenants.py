"""Tenants in the simulator: per-tenant hit rate and latency, KV quotas, admission as the engine's.

The noisy-neighbour trace: a quiet tenant sends a short question behind a shared 384-token system
prompt every 40 steps; a noisy tenant sends bursts of 10 long, distinct prompts every 50 steps,
enough to churn the whole pool between two quiet requests. Without a quota the noisy bursts evict
the quiet system prompt and queue ahead of the quiet requests; with ``noisy=0.5`` the quiet
tenant's hit rate and latency stay those it has alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.sim.cli import main
from pagedkv.sim.metrics import PolicyResult, TenantAccumulator, TenantResult
from pagedkv.sim.policies import PolicySpec
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.workload import (
    Request,
    TenantSpec,
    generate_tenant_workload,
    load_trace,
    parse_tenant_spec,
    prefix_tokens,
)
from pagedkv.workloads import SHAREGPT, WorkloadConfig

QUIET = "quiet:requests=20,every=40,prefix=384,prompt=fixed:16,output=fixed:8"
NOISY = "noisy:requests=160,every=50,start=5,burst=10,prompt=fixed:400,output=fixed:48"
PAGED_PREFIX = PolicySpec("paged", 16, prefix=True)


def _run(requests: list[Request], quotas: tuple[tuple[str, float], ...] = (), default: float | None = None,
         spec: PolicySpec = PAGED_PREFIX, capacity: int = 4096, check: bool = False,
         watermark: float = 0.01) -> PolicyResult:
    config = SimConfig(capacity=capacity, max_model_len=2048, tenant_quotas=quotas, default_tenant_quota=default,
                       check_integrity=check, max_steps=20_000, watermark=watermark)
    result = simulate(requests, spec, config)
    assert result.completed + result.rejected == len(requests)
    return result


def _tenant(result: PolicyResult, name: str) -> TenantResult:
    assert result.tenants is not None
    return result.tenants[name]


def _noisy_neighbour() -> list[Request]:
    return generate_tenant_workload([parse_tenant_spec(QUIET), parse_tenant_spec(NOISY)],
                                    WorkloadConfig(SHAREGPT, max_model_len=2048))


def test_noisy_neighbour_a_quota_keeps_the_quiet_tenants_hit_rate_and_latency() -> None:
    requests = _noisy_neighbour()
    alone = _tenant(_run([r for r in requests if r.tenant == "quiet"]), "quiet")
    shared = _run(requests)
    quota = _run(requests, quotas=(("noisy", 0.5),), check=True)
    quiet, quiet_q = _tenant(shared, "quiet"), _tenant(quota, "quiet")
    noisy, noisy_q = _tenant(shared, "noisy"), _tenant(quota, "noisy")

    # Alone: every quiet request but the first hits the 384-token system prompt (24 of 25 blocks).
    assert alone.prefix_hit_rate == pytest.approx(19 / 20 * 384 / 400)
    assert alone.p95_latency == 8 and alone.p95_ttft == 1  # never waits: output_len steps
    # Without a quota the noisy bursts evict the quiet prefix and queue ahead of quiet requests.
    assert quiet.prefix_hit_rate is not None and quiet.prefix_hit_rate < 0.5 * alone.prefix_hit_rate
    assert quiet.mean_latency is not None and quiet.mean_latency > 3 * 8
    assert noisy.quota_waits == 0
    # With noisy=0.5 the quiet tenant keeps its own level; the noisy tenant waits on its quota.
    assert quiet_q.prefix_hit_rate is not None and quiet_q.prefix_hit_rate >= 0.9 * alone.prefix_hit_rate
    assert quiet_q.mean_latency is not None and quiet_q.mean_latency <= 1.1 * alone.mean_latency
    assert quiet_q.p95_ttft == 1
    assert noisy_q.quota_waits > 0 and noisy_q.mean_latency > noisy.mean_latency
    assert (quiet.completed, noisy.completed, quiet_q.completed, noisy_q.completed) == (20, 160, 20, 160)
    assert noisy.prefix_hit_rate == 0.0  # distinct prompts, and never the quiet tenant's prefix


def test_quota_refusal_skips_to_other_tenants_but_a_shortage_blocks_the_line() -> None:
    # Noisy A takes 13 blocks of 16 tokens, noisy B 13 more; quiet C (2 blocks) is queued behind B.
    requests = [Request(0, list(range(1, 201)), 100, tenant="noisy"),
                Request(1, list(range(300, 500)), 100, tenant="noisy"),
                Request(2, list(range(600, 632)), 4, tenant="quiet")]
    roomy = _run(requests, capacity=1024)  # 64 blocks: all three run at once
    skipped = _run(requests, quotas=(("noisy", 0.25),), capacity=1024, check=True)  # B: past noisy's 16
    blocked = _run(requests, capacity=384)  # 24 blocks: B does not fit, C waits behind it
    assert _tenant(roomy, "noisy").p95_latency == 100 and _tenant(roomy, "quiet").mean_ttft == 1
    # The quota holds B back until A is done, and C is admitted past it in the same step.
    assert _tenant(skipped, "noisy").p95_latency == 200 and _tenant(skipped, "noisy").quota_waits == 100
    assert _tenant(skipped, "quiet").mean_ttft == 1 and _tenant(skipped, "quiet").mean_latency == 4
    # A plain shortage keeps head-of-line blocking: C waits for B, which waits for A.
    assert _tenant(blocked, "quiet").mean_ttft is not None and _tenant(blocked, "quiet").mean_ttft > 50
    assert _tenant(blocked, "noisy").quota_waits == 0


def test_a_tenant_at_its_quota_preempts_only_its_own_work() -> None:
    # 64 blocks; a quiet request leaves its 400-token system prompt cached, then two noisy requests
    # and a quiet one grow until only that cache is free. Without a quota noisy evicts it; with
    # noisy=0.25 noisy may not take it: its own latest request gives way, and the quiet request that
    # comes back for the system prompt still finds it.
    system = list(range(5000, 5400))
    requests = [Request(0, system, 1, tenant="quiet"),
                Request(1, list(range(1, 101)), 200, tenant="noisy", arrival_step=2),
                Request(2, list(range(200, 300)), 200, tenant="noisy", arrival_step=3),
                Request(3, list(range(400, 464)), 200, tenant="quiet", arrival_step=4),
                Request(4, system + list(range(600, 616)), 4, tenant="quiet", arrival_step=150)]
    shared = _run(requests, capacity=1024)
    shared_hits = _tenant(shared, "quiet").hit_tokens
    assert shared.preemptions == 0 and shared_hits < 200
    for fraction in (0.25, 0.5):
        # (At 0.5 noisy meets its quota at exactly its limit, not over it: only the own-tenant rule
        # keeps the latest request, the quiet one, from being preempted.)
        quota = _run(requests, quotas=(("noisy", fraction),), capacity=1024, check=True)
        assert _tenant(quota, "noisy").preemptions >= 1 and _tenant(quota, "quiet").preemptions == 0
        assert _tenant(quota, "quiet").hit_tokens >= shared_hits + 128


def test_a_shortage_preempts_work_over_quota_first() -> None:
    # 48 blocks fill up with quiet Q, noisy A and quiet Q2 (in arrival order); Q needs a block.
    # Without quotas the latest request (Q2) gives way; with noisy=0.25, A (over its quota) does.
    requests = [Request(0, list(range(1, 101)), 250, tenant="quiet"),
                Request(1, list(range(200, 300)), 250, tenant="noisy", arrival_step=1),
                Request(2, list(range(400, 500)), 250, tenant="quiet", arrival_step=2)]
    paged = PolicySpec("paged", 16)
    shared = _run(requests, spec=paged, capacity=768, watermark=0.05)
    quota = _run(requests, quotas=(("noisy", 0.25),), spec=paged, capacity=768, watermark=0.05, check=True)
    assert (_tenant(shared, "quiet").preemptions, _tenant(shared, "noisy").preemptions) == (1, 0)
    assert (_tenant(quota, "quiet").preemptions, _tenant(quota, "noisy").preemptions) == (0, 1)
    assert _tenant(quota, "quiet").p95_latency == 250  # both quiet requests ran straight through


def test_a_waiting_tenant_within_its_quota_preempts_work_over_quota() -> None:
    # Noisy A grows alone past half the pool; quiet Q (10 blocks) arrives when 7 are free.
    requests = [Request(0, list(range(1, 101)), 380, tenant="noisy"),
                Request(1, list(range(1000, 1150)), 4, tenant="quiet", arrival_step=300)]
    only_noisy = _run(requests, quotas=(("noisy", 0.5),), spec=PolicySpec("paged", 16), capacity=512)
    both = _run(requests, default=0.5, spec=PolicySpec("paged", 16), capacity=512, check=True)
    assert _tenant(only_noisy, "quiet").mean_ttft == 81  # no quota of its own: waits for A to finish
    assert _tenant(both, "quiet").mean_ttft == 1 and _tenant(both, "noisy").preemptions == 1


def test_requests_larger_than_their_quota_still_finish() -> None:
    # Each tenant's request exceeds its quota and both do not fit together: they run one after the
    # other instead of preempting each other every step.
    requests = [Request(0, list(range(1, 377)), 20, tenant="a"), Request(1, list(range(1000, 1700)), 20, tenant="b")]
    result = _run(requests, quotas=(("a", 0.1), ("b", 0.5)), spec=PolicySpec("paged", 16), capacity=1024, check=True)
    assert (result.completed, result.preemptions) == (2, 0)
    # The same with three samples each, whose first sequence alone would fit the quota.
    requests = [Request(0, list(range(1, 101)), 300, n=3, tenant="a"),
                Request(1, list(range(1000, 1015)), 300, n=3, tenant="b", arrival_step=18)]
    config = SimConfig(capacity=1024, max_model_len=1024, tenant_quotas=(("a", 0.5),), default_tenant_quota=0.25,
                       max_steps=3000)
    assert simulate(requests, PolicySpec("paged", 4, cow=True), config).completed == 2
    # Alone but unable to grow under its quota (the pool is another tenant's cache): rejected, not looped on.
    requests = [Request(0, list(range(1, 17)), 1, tenant="b"), Request(1, list(range(100, 113)), 10, tenant="a",
                                                                       arrival_step=5)]
    config = SimConfig(capacity=32, max_model_len=64, tenant_quotas=(("a", 0.5),), watermark=0.0, max_steps=1000)
    result = simulate(requests, PolicySpec("paged", 4, prefix=True), config)
    assert (_tenant(result, "a").rejected, _tenant(result, "b").completed) == (1, 1)
    # Samples that together exceed the quota (n > 1, no CoW): rejected, not waited on forever.
    requests = [Request(0, list(range(1, 401)), 5, n=3, tenant="a")]  # 3 x 25 blocks of 256
    result = _run(requests, quotas=(("a", 0.25),), spec=PolicySpec("paged", 16), capacity=4096)
    assert result.rejected == 1
    assert _run(requests, quotas=(("a", 0.3),), spec=PolicySpec("paged", 16)).completed == 1
    assert _run(requests, quotas=(("a", 0.25),), spec=PolicySpec("paged", 16, cow=True)).completed == 1


def test_per_tenant_metrics_in_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--quiet", "--kv-tokens", "4096", "--policies", "contiguous-oracle,paged+prefix@16",
            "--tenant", QUIET.replace("requests=20", "requests=6"),
            "--tenant", NOISY.replace("requests=160", "requests=30")]
    assert main([*args, "--json", "--tenant-kv-quota", "noisy=0.5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workload"]["tenants"] == {"quiet": 6, "noisy": 30}
    assert data["tenant_kv_quotas"] == {"noisy": 0.5} and data["default_tenant_kv_quota"] is None
    oracle, paged = data["policies"]
    assert set(paged["tenants"]) == set(oracle["tenants"]) == {"quiet", "noisy"}
    for key in ("requests", "completed", "prefix_hit_rate", "mean_latency", "p50_latency", "p95_latency",
                "mean_ttft", "p95_ttft", "preemptions", "quota_waits"):
        assert key in paged["tenants"]["quiet"]
    assert oracle["tenants"]["quiet"]["prefix_hit_rate"] is None  # no prefix cache
    assert 0.5 < paged["tenants"]["quiet"]["prefix_hit_rate"] < 1.0
    assert oracle["tenants"]["noisy"]["quota_waits"] == 0 < paged["tenants"]["noisy"]["quota_waits"]
    assert paged["tenants"]["noisy"]["completed"] == 30 and paged["tenants"]["quiet"]["p95_latency"] == 8

    assert main(args) == 0
    out = capsys.readouterr().out
    assert "per tenant" in out and "KV quotas: none" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("paged+prefix@16 ")]
    assert [row[1] for row in rows[1:]] == ["noisy", "quiet"]  # the policy row, then one per tenant


def test_trace_csv_with_tenant_column(tmp_path: Path) -> None:
    path = tmp_path / "tenants.csv"
    path.write_text("tenant,arrival_step,prompt_len,output_len,prefix_id\n"
                    "quiet,0,100,8,1\n"
                    "noisy,5,400,48,\n"
                    ",7,50,4,\n"
                    "quiet,40,100,8,1\n")
    cfg = WorkloadConfig(SHAREGPT, max_model_len=2048, prefix_len=64, rate=0.01)
    reqs = load_trace(path, cfg)
    assert [(r.tenant, r.arrival_step, r.prompt_len, r.output_len) for r in reqs] == \
           [("quiet", 0, 100, 8), ("noisy", 5, 400, 48), (None, 7, 50, 4), ("quiet", 40, 100, 8)]
    assert reqs[0].prompt[:64] == reqs[3].prompt[:64] == prefix_tokens(1, 64)
    # Positional: prompt_len,output_len,n,beam_width,prefix_id,tenant,arrival_step; old rows still parse.
    path.write_text("prompt_len,output_len\n100,8,1,1,1,quiet,3\n50,4\n60,4,,,,noisy\n")
    reqs = load_trace(path, WorkloadConfig(SHAREGPT))
    assert [(r.tenant, r.arrival_step, r.prompt_len) for r in reqs] == [("quiet", 3, 100), (None, 0, 50),
                                                                          ("noisy", 0, 60)]
    result = _run(reqs)
    assert result.tenants is not None and set(result.tenants) == {"quiet", "noisy", "default"}
    assert result.tenants["default"].requests == 1
    # A header naming tenant must name only known columns; too many fields are an error.
    path.write_text("tenant,prompt,output_len\nq,10,5\n")
    with pytest.raises(ValueError, match=r"tenants.csv:1.*unknown columns \['prompt'\]"):
        load_trace(path, WorkloadConfig(SHAREGPT))
    path.write_text("10,5,1,1,1,q,3,9\n")
    with pytest.raises(ValueError, match=r"tenants.csv:1: expected .*tenant"):
        load_trace(path, WorkloadConfig(SHAREGPT))


def test_csv_noisy_neighbour_with_and_without_quota_through_the_cli(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nn.csv"
    rows = [f"quiet,{40 * i},400,8,7" for i in range(12)]
    rows += [f"noisy,{5 + 50 * (i // 10)},400,48," for i in range(100)]
    path.write_text("tenant,arrival_step,prompt_len,output_len,prefix_id\n" + "\n".join(rows) + "\n")
    args = ["simulate", "--quiet", "--json", "--trace", str(path), "--prefix-len", "384", "--kv-tokens", "4096",
            "--policies", "paged+prefix@16"]
    hit = {}
    for extra in ([], ["--tenant-kv-quota", "noisy=0.5"]):
        assert main([*args, *extra]) == 0
        hit[bool(extra)] = json.loads(capsys.readouterr().out)["policies"][0]["tenants"]["quiet"]["prefix_hit_rate"]
    assert hit[True] == pytest.approx(11 / 12 * 384 / 400)
    assert hit[False] < 0.5 * hit[True]


@pytest.mark.parametrize(("flags", "message"), [
    (["--tenant-kv-quota", "noisy"], "--tenant-kv-quota: expected NAME=FRACTION"),
    (["--tenant-kv-quota", "noisy=1.5"], "--tenant-kv-quota 'noisy': expected a fraction of the KV pool in (0, 1]"),
    (["--tenant-kv-quota", "noisy=abc"], "--tenant-kv-quota 'noisy': expected a fraction"),
    (["--tenant-kv-quota", "a=0.5", "--tenant-kv-quota", "a=0.2"], "tenant 'a' is given twice"),
    (["--default-tenant-kv-quota", "0"], "--default-tenant-kv-quota: expected a fraction"),
    (["--tenant", "noisy:requests=0"], "--tenant noisy: requests must be >= 1"),
    (["--tenant", "noisy:size=3"], "--tenant noisy: unknown setting 'size=3'"),
    (["--tenant", "quiet:prompt=fixed:0"], "--tenant quiet prompt: expected fixed:N"),
    (["--tenant", "a:every=2,rate=1"], "every must be given without rate"),
    (["--tenant", "a:requests=2", "--tenant", "a:requests=3"], "each named once"),
    (["--tenant", "a:requests=2", "--trace", "x.csv"], "--tenant and --trace"),
])
def test_bad_tenant_flags_give_a_clear_error(flags: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--quiet", "--num-requests", "5", "--kv-tokens", "1024", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv simulate: error: ") and message in err, err


def test_tenant_specs_arrivals_and_independent_streams() -> None:
    spec = parse_tenant_spec("chat:requests=7,every=10,burst=3,start=4,prompt=lognormal:100,0.5,output=fixed:9")
    assert (spec.requests, spec.every, spec.burst, spec.start) == (7, 10, 3, 4)
    assert spec.prompt is not None and (spec.prompt.kind, spec.prompt.sigma) == ("lognormal", 0.5)
    cfg = WorkloadConfig(SHAREGPT, max_model_len=512, seed=3)
    reqs = generate_tenant_workload([spec], cfg)
    assert [r.arrival_step for r in reqs] == [4, 4, 4, 14, 14, 14, 24]
    assert all(r.output_len == 9 and r.tenant == "chat" for r in reqs)
    other = TenantSpec("bg", requests=5, rate=0.5, prefix=32)
    mixed = generate_tenant_workload([spec, other], cfg)
    assert [r.req_id for r in mixed] == list(range(12))
    assert [r.arrival_step for r in mixed] == sorted(r.arrival_step for r in mixed)
    # Adding a tenant leaves another tenant's lengths and arrivals unchanged.
    assert [(r.prompt_len, r.arrival_step) for r in mixed if r.tenant == "chat"] == \
           [(r.prompt_len, r.arrival_step) for r in reqs]
    assert all(r.prompt[:32] == prefix_tokens(1, 32) for r in mixed if r.tenant == "bg")


def test_tenants_never_share_cached_prefixes() -> None:
    # Two tenants send the same 400-token system prompt, one after the other: each computes its own.
    system = list(range(5000, 5400))
    requests = [Request(i, system + [100 + i], 2, tenant=("a", "b", "a", "b")[i], arrival_step=10 * i)
                for i in range(4)]
    result = _run(requests)
    assert (_tenant(result, "a").hit_tokens, _tenant(result, "b").hit_tokens) == (400, 400)  # 2nd turn each
    assert _run([Request(r.req_id, r.prompt, 2, arrival_step=r.arrival_step) for r in requests]).prefix_hit_rate \
        == pytest.approx(3 * 400 / (4 * 401))


def test_latency_figures_are_means_and_nearest_rank_percentiles() -> None:
    tally = TenantAccumulator(["a", "b"])
    for steps in range(20, 0, -1):
        tally.arrived("a")
        tally.admitted("a", 100, 25)
        tally.first_token("a", steps % 3 + 1)
        tally.completed("a", steps)
    a, b = tally.result(prefix=True)["a"], tally.result(prefix=False)["b"]
    assert (a.mean_latency, a.p50_latency, a.p95_latency) == (10.5, 10, 19)
    assert (a.p50_ttft, a.p95_ttft, a.prefix_hit_rate, a.completed) == (2, 3, 0.25, 20)
    assert (b.requests, b.mean_latency, b.p95_latency, b.prefix_hit_rate) == (0, None, None, None)


def test_without_tenants_nothing_changes() -> None:
    requests = generate_tenant_workload([parse_tenant_spec(QUIET)], WorkloadConfig(SHAREGPT, max_model_len=2048))
    plain = [Request(r.req_id, r.prompt, r.output_len, arrival_step=r.arrival_step) for r in requests]
    named, unnamed = _run(requests), _run(plain)
    assert unnamed.tenants is None and named.tenants is not None
    named.tenants = None
    assert named == unnamed  # one tenant named or none: the same run (salting aside, nothing shared)
