"""The memory policies the simulator compares, by name, and how to build one.

Names (``--policies``, comma-separated):

    contiguous-max      reserve max_model_len slots per sequence (static KV cache, Orca "Max")
    contiguous-oracle   reserve exactly prompt + output per sequence (knows the output length in
                        advance, Orca "Oracle"): no internal waste, external fragmentation remains
    buddy               next power of two >= prompt + output per sequence from a buddy heap
                        (Orca "Pow2")
    paged[+prefix][+cow][@B]
                        the real KVCacheManager with block size B; ``+prefix`` enables prefix
                        caching, ``+cow`` forks parallel samples and beams from the prompt
                        (copy-on-write) instead of giving each its own copy. Without ``@B`` the
                        policy runs once per ``--block-sizes`` entry.
    merge[@G-L]         merge-on-fragmentation: blocks of L, a sequence's under-used last block
                        split into blocks of G (copied) when the pool's waste passes 10%, merged
                        back (copied) once full (default 16-64; ``pagedkv/sim/resizing.py``)
    vtail[@G-L]         variable-size tail block: full blocks of L and one tail of G, 2G ... L,
                        copied up as it grows (default 16-64)

Tenant KV quotas (``tenant_quotas``, ``default_tenant_quota``) apply to the paged policies only:
contiguous and buddy reservations have no prefix cache to isolate and ignore tenants.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.model_shape import MAX_BLOCK_SIZE
from pagedkv.sim.buddy import BuddyAllocator
from pagedkv.sim.contiguous import ExtentAllocator, ReservationPolicy
from pagedkv.sim.memory_policy import MemoryPolicy
from pagedkv.sim.paged import PagedPolicy
from pagedkv.sim.resizing import RESIZE_KINDS, ResizingPolicy
from pagedkv.sim.workload import Request

RESERVATION_KINDS = ("contiguous-max", "contiguous-oracle", "buddy")
PAGED_OPTIONS = ("prefix", "cow")
DEFAULT_POLICIES = "contiguous-max,contiguous-oracle,buddy,paged,paged+prefix@16,paged+cow@16"
DEFAULT_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_RESIZE_SIZES = (16, 64)  # (G, L) of merge / vtail without @G-L


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One policy to simulate: ``kind`` is a reservation kind, ``paged``, or a resizing kind
    (``merge``, ``vtail``: blocks of ``block_size`` and granules of ``small``)."""

    kind: str
    block_size: int | None = None
    prefix: bool = False
    cow: bool = False
    small: int | None = None

    @property
    def name(self) -> str:
        if self.kind in RESIZE_KINDS:
            return f"{self.kind}@{self.small}-{self.block_size}"
        if self.kind != "paged":
            return self.kind
        return "paged" + "+prefix" * self.prefix + "+cow" * self.cow + f"@{self.block_size}"

    @property
    def family(self) -> str:
        """The name without the block size (one line per family on a plot)."""
        return self.name.split("@")[0]


def parse_block_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,16"`` -> ``(1, 2, 16)``; each in ``1 .. MAX_BLOCK_SIZE``."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(not 1 <= b <= MAX_BLOCK_SIZE for b in sizes):
        raise ValueError(f"--block-sizes: expected comma-separated integers in 1..{MAX_BLOCK_SIZE}, "
                         f"got {text!r}")
    return sizes


def parse_policies(text: str, block_sizes: tuple[int, ...]) -> list[PolicySpec]:
    """Expand ``--policies`` into specs; a paged entry without ``@B`` runs at every block size."""
    specs: list[PolicySpec] = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if entry in RESERVATION_KINDS:
            specs.append(PolicySpec(entry))
            continue
        if entry.partition("@")[0] in RESIZE_KINDS:
            specs.append(_resize_spec(entry))
            continue
        base, at, size_text = entry.partition("@")
        head, *options = base.split("+")
        if head != "paged" or any(o not in PAGED_OPTIONS for o in options) or \
                len(set(options)) != len(options):
            raise ValueError(f"--policies: unknown policy {entry!r}; expected one of "
                             f"{', '.join(RESERVATION_KINDS)}, paged[+prefix][+cow][@B], merge[@G-L] "
                             f"or vtail[@G-L]")
        sizes = block_sizes
        if at:
            sizes = parse_block_sizes(size_text)
        for b in sizes:
            specs.append(PolicySpec("paged", b, "prefix" in options, "cow" in options))
    if not specs:
        raise ValueError("--policies: no policy given")
    return list(dict.fromkeys(specs))


def build_policy(spec: PolicySpec, capacity: int, max_model_len: int, *,
                 watermark: float = 0.01, eviction_policy: str = "lru",
                 kv_group_windows: tuple[int | None, ...] = (None,),
                 tenant_quotas: dict[str, float] | None = None,
                 default_tenant_quota: float | None = None) -> MemoryPolicy:
    """A fresh policy holding ``capacity`` KV token slots. A hybrid model's (``kv_group_windows``,
    one entry per KV group) slots each hold one group's layers: paged memory keeps a table per
    group and releases what leaves a window; the contiguous policies keep every layer of every
    token, so a token takes one slot per group. Tenant quotas (fractions of the pool) reach the
    paged policies only."""
    if spec.kind != "paged":
        capacity //= len(kv_group_windows)
    if spec.kind == "contiguous-max":
        return ReservationPolicy(spec.name, ExtentAllocator(capacity), lambda r: max_model_len)
    if spec.kind == "contiguous-oracle":
        return ReservationPolicy(spec.name, ExtentAllocator(capacity), _final_len)
    if spec.kind == "buddy":
        return ReservationPolicy(spec.name, BuddyAllocator(capacity), _final_len)
    assert spec.block_size is not None
    if spec.kind in RESIZE_KINDS:
        if len(kv_group_windows) > 1:
            raise ValueError(f"--policies: {spec.name} models one KV group; a hybrid --model has "
                             f"{len(kv_group_windows)} (compare paged@B there)")
        assert spec.small is not None
        return ResizingPolicy(spec.name, spec.kind, capacity, spec.small, spec.block_size, watermark=watermark)
    return PagedPolicy(spec.name, capacity, spec.block_size, prefix_caching=spec.prefix,
                       cow=spec.cow, watermark=watermark, eviction_policy=eviction_policy,
                       kv_group_windows=kv_group_windows, tenant_quotas=tenant_quotas,
                       default_tenant_quota=default_tenant_quota)


def _resize_spec(entry: str) -> PolicySpec:
    """``merge``, ``vtail@8-64`` -> a spec; ValueError names the entry and the form."""
    kind, at, sizes = entry.partition("@")
    small, large = DEFAULT_RESIZE_SIZES
    if at:
        lo, dash, hi = sizes.partition("-")
        if not (dash and lo.isdigit() and hi.isdigit() and 1 <= int(lo) < int(hi) <= MAX_BLOCK_SIZE):
            raise ValueError(f"--policies: {entry!r}: expected {kind}@G-L with 1 <= G < L <= {MAX_BLOCK_SIZE}, "
                             f"e.g. {kind}@16-64")
        small, large = int(lo), int(hi)
    return PolicySpec(kind, large, small=small)


def _final_len(request: Request) -> int:
    return request.final_len
