"""Expert placement policy of the load balancer (EPLB): pure computation, no I/O.

Given a window of per-expert token counts, `rebalance` decides which logical expert each
physical slot holds, for every MoE layer of one model (main and draft models are planned
separately). Slot s lives on rank ``s // slots_per_rank``; ranks ``d * ranks_per_domain ..
(d + 1) * ranks_per_domain - 1`` form NVLink domain d.

Load model: an expert with c replicas splits its tokens evenly over them (`ExpertMap`
spreads tokens over replicas by token index), so each replica carries load / c. A rank's
load is the sum over its slots; `imbalance` is max rank load / mean rank load per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Placement", "rebalance", "imbalance", "predicted_gain", "moved_experts",
           "migration_bytes", "validate"]


@dataclass
class Placement:
    """Slot contents of one model, all MoE layers.

    phys2log: [num_layers, num_slots] long, the logical expert held by each physical slot.
    """
    phys2log: torch.Tensor
    num_logical: int
    num_ranks: int
    num_domains: int = 1

    @property
    def num_layers(self) -> int:
        return int(self.phys2log.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.phys2log.shape[1])

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    @property
    def ranks_per_domain(self) -> int:
        return self.num_ranks // self.num_domains

    def replica_counts(self) -> torch.Tensor:
        """[num_layers, num_logical] long: how many slots hold each expert."""
        p = self.phys2log.long()
        counts = torch.zeros(p.shape[0], self.num_logical, dtype=torch.long)
        return counts.scatter_add_(1, p, torch.ones_like(p))

    @property
    def log2phys(self) -> torch.Tensor:
        """[num_layers, num_logical, max_replicas] long: slots of each expert in increasing
        order, padded with -1."""
        p = self.phys2log.long().numpy()
        n_layers, n_slots = p.shape
        occ = _occurrence(p + np.arange(n_layers)[:, None] * self.num_logical)
        width = int(occ.max()) + 1 if p.size else 1
        out = np.full((n_layers, self.num_logical, width), -1, dtype=np.int64)
        layer = np.repeat(np.arange(n_layers), n_slots)
        out[layer, p.ravel(), occ.ravel()] = np.tile(np.arange(n_slots), n_layers)
        return torch.from_numpy(out)

    def expert_map(self, layer: int):
        """The `ExpertMap` a MoE layer routes with under this placement."""
        from .moe import ExpertMap
        return ExpertMap(self.phys2log[layer].clone(), self.num_logical)

    @classmethod
    def identity(cls, num_layers: int, num_logical: int, num_slots: int, num_ranks: int,
                 num_domains: int = 1) -> "Placement":
        """Slot s holds expert s mod num_logical: the placement before any balancing."""
        _check_sizes(num_logical, num_slots, num_ranks, num_domains)
        p2l = (torch.arange(num_slots) % num_logical).repeat(num_layers, 1)
        return cls(p2l, num_logical, num_ranks, num_domains)


def validate(placement: Placement, num_logical: int, num_ranks: int) -> None:
    """Raise ValueError naming the first problem that makes `placement` unusable."""
    p = placement.phys2log
    if not isinstance(p, torch.Tensor) or p.dim() != 2:
        raise ValueError(f"phys2log must be a 2-D tensor [num_layers, num_slots], got "
                         f"{tuple(p.shape) if hasattr(p, 'shape') else type(p).__name__}")
    if p.dtype.is_floating_point or p.dtype == torch.bool or p.is_complex():
        raise ValueError(f"phys2log must hold integer expert ids, got dtype {p.dtype}")
    if placement.num_logical != num_logical or placement.num_ranks != num_ranks:
        raise ValueError(f"placement is for {placement.num_logical} experts on {placement.num_ranks} "
                         f"ranks, expected {num_logical} experts on {num_ranks} ranks")
    n_layers, n_slots = p.shape
    if n_layers == 0:
        raise ValueError("phys2log has no layers")
    _check_sizes(num_logical, n_slots, num_ranks, placement.num_domains)
    lo, hi = int(p.min()), int(p.max())
    if lo < 0 or hi >= num_logical:
        bad = lo if lo < 0 else hi
        where = torch.nonzero(p == bad)[0].tolist()
        raise ValueError(f"expert id {bad} out of range [0, {num_logical}) at layer {where[0]}, slot {where[1]}")
    missing = torch.nonzero(placement.replica_counts() == 0)
    if len(missing):
        layer, expert = missing[0].tolist()
        raise ValueError(f"expert {expert} has no replica in layer {layer} "
                         f"({len(missing)} (layer, expert) pairs without a slot)")


def _check_sizes(num_logical: int, num_slots: int, num_ranks: int, num_domains: int) -> None:
    if num_logical < 1 or num_ranks < 1 or num_domains < 1:
        raise ValueError(f"need at least one expert, rank and domain, got num_logical={num_logical}, "
                         f"num_ranks={num_ranks}, num_domains={num_domains}")
    if num_slots < num_logical:
        raise ValueError(f"num_slots={num_slots} is fewer than num_logical={num_logical}: "
                         "some expert would have no slot")
    if num_slots % num_ranks:
        raise ValueError(f"num_slots={num_slots} is not divisible by num_ranks={num_ranks}")
    if num_ranks % num_domains:
        raise ValueError(f"num_ranks={num_ranks} is not divisible by num_domains={num_domains}")


def _as_load(load) -> np.ndarray:
    a = load.detach().cpu().double().numpy() if isinstance(load, torch.Tensor) else np.asarray(load, np.float64)
    if a.ndim != 2:
        raise ValueError(f"load must be 2-D [num_layers, num_logical], got shape {a.shape}")
    if not np.isfinite(a).all() or (a < 0).any():
        raise ValueError("load must be finite and non-negative")
    return a


def _rank_loads(load, placement: Placement) -> np.ndarray:
    """[num_layers, num_ranks] expected tokens per rank under the even-split load model."""
    a = _as_load(load)
    p = placement.phys2log.long().numpy()
    if a.shape != (p.shape[0], placement.num_logical):
        raise ValueError(f"load shape {a.shape} does not match placement "
                         f"({p.shape[0]} layers, {placement.num_logical} experts)")
    counts = placement.replica_counts().numpy()
    share = np.take_along_axis(a / np.maximum(counts, 1), p, axis=1)
    return share.reshape(p.shape[0], placement.num_ranks, -1).sum(-1)


def imbalance(load, placement: Placement | None = None, *, num_ranks: int | None = None) -> torch.Tensor:
    """Per-layer max rank load / mean rank load ([num_layers] float64; 1.0 is perfect, and a
    layer with no tokens counts as 1.0).

    Either ``imbalance(load, placement)`` with logical loads [num_layers, num_logical], or
    ``imbalance(slot_load, num_ranks=R)`` with measured per-slot loads [num_layers, num_slots].
    """
    if placement is not None:
        ranks = _rank_loads(load, placement)
    else:
        if num_ranks is None:
            raise ValueError("per-slot loads need num_ranks")
        a = _as_load(load)
        if a.shape[1] % num_ranks:
            raise ValueError(f"{a.shape[1]} slots are not divisible by num_ranks={num_ranks}")
        ranks = a.reshape(a.shape[0], num_ranks, -1).sum(-1)
    mean = ranks.mean(1)
    ratio = np.divide(ranks.max(1), mean, out=np.ones_like(mean), where=mean > 0)
    return torch.from_numpy(ratio)


def predicted_gain(load, current: Placement, proposed: Placement) -> float:
    """Mean over layers of imbalance(current) - imbalance(proposed) under `load`; positive
    means the proposal is better balanced."""
    return float((imbalance(load, current) - imbalance(load, proposed)).mean())


def moved_experts(current: Placement, proposed: Placement) -> list[tuple[int, int, int, int]]:
    """(layer, slot, old_logical, new_logical) for every slot whose expert changes: the
    weights a migration has to copy."""
    if current.phys2log.shape != proposed.phys2log.shape:
        raise ValueError(f"placements differ in shape: {tuple(current.phys2log.shape)} "
                         f"vs {tuple(proposed.phys2log.shape)}")
    old, new = current.phys2log.long(), proposed.phys2log.long()
    where = torch.nonzero(old != new).tolist()
    return [(l, s, int(old[l, s]), int(new[l, s])) for l, s in where]


def migration_bytes(current: Placement, proposed: Placement, bytes_per_expert: int) -> int:
    """Bytes a migration copies: one expert's weights per slot that changes."""
    return len(moved_experts(current, proposed)) * int(bytes_per_expert)


# ---------------------------------------------------------------------------------------
# Planning. Every step works on "rows" (one layer, or one layer of one domain) at once, so
# the Python loops run over items or bins, never over layers.


def _occurrence(keys: np.ndarray) -> np.ndarray:
    """For each entry, how many equal keys precede it in row-major order."""
    flat = keys.ravel()
    order = np.argsort(flat, kind="stable")
    s = flat[order]
    idx = np.arange(len(s))
    start = np.r_[True, s[1:] != s[:-1]] if len(s) else np.zeros(0, bool)
    run_start = np.maximum.accumulate(np.where(start, idx, 0)) if len(s) else idx
    occ = np.empty_like(idx)
    occ[order] = idx - run_start
    return occ.reshape(keys.shape)


def _pack(weights: np.ndarray, num_bins: int, capacity: int, prefer: np.ndarray | None = None,
          kinds: np.ndarray | None = None, num_kinds: int = 0, tolerance: float = 0.0) -> np.ndarray:
    """Assign items to bins, each bin taking exactly `capacity` items, balancing bin loads.

    weights [rows, num_bins * capacity]; returns bins [rows, items]. Largest item first into
    the least-loaded bin with room (lowest index on ties, so the result is deterministic).
    `kinds`: items of one kind (replicas of one expert) avoid sharing a bin while another bin
    has room, since co-located replicas would not split load across ranks.
    `prefer`: each item's current bin (-1 if none). Items stay in their preferred bin where it
    has room, the rest are packed greedily, then `_refine` swaps items until the row's max
    load is within the fresh plan's max * (1 + tolerance). A row that cannot get there takes
    the fresh plan, with its bins renamed to overlap the current ones.
    """
    rows, n = weights.shape
    ar = np.arange(rows)
    # A penalty larger than any load difference makes "avoid same kind" a strict preference.
    big = weights.sum(1) + 1.0

    def greedy(bins):
        load = np.zeros((rows, num_bins))
        count = np.zeros((rows, num_bins), np.int64)
        holds = np.zeros((rows, num_bins, num_kinds), bool) if kinds is not None else None
        placed = np.nonzero(bins >= 0)
        if len(placed[0]):
            np.add.at(load, (placed[0], bins[placed]), weights[placed])
            np.add.at(count, (placed[0], bins[placed]), 1)
            if holds is not None:
                holds[placed[0], bins[placed], kinds[placed]] = True
        # Unplaced items, heaviest first; the loop only runs as far as the longest row's list.
        order = np.argsort(np.where(bins < 0, -weights, np.inf), axis=1, kind="stable")
        for k in range(int((bins < 0).sum(1).max(initial=0))):
            item = order[:, k]
            todo = bins[ar, item] < 0
            key = np.where(count >= capacity, np.inf, load)
            if holds is not None:
                kind = kinds[ar, item]
                key = key + holds[ar, :, kind] * big[:, None]
            b = key.argmin(1)
            r = ar[todo]
            b, it = b[todo], item[todo]
            bins[r, it] = b
            load[r, b] += weights[r, it]
            count[r, b] += 1
            if holds is not None:
                holds[r, b, kinds[r, it]] = True
        return bins, load

    fresh, fresh_load = greedy(np.full((rows, n), -1, np.int64))
    if prefer is None or not (prefer >= 0).any():
        return fresh
    bound = fresh_load.max(1) * (1.0 + tolerance) * (1 + 1e-12) + 1e-9

    # Keep every item that can stay (its bin has room), place the rest greedily, then swap
    # only as much as the bound requires: far fewer moves than repacking from scratch.
    # Where more items prefer a bin than it has room for, the heaviest stay.
    group = np.where(prefer >= 0, ar[:, None] * num_bins + prefer, -1).ravel()
    by_group = np.lexsort((-weights.ravel(), group))
    rank_in_group = np.empty(rows * n, np.int64)
    rank_in_group[by_group] = _occurrence(group[by_group])
    stay = (group >= 0) & (rank_in_group < capacity)
    sticky = np.where(stay.reshape(rows, n), prefer, -1)
    sticky, _ = greedy(sticky)
    sticky, sticky_load = _refine(sticky, weights, kinds, num_bins, capacity, bound)
    keep = sticky_load.max(1) <= bound
    if keep.all():
        return sticky

    # Rows that fall back: rename fresh bins so each overlaps its current bin most (greedy
    # maximum matching on overlap counts); the balance is unchanged by renaming.
    fb = ar[~keep]
    f, pr = fresh[fb], prefer[fb]
    m = len(fb)
    has = pr >= 0
    rid = np.broadcast_to(np.arange(m)[:, None], f.shape)
    ov = np.bincount((rid[has] * num_bins + f[has]) * num_bins + pr[has],
                     minlength=m * num_bins * num_bins).reshape(m, num_bins, num_bins).astype(np.int64)
    rename = np.zeros((m, num_bins), np.int64)
    am = np.arange(m)
    for _ in range(num_bins):
        idx = ov.reshape(m, -1).argmax(1)
        nb, cb = np.divmod(idx, num_bins)
        rename[am, nb] = cb
        ov[am, nb, :] = -1
        ov[am, :, cb] = -1
    out = sticky
    out[fb] = np.take_along_axis(rename, f, axis=1)
    return out


def _refine(bins: np.ndarray, weights: np.ndarray, kinds: np.ndarray | None, num_bins: int,
            capacity: int, bound: np.ndarray, max_iter: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Swap items between bins until each row's max bin load is <= bound (or no swap helps).

    Each step swaps one item of the row's fullest bin with one item of another bin, picking
    the swap that lowers the larger of the two resulting loads most. A swap moves two items,
    so this runs only as long as the bound is exceeded. Returns (bins, bin loads).
    """
    rows, n = bins.shape
    ar = np.arange(rows)
    order = np.argsort(bins, axis=1, kind="stable")
    item = order.reshape(rows, num_bins, capacity)
    sw = np.take_along_axis(weights, order, axis=1).reshape(rows, num_bins, capacity)
    sk = None if kinds is None else np.take_along_axis(kinds, order, axis=1).reshape(rows, num_bins, capacity)
    load = sw.sum(2)
    stuck = np.zeros(rows, bool)
    for _ in range(max_iter or 4 * n):
        a = load.argmax(1)
        la = load[ar, a]
        r = ar[(la > bound) & ~stuck]
        if not len(r):
            break
        a, la = a[r], la[r]
        wa = sw[r, a]                                              # [m, cap]
        d = wa[:, None, :, None] - sw[r][:, :, None, :]            # [m, bins, i in a, j in b]
        lb = load[r][:, :, None, None]
        new_max = np.maximum(la[:, None, None, None] - d, lb + d)
        valid = (d > 0) & (new_max < la[:, None, None, None] * (1 - 1e-12))
        if sk is not None:
            same = sk[r][:, :, :, None] == sk[r, a][:, None, None, :]     # [m, bins, j in b, i in a]
            i_clash = same.any(2)                                           # a's item i already in b
            j_clash = same.any(3)                                           # b's item j already in a
            valid &= ~i_clash[:, :, :, None] & ~j_clash[:, :, None, :]
        score = np.where(valid, new_max, np.inf).reshape(len(r), -1)
        best = score.argmin(1)
        ok = np.isfinite(score[np.arange(len(r)), best])
        stuck[r[~ok]] = True
        r, a, best = r[ok], a[ok], best[ok]
        b, rest = np.divmod(best, capacity * capacity)
        i, j = np.divmod(rest, capacity)
        for arr in (item, sw) + ((sk,) if sk is not None else ()):
            arr[r, a, i], arr[r, b, j] = arr[r, b, j].copy(), arr[r, a, i].copy()
        load[r, a] = sw[r, a].sum(1)
        load[r, b] = sw[r, b].sum(1)
    out = np.empty_like(bins)
    out[ar[:, None, None], item] = np.broadcast_to(np.arange(num_bins)[None, :, None], item.shape)
    return out, load


def _replicate(w: np.ndarray, num_slots: int, cap: int | None) -> np.ndarray:
    """Replica count per expert (each row sums to num_slots): repeatedly give one more
    replica to the expert whose per-replica load is highest. Returns counts [rows, n]."""
    rows, n = w.shape
    ar = np.arange(rows)
    counts = np.ones((rows, n), np.int64)
    for _ in range(num_slots - n):
        score = w / counts
        if cap is not None:
            score = np.where(counts >= cap, -np.inf, score)
        counts[ar, score.argmax(1)] += 1
    return counts


def _fill_slots(expert: np.ndarray, rank: np.ndarray, num_logical: int, num_ranks: int,
                current: np.ndarray | None) -> np.ndarray:
    """Lay each rank's experts into its slots. With `current`, an expert already sitting
    in one of the rank's slots stays in that very slot, so it need not be copied."""
    n_layers, n_slots = expert.shape
    spr = n_slots // num_ranks
    layer_off = (np.arange(n_layers) * num_ranks)[:, None]
    item_key = (layer_off + rank) * num_logical + expert
    order = np.argsort(item_key, axis=1, kind="stable")
    if current is None:
        return np.take_along_axis(expert, order, axis=1)
    slot_rank = np.broadcast_to(np.arange(n_slots) // spr, current.shape)
    slot_key = (layer_off + slot_rank) * num_logical + current
    mult = spr + 1
    ik = (item_key * mult + _occurrence(item_key)).ravel()
    sk = (slot_key * mult + _occurrence(slot_key)).ravel()
    _, ii, si = np.intersect1d(ik, sk, assume_unique=True, return_indices=True)
    out = np.full(n_layers * n_slots, -1, np.int64)
    flat_expert = expert.ravel()
    out[si] = flat_expert[ii]
    # Unmatched items and unmatched slots pair up within each (layer, rank): both sides
    # have the same count there, so sorting both by (layer, rank) aligns them.
    free_items = np.setdiff1d(np.arange(out.size), ii, assume_unique=True)
    free_slots = np.nonzero(out < 0)[0]
    free_items = free_items[np.argsort(item_key.ravel()[free_items], kind="stable")]
    rank_of_slot = (layer_off + slot_rank).ravel()
    free_slots = free_slots[np.argsort(rank_of_slot[free_slots], kind="stable")]
    out[free_slots] = flat_expert[free_items]
    return out.reshape(n_layers, n_slots)


def rebalance(load, *, num_slots: int, num_ranks: int, num_domains: int = 1, num_groups: int = 1,
              current: Placement | None = None, tolerance: float = 0.02) -> Placement:
    """Plan a placement for load [num_layers, num_logical] (token counts of one window).

    Hierarchical policy:
      1. Expert groups (the `num_groups` of group-limited routing) are packed onto NVLink
         domains, equal group count per domain, balancing domain load, so the tokens a
         router sends to one group stay inside one domain. When `num_groups` is not a
         multiple of `num_domains`, experts are packed individually instead; when the
         experts do not divide evenly over the domains either, domains are ignored and the
         ranks are planned as one pool. With one domain this step does nothing.
      2. Within each domain, the redundant slots (slots - experts) go to the hottest
         experts one at a time, each time to the expert with the highest load per replica;
         replicas split their expert's load evenly. An expert gets at most one replica per
         rank of the domain when that is possible.
      3. Replicas are packed onto the domain's ranks, exactly slots_per_rank each, largest
         first into the least-loaded rank with a free slot (avoiding a second replica of an
         expert on one rank).
      4. With `current`: every replica first stays on its current rank (and group on its
         current domain) where there is room, new replicas fill the freed slots, and then
         items are swapped only until the max rank load is within (1 + tolerance) of the
         freshly packed plan's; a row that cannot get there takes the fresh plan with its
         ranks renamed to overlap the current ones. Inside a rank an expert keeps its very
         slot. The tolerance applies at each level (domains, then ranks), so with several
         domains the result is within about (1 + tolerance)^2 of a fresh plan. Re-planning the
         same load with current = its result moves nothing. Replica counts come from `load`
         alone.

    Deterministic: equal inputs give equal outputs (ties go to the lower index).
    """
    w = _as_load(load)
    n_layers, num_logical = w.shape
    if n_layers == 0:
        raise ValueError("load has no layers")
    _check_sizes(num_logical, num_slots, num_ranks, num_domains)
    if num_groups < 1 or num_logical % num_groups:
        raise ValueError(f"num_groups={num_groups} does not divide num_logical={num_logical}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    cur = None
    if current is not None:
        validate(current, num_logical, num_ranks)
        if current.phys2log.shape != (n_layers, num_slots):
            raise ValueError(f"current placement has shape {tuple(current.phys2log.shape)}, "
                             f"expected ({n_layers}, {num_slots})")
        cur = current.phys2log.long().numpy()

    spr = num_slots // num_ranks
    if num_domains > 1 and num_groups % num_domains == 0:
        n_dom, group_size = num_domains, num_logical // num_groups
    elif num_domains > 1 and num_logical % num_domains == 0:
        n_dom, group_size = num_domains, 1
    else:
        n_dom, group_size = 1, num_logical
    rpd = num_ranks // n_dom
    slots_pd = num_slots // n_dom
    per_dom = num_logical // n_dom
    layer_ar = np.arange(n_layers)[:, None]

    # Step 1: units (groups, or single experts) onto domains.
    if n_dom > 1:
        n_units = num_logical // group_size
        unit_load = w.reshape(n_layers, n_units, group_size).sum(-1)
        prefer = None
        if cur is not None:
            slot_dom = np.arange(num_slots) // (spr * rpd)
            key = ((layer_ar * n_units + cur // group_size) * n_dom + slot_dom).ravel()
            votes = np.bincount(key, minlength=n_layers * n_units * n_dom)
            prefer = votes.reshape(n_layers, n_units, n_dom).argmax(-1)
        unit_dom = _pack(unit_load, n_dom, n_units // n_dom, prefer=prefer, tolerance=tolerance)
        expert_dom = np.repeat(unit_dom, group_size, axis=1)
    else:
        expert_dom = np.zeros((n_layers, num_logical), np.int64)
    # Experts of each domain, in increasing id: [n_layers, n_dom, per_dom].
    dom_experts = np.argsort(expert_dom * num_logical + np.arange(num_logical), axis=1,
                             kind="stable").reshape(n_layers, n_dom, per_dom)

    # Step 2: replicas within each domain. Rows are (layer, domain).
    rows = n_layers * n_dom
    ids = dom_experts.reshape(rows, per_dom)
    dw = np.take_along_axis(w, dom_experts.reshape(n_layers, -1), axis=1).reshape(rows, per_dom)
    cap = rpd if per_dom * rpd >= slots_pd else None
    counts = _replicate(dw, slots_pd, cap)
    item_expert = np.repeat(ids.ravel(), counts.ravel()).reshape(rows, slots_pd)
    item_w = np.repeat((dw / counts).ravel(), counts.ravel()).reshape(rows, slots_pd)

    # Step 3 (+4): replicas onto the domain's ranks.
    prefer = None
    if cur is not None:
        first = np.cumsum(counts, axis=1) - counts
        replica = np.arange(slots_pd)[None, :] - np.repeat(first.ravel(), counts.ravel()).reshape(rows, slots_pd)
        l2p = current.log2phys.numpy()
        row_layer = np.repeat(np.arange(n_layers), n_dom)[:, None]
        row_dom = np.tile(np.arange(n_dom), n_layers)[:, None]
        j = np.minimum(replica, l2p.shape[2] - 1)
        slot = np.where(replica < l2p.shape[2], l2p[row_layer, item_expert, j], -1)
        rank = slot // spr
        prefer = np.where((slot >= 0) & (rank // rpd == row_dom), rank - row_dom * rpd, -1)
    local = _pack(item_w, rpd, spr, prefer=prefer, kinds=item_expert, num_kinds=num_logical,
                  tolerance=tolerance)
    global_rank = (local.reshape(n_layers, n_dom, slots_pd)
                   + (np.arange(n_dom) * rpd)[None, :, None]).reshape(n_layers, num_slots)
    phys2log = _fill_slots(item_expert.reshape(n_layers, num_slots), global_rank,
                           num_logical, num_ranks, cur)
    return Placement(torch.from_numpy(phys2log), num_logical, num_ranks, num_domains)
