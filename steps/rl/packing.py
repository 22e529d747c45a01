"""Padding-free microbatches: a minibatch's samples bin-packed into rows of at most a token budget.

Each microbatch is one packed row of its samples (`moeloop.steps.model.microbatch`). Gradients accumulate over a
rank's microbatches to one optimizer step, and the losses take the whole minibatch's token and sequence counts as
denominators, so packing changes no number.

Every rank plans every microbatch of the minibatch (the plan is a pure function of the sample lengths), so the
ranks agree on how many forwards each runs: the MoE layers' all-to-alls and FSDP's all-gathers are collectives
that every rank joins equally often.
"""

from __future__ import annotations


def plan_microbatches(lengths: list[int], max_tokens: int, world_size: int) -> list[list[list[int]]]:
    """Indices into lengths, packed into world_size x k microbatches of at most max_tokens tokens, k the same for
    every rank: the plan of each rank, its k microbatches. Deterministic.

    k is the fewest that first-fit decreasing needs, spread over the ranks; the samples then go, longest first, to
    the least-filled microbatch that has room (so the microbatches, and the ranks, carry similar token counts). A
    sample longer than max_tokens takes an empty microbatch of its own. A microbatch can be empty (an empty list)
    when there are fewer samples than microbatches; its rank then runs a forward of no weight
    (`Microbatch.empty`).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    per_rank = -(-len(first_fit_decreasing([lengths[i] for i in order], max_tokens)) // world_size)
    while (bins := least_filled([lengths[i] for i in order], max_tokens, per_rank * world_size)) is None:
        per_rank += 1
    loads = [sum(lengths[order[j]] for j in members) for members in bins]
    ranked = sorted(range(len(bins)), key=lambda b: (-loads[b], b))
    plans: list[list[list[int]]] = [[] for _ in range(world_size)]
    for position, b in enumerate(ranked):  # dealt in snake order, heaviest first: the ranks' totals stay close
        lap, offset = divmod(position, world_size)
        plans[offset if lap % 2 == 0 else world_size - 1 - offset].append(sorted(order[j] for j in bins[b]))
    return plans


def first_fit_decreasing(sorted_lengths: list[int], max_tokens: int) -> list[int]:
    """Bin loads of first-fit over lengths sorted longest first."""
    loads: list[int] = []
    for length in sorted_lengths:
        for b, load in enumerate(loads):
            if load + length <= max_tokens:
                loads[b] += length
                break
        else:
            loads.append(length)
    return loads


def least_filled(sorted_lengths: list[int], max_tokens: int, num_bins: int) -> list[list[int]] | None:
    """Each length (longest first) into the least-filled of num_bins bins, by position in sorted_lengths; None if
    one does not fit there (an empty bin takes any length)."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for position, length in enumerate(sorted_lengths):
        b = min(range(num_bins), key=lambda b: (loads[b], b))
        if loads[b] and loads[b] + length > max_tokens:
            return None
        bins[b].append(position)
        loads[b] += length
    return bins
