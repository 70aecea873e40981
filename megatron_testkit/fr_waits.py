"""A rank's flight-recorder dump as the wait-for graph's input: NCCL's side of `megatron_testkit.wait_graph`.

On NCCL a collective returns as soon as it is enqueued and the host thread waits in a stream
synchronisation that no Python wrapper sees; work launched by C++ (DDP's reducer, functional
collectives) never passes the wrappers at all. PyTorch's flight recorder sees all of it. Each
entry carries its group (``process_group``: the name torch keys the group by, the wrappers' key
too), ``collective_seq_id`` (torch's own per-group sequence number) or ``p2p_seq_id``, the op
(``profiling_name``), its state, and its input/output sizes and dtypes; NCCL's ``pg_config``
gives each group's global ranks. From one rank's dump (`flight_recorder.parse_dump`):

- its wait is its oldest op not done (the ops a rank enqueues after it queue behind it);
- per group, the last collective it enqueued (``entered``), from the entries and ``pg_status``;
- a point-to-point op waits on its peer (``send 0->1``: the group's rank 1, mapped to its global
  rank), numbered per direction and peer as the wrappers number them; the ring buffer holds only
  the last entries, so once it dropped any (the oldest entry's ``record_id`` above 0) the counts
  per peer are not whole and such a wait is left unknown, as is every group with no entry left
  in the ring (its count would read 0): the graph judges without them and never names a
  deadlock through them.

Where the launcher has both views of an NCCL rank, the flight recorder's wins: its numbers are
torch's own (the wrappers count ``all_gather_object`` once where torch counts its two
all-gathers, and NCCL's ``barrier`` is an all-reduce), it sees what the wrappers cannot, and it
knows when the device finished an op. The two views are never mixed in one graph: a rank without
a dump yet leaves the launch to the per-rank rule (`megatron_testkit.stall`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megatron_testkit.flight_recorder import Collective, RankTrace
from megatron_testkit.wait_graph import RankWaits, Wait

__all__ = ["FR_THREAD", "op_name", "rank_waits", "tensors"]

# The `Wait.thread` of a wait taken from the flight recorder (it is an op, not a thread).
FR_THREAD = "flight recorder"

# torch's internal op names in profiling names, as the torch.distributed call that makes them.
_CALLS = {
    "all_reduce_barrier": "barrier",
    "_all_gather_base": "all_gather_into_tensor",
    "_allgather_base": "all_gather_into_tensor",
    "allgather": "all_gather",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "allreduce_coalesced": "all_reduce_coalesced",
    "_broadcast_oop": "broadcast",
    "_reduce_oop": "reduce",
}
# c10's scalar type names (the dump's dtypes) as torch's Python names (the wrappers').
_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Int": "int32",
    "Long": "int64",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
}


def op_name(profiling_name: str) -> str:
    """``nccl:all_reduce`` -> ``all_reduce``, ``nccl:send 0->1`` -> ``send``, ``nccl:_all_gather_base``
    -> ``all_gather_into_tensor``: the name the torch.distributed call has."""
    name = profiling_name.split(":", 1)[-1].split(" ", 1)[0]
    return _CALLS.get(name, name)


def tensors(entry: Collective) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    """The entry's input sizes and dtypes, dtypes named as torch names them (``float32``)."""
    return entry.input_sizes, tuple(_DTYPES.get(d, d.lower()) for d in entry.input_dtypes)


def rank_waits(trace: RankTrace, groups: Mapping[str, Sequence[int]] | None = None) -> RankWaits:
    """What ``trace``'s rank waits on, for the wait-for graph (see the module docstring).

    ``groups`` adds group ranks the dump lacks (the CPU build's gloo groups leave ``pg_config``
    empty; the ranks' state lines list each group's ranks); the dump's own ``pg_config`` wins.
    """
    known = {**{str(k): tuple(v) for k, v in (groups or {}).items()}, **trace.groups}
    whole = trace.first_record == 0  # nothing dropped from the ring buffer
    in_ring = {e.pg_name for e in trace.entries}
    # A group with no entry left in the ring has an unknown count here, never 0.
    view_groups = known if whole else {g: r for g, r in known.items() if g in in_ring}
    entered: dict[str, int] = {}
    for e in trace.entries:
        if not e.is_p2p:
            entered[e.pg_name] = max(entered.get(e.pg_name, 0), e.seq)
    for e in trace.entries:  # pg_status counts what the ring dropped (by the entries' group names)
        if not e.is_p2p and e.group in trace.enqueued:
            entered[e.pg_name] = max(entered[e.pg_name], trace.enqueued[e.group])
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    main: Wait | None = None
    for e in sorted(trace.entries, key=lambda e: e.record_id):
        wait = _wait(e, known, sent, received, whole)
        if main is None and not e.done:
            main = wait
    return RankWaits(
        threads=(main,) if main is not None else (),
        groups=view_groups,
        entered=entered,
        sent=sent if whole else {},
        received=received if whole else {},
    )


def _wait(
    e: Collective,
    groups: Mapping[str, tuple[int, ...]],
    sent: dict[int, int],
    received: dict[int, int],
    whole: bool,
) -> Wait:
    """The entry as a wait (counting it in ``sent``/``received`` when it is a point-to-point op)."""
    op = op_name(e.op)
    sizes, dtypes = tensors(e)
    if not e.is_p2p:
        return Wait(op, "collective", e.pg_name, e.seq, None, op, True, FR_THREAD, sizes, dtypes)
    members = groups.get(e.pg_name)
    peer = (
        members[e.peer] if members is not None and e.peer is not None and 0 <= e.peer < len(members) else None
    )
    kind = "send" if op in ("send", "isend") else "recv" if op in ("recv", "irecv") else "unknown"
    if peer is None or kind == "unknown" or not whole:
        return Wait(op, "unknown", e.pg_name, e.seq, None, op, True, FR_THREAD)
    counts = sent if kind == "send" else received
    counts[peer] = counts.get(peer, 0) + 1
    return Wait(op, kind, e.pg_name, counts[peer], peer, op, True, FR_THREAD, sizes, dtypes)
