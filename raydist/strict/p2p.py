"""A strict group's point-to-point units (raydist.strict.group): sends and receives run as NCCL runs a group
call, messages matched by issue order per pair.

Every send and receive of a unit (one send or receive, or one `batch_isend_irecv` batch) is posted at once
(none of the unit waits for another, as in an NCCL group call), each message one gloo message of a header
(the sender's tag, size, dtype) and the data, on a gloo tag made from the message's index on its (sender,
receiver) pair, so messages match by issue order per pair whatever the caller's tags; the receiver checks
the header. gloo completes sends and receives only while something waits for them, so these units run on
the group's waiter thread; gloo's TCP sends do not complete before their receive is posted: nothing buffers.
"""

from __future__ import annotations

import torch

from raydist.strict.fingerprints import dtype_code, dtype_name
from raydist.strict.mode import StrictCollectiveError
from raydist.strict.units import Unit

HEADER_BYTES = 24  # a message's header: tag, numel, dtype code (int64 each)


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def slot(sender: int, receiver: int, n: int, data: bool) -> int:
    """A gloo tag for message n of the (sender, receiver) pair: its header or its data."""
    return (n * 2 + int(data)) * 2 + int(sender < receiver)


def run(unit: Unit, entries: list[tuple[str, torch.Tensor, int, int]]) -> None:
    """Runs `unit`'s messages on its group's gloo group; entries: (send|recv, tensor, peer group rank, the
    caller's tag), one per op of the unit. Every operation is posted at once (NCCL's group semantics: none
    waits for another of the unit). A message is one gloo message: a header (the sender's tag, size, dtype)
    then the tensor's bytes; the receiver checks the header against what it asked for."""
    group = unit.group
    me = group.rank()
    works, receives = [], []
    for op, (kind, tensor, peer, tag) in zip(unit.ops, entries):
        data = _contiguous(tensor).view(-1).view(torch.uint8)
        if kind == "send":
            header = torch.tensor([tag, tensor.numel(), dtype_code(tensor.dtype)], dtype=torch.int64)
            message = torch.cat([header.view(torch.uint8), data])
            works.append((group.inner.send([message], peer, slot(me, peer, op.n, True)), message))
        else:
            message = torch.empty(HEADER_BYTES + data.numel(), dtype=torch.uint8)
            receives.append((op, tensor, message))
            works.append((group.inner.recv([message], peer, slot(peer, me, op.n, True)), message))
    for work, _ in works:
        unit.wait_gloo(work)
    for op, tensor, message in receives:
        tag, numel, dtype = message[:HEADER_BYTES].view(torch.int64).tolist()
        if (numel, dtype) != (tensor.numel(), dtype_code(tensor.dtype)) or tag != op.tag:
            raise StrictCollectiveError(
                f"strict collectives: {group.describe()}: rank {group.global_ranks[me]}'s {op.describe()} is "
                f"matched by rank {op.peer}'s message {op.n} to it, sent with tag {tag}, {numel} elements of "
                f"{dtype_name(dtype)}: NCCL matches messages by issue order per pair, not by tag, so the "
                "two ranks must issue them in the same order")
        payload = message[HEADER_BYTES:]
        if tensor.is_contiguous():
            tensor.view(-1).view(torch.uint8).copy_(payload)
        else:
            tensor.copy_(payload.view(tensor.dtype).view(tensor.shape))
