"""Find a deadlock among ranks from their published states (pure: no torch, no store).

Each stalled rank publishes (raydist.strict.runtime) its state: per strict group the units it has issued and
not completed, in order (the first runs on the group's stream, the rest are queued behind it), how many
collectives and messages per peer have completed, and the units its host threads are blocked on.

A stream (rank r, group g) can finish its running unit only when every operation in it is matched. The
counterpart of an operation on a peer q is the collective with the same sequence number, or the message with
the same index on the pair. Where that counterpart is:

    completed, or in q's running unit of g      no wait (it is being matched)
    queued on q behind q's running unit of g     (r, g) waits for (q, g)
    not issued, q's host blocked on units        (r, g) waits for the streams running those units
    not issued, q's host in a group creation     (r, g) waits for that rendezvous (every world rank joins)
    not issued, q's host not blocked, or q unknown   it may come: no deadlock through it

A rank waiting in a group creation (raydist.strict.splits) waits for every world rank that has not joined
it yet, through whatever that rank's host is blocked in.

A node can progress if every operation it runs has at least one way to be matched that can progress; what
can progress is the least fixed point from the nodes that wait for nothing. Whatever cannot progress is
deadlocked: each of its waits leads back into the set. Ranks that published nothing recently are unknown
and treated as able to progress, so a slow rank is never called deadlocked.
"""

from __future__ import annotations

from dataclasses import dataclass

Node = tuple  # ("stream", rank, group) or ("rendezvous", rank)


@dataclass(frozen=True)
class Deadlock:
    nodes: frozenset  # the stream nodes that cannot progress
    lines: tuple[str, ...]  # one per stuck stream: what it runs and whom it waits for

    @property
    def ranks(self) -> list[int]:
        return sorted({n[1] for n in self.nodes})

    def message(self) -> str:
        return ("strict collectives: deadlock (NCCL would hang here until its watchdog aborts every rank): "
                + "; ".join(self.lines))


def _describe(op: list) -> str:
    kind, name, n, peer = op[:4]
    if kind == "coll":
        return f"{name} #{n}"
    return f"{name} {'to' if kind == 'send' else 'from'} rank {peer} (message {n} of the pair)"


def _unit_text(unit: dict) -> str:
    ops = [_describe(op) for op in unit["ops"]]
    return ops[0] if len(ops) == 1 else "batch [" + ", ".join(ops) + "]"


def _counterpart(op: list, me: int) -> tuple[str, int, int]:
    """What matches `op` (issued by rank `me`) on its peer: (kind, n, peer-of-the-counterpart)."""
    kind, _, n = op[:3]
    if kind == "send":
        return "recv", n, me
    if kind == "recv":
        return "send", n, me
    return "coll", n, -1


def _locate(state: dict, kind: str, n: int, partner: int) -> tuple[str, int]:
    """Where the operation is in one rank's group state: ("done"|"running"|"queued"|"absent", unit index)."""
    if kind == "coll":
        if state["coll"] >= n:
            return "done", -1
    elif state[kind].get(str(partner), 0) > n:
        return "done", -1
    for i, unit in enumerate(state["units"]):
        for op in unit["ops"]:
            if op[0] == kind and op[2] == n and (kind == "coll" or op[3] == partner):
                return ("running" if i == 0 else "queued"), i
    return "absent", -1


def _host_blockers(states: dict[int, dict], q: int) -> tuple[list[Node], str] | None:
    """What rank q's host is blocked in (strict units or a group-creation rendezvous), or None when it is
    not blocked: then it may still issue anything."""
    state = states[q]
    waits, rendezvous = state.get("waits", []), state.get("rendezvous")
    targets = [("stream", q, g) for g, _ in waits]
    texts = [f"{_unit_text(_unit(state, g, u))} on group '{g}'" for g, u in waits]
    if rendezvous:
        targets.append(("rendezvous", q))
        texts.append(f"the world's {rendezvous[0]} #{rendezvous[1]} (a group creation every rank must join)")
    return (targets, ", ".join(texts)) if targets else None


def _posted(state: dict, kind: str, k: int) -> bool:
    posted = state.get("posted", {})
    return bool(posted.get("bind")) if kind == "bind" else posted.get("split", 0) >= k


def find(states: dict[int, dict], me: int | None = None) -> Deadlock | None:
    """The deadlock among `states` ({rank: published state}), or None; with `me`, only one that includes
    rank `me`. Nodes: ("stream", rank, group) for a group's running unit, ("rendezvous", rank) for a host
    waiting until every world rank joins a group creation (raydist.strict.splits)."""
    requirements: dict[Node, list[tuple[list[Node], str]]] = {}
    texts: dict[Node, str] = {}
    for rank, state in states.items():
        for name, group in state["groups"].items():
            if not group["units"]:
                continue
            node = ("stream", rank, name)
            head = group["units"][0]
            texts[node] = f"rank {rank} on group '{name}' (ranks {group['ranks']}) runs {_unit_text(head)}"
            needs = []
            for op in head["ops"]:
                kind, n, partner = _counterpart(op, rank)
                peers = [op[3]] if op[0] != "coll" else [r for r in group["ranks"] if r != rank]
                for q in peers:
                    theirs = states.get(q, {}).get("groups", {}).get(name)
                    if theirs is None:
                        continue  # unknown: it may come
                    where, index = _locate(theirs, kind, n, partner)
                    what = _describe(op)
                    if where == "queued":
                        blocker = _unit_text(theirs["units"][0])
                        needs.append(([("stream", q, name)], f"{what} waits for rank {q}, whose match is queued "
                                                              f"behind its {blocker}"))
                    elif where == "absent":
                        blocked = _host_blockers(states, q)
                        if blocked is not None:
                            needs.append((blocked[0], f"{what} waits for rank {q}, which has not issued its match: "
                                                      f"its host is blocked waiting for {blocked[1]}"))
            requirements[node] = needs
        if state.get("rendezvous"):
            kind, k = state["rendezvous"]
            node = ("rendezvous", rank)
            texts[node] = f"rank {rank} waits in the world's {kind} #{k} for every rank to join"
            needs = []
            for q in range(state.get("world", 0)):
                if q == rank or q not in states or _posted(states[q], kind, k):
                    continue
                blocked = _host_blockers(states, q)
                if blocked is not None:
                    needs.append((blocked[0], f"rank {q} has not joined: its host is blocked waiting for {blocked[1]}"))
            requirements[node] = needs
    live: set[Node] = set()
    changed = True
    while changed:
        changed = False
        for node, needs in requirements.items():
            if node in live:
                continue
            if all(any(t in live or t not in requirements for t in targets) for targets, _ in needs):
                live.add(node)
                changed = True
    stuck = frozenset(n for n in requirements if n not in live)
    if not stuck or (me is not None and all(n[1] != me for n in stuck)):
        return None
    lines = []
    for node in sorted(stuck, key=lambda n: (n[1], n[0], n[2] if len(n) > 2 else "")):
        reasons = [text for targets, text in requirements[node] if not any(t in live for t in targets)]
        lines.append(f"{texts[node]}: " + "; ".join(reasons))
    return Deadlock(stuck, tuple(lines))


def _unit(state: dict, group: str, uid: int) -> dict:
    for unit in state["groups"].get(group, {}).get("units", []):
        if unit["id"] == uid:
            return unit
    return {"ops": [["?", "an operation", uid, -1, 0]]}


def mismatch(states: dict[int, dict], me: int) -> tuple[str, list[str]] | None:
    """Two members of a group whose pending collectives of the same sequence number differ (kind or size),
    one of them rank `me`: (the message, the groups of `me` it breaks), or None. Collectives are otherwise
    compared by their fingerprints every few operations (raydist.strict.fingerprints); this names a mismatch that
    hangs before that."""
    mine = states.get(me, {}).get("groups", {})
    for name, group in mine.items():
        for unit in group["units"]:
            for op in unit["ops"]:
                if op[0] != "coll":
                    continue
                for q in group["ranks"]:
                    theirs = states.get(q, {}).get("groups", {}).get(name) if q != me else None
                    for other in (o for u in (theirs or {}).get("units", []) for o in u["ops"]):
                        if other[0] == "coll" and other[2] == op[2] and (other[1], other[5:]) != (op[1], op[5:]):
                            size = lambda o: f" ({o[5]})" if len(o) > 5 and o[5] else ""  # noqa: E731
                            return (f"strict collectives: group '{name}' (ranks {group['ranks']}): rank {me} issued "
                                    f"{op[1]} #{op[2]}{size(op)} where rank {q} issued {other[1]} #{other[2]}"
                                    f"{size(other)}; NCCL needs every member to issue a group's collectives in the "
                                    "same order with the same kind, dtype, size and root (it would hang or mix the "
                                    "data)", [name])
    return None
