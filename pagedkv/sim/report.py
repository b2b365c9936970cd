"""Presenting results: fixed-width tables for the terminal and a matplotlib plot (lazy import)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.sim.metrics import PolicyResult
from pagedkv.sim.sizing import SizingResult
from pagedkv.units import format_bytes


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def simulate_table(results: Sequence[PolicyResult]) -> str:
    """One row per policy. ``conc`` = mean running requests, ``busy`` = mean while requests wait."""
    headers = ["policy", "block", "waste", "internal", "external", "usage", "conc", "busy",
               "peak", "preempt", "prefix hit", "steps", "req/step"]
    rows = [[r.name, "-" if r.block_size is None else str(r.block_size), _pct(r.waste),
             _pct(r.internal_frag), _pct(r.external_frag), _pct(r.usage),
             f"{r.mean_concurrency:.1f}",
             "-" if r.saturated_concurrency is None else f"{r.saturated_concurrency:.1f}",
             str(r.peak_concurrency), str(r.preemptions), _pct(r.prefix_hit_rate), str(r.steps),
             f"{r.throughput:.3f}"] for r in results]
    if any(r.attended_tokens for r in results):  # block resizing ran: its copies and their cost
        headers += ["copies", "copy cost", "net busy"]
        for row, r in zip(rows, results):
            row += [f"{r.resize_copies:,}", _pct(r.copy_cost), _num(r.net_concurrency)]
    return _table(headers, rows)


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def tenant_table(results: Sequence[PolicyResult]) -> str:
    """One row per policy and tenant (policies with per-tenant figures): requests done, prefix hit
    rate at first admission, latency and time to first token in steps (mean, p50, p95),
    preemptions and quota waits."""
    headers = ["policy", "tenant", "done", "prefix hit", "lat mean", "lat p50", "lat p95", "ttft mean",
               "ttft p50", "ttft p95", "preempt", "quota waits"]
    rows = []
    for r in results:
        for name, t in (r.tenants or {}).items():
            rows.append([r.name, name, f"{t.completed}/{t.requests}", _pct(t.prefix_hit_rate),
                         _num(t.mean_latency), _num(t.p50_latency, 0), _num(t.p95_latency, 0),
                         _num(t.mean_ttft), _num(t.p50_ttft, 0), _num(t.p95_ttft, 0), str(t.preemptions),
                         str(t.quota_waits)])
    return _table(headers, rows)


def size_table(result: SizingResult) -> str:
    """The sizing figures, then the block-size comparison and the recommendation."""
    r = result
    pairs = [
        ("model", r.model),
        ("KV dtype / block size / TP", r.kv_dtype + (" (V; K at the sink dtype)" if r.kv_quant_parts == "v" else "")
         + f" / {r.block_size} / {r.tp}"),
        *([("block size", r.block_size_choice)] if r.block_size_choice else []),
        ("KV heads per rank", str(r.kv_heads_per_rank)),
        ("KV bytes per token" + (" in one group" if r.kv_groups else ""),
         f"{r.kv_bytes_per_token:,} ({format_bytes(r.kv_bytes_per_token)})"),
        ("scale bytes per block", f"{r.scale_bytes_per_block:,}"),
        ("block bytes", f"{r.block_bytes:,} ({format_bytes(r.block_bytes)})"),
        ("device memory", "-" if r.device_memory is None else
         f"{r.device_memory:,} ({format_bytes(r.device_memory)})"),
        ("weights per rank", f"{r.weight_memory:,} ({format_bytes(r.weight_memory)})"
         + (" (not subtracted: --kv-memory given)" if r.device_memory is None else "")),
        ("reserved", f"{r.reserved_memory:,} ({format_bytes(r.reserved_memory)})"),
        ("KV memory per rank", f"{r.kv_memory:,} ({format_bytes(r.kv_memory)})"),
        ("KV blocks", f"{r.num_blocks:,} ({r.token_capacity:,} "
                      + ("token slots of one group each)" if r.kv_groups else "tokens)")),
        *([("of them full precision (sinks)", f"{r.full_precision_blocks:,} x {r.full_precision_block_bytes:,} bytes "
                                               f"(the other {r.num_blocks - r.full_precision_blocks:,} 8-bit)")]
          if r.full_precision_blocks else []),
        ("max length", f"{r.max_len:,} ({r.blocks_per_max_len_seq:,} blocks)"),
        ("max concurrent at max length", f"{r.max_concurrent_at_max_len:,}"),
        (f"{r.distribution} mean length", f"final {r.mean_final_len:.0f}, live {r.mean_live_len:.0f}"),
        (f"max concurrent ({r.distribution}, steady)",
         f"{r.max_concurrent_steady:,} (all at final length: "
         f"{r.max_concurrent_at_mean_final_len:,})"),
        ("internal waste", _pct(r.internal_waste)),
        *([("KV groups", r.kv_groups),
           ("KV per max-length sequence", f"{format_bytes(r.seq_bytes_at_max_len)} (a cache keeping every "
                                          f"layer's history: {format_bytes(r.full_cache_seq_bytes_at_max_len)}, "
                                          f"{r.full_cache_seq_bytes_at_max_len / r.seq_bytes_at_max_len:.1f}x)")]
          if r.kv_groups else []),
        ("recommended block size", str(r.recommended_block_size)),
    ]
    width = max(len(k) for k, _ in pairs)
    head = "\n".join(f"{k.ljust(width)}  {v}" for k, v in pairs)
    rows = [[str(row["block_size"]), f"{int(row['block_bytes']):,}", f"{int(row['num_blocks']):,}",
             _pct(float(row["internal_waste"])), f"{int(row['max_concurrent_steady']):,}"]
            for row in r.block_size_table]
    table = _table(["block", "block bytes", "blocks", "waste", "concurrent"], rows)
    return f"{head}\n\n{table}\n\nwhy: {r.recommendation}"


def plot_results(results: Sequence[PolicyResult], path: str, title: str = "") -> None:
    """Waste and concurrency against block size (paged) with the other policies as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_waste, ax_conc) = plt.subplots(1, 2, figsize=(12, 4.5))
    families: dict[str, list[PolicyResult]] = {}
    flat: list[PolicyResult] = []
    for r in results:
        if r.block_size is None:
            flat.append(r)
        else:
            families.setdefault(r.family, []).append(r)
    for ax, metric, label in ((ax_waste, "waste", "waste (unfilled / allocated)"),
                              (ax_conc, "conc", "concurrent requests (mean while queued)")):
        for family, rows in families.items():
            rows = sorted(rows, key=lambda r: r.block_size or 0)
            ax.plot([r.block_size for r in rows], [_metric(r, metric) for r in rows],
                    marker="o", label=family)
        for i, r in enumerate(flat):
            ax.axhline(_metric(r, metric), linestyle="--", color=f"C{len(families) + i}",
                       label=r.name)
        if families:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax_waste.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _metric(r: PolicyResult, metric: str) -> float:
    if metric == "waste":
        return r.waste
    return r.saturated_concurrency if r.saturated_concurrency is not None else r.mean_concurrency
