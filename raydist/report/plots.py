"""The report's panels, each a function that draws on one matplotlib Axes (Agg backend, no display).

Every panel is drawn whether or not its data exists: an empty one says "no data" and what would fill it,
so a report of a short run looks like a report of a long one. Events (restarts, resizes, checkpoints)
are drawn as vertical lines on every time or step axis: red restarts, orange resizes, grey checkpoints,
black dashed failed checkpoints.
"""

from __future__ import annotations

import io
from typing import Callable

from matplotlib.figure import Figure

from raydist.report.data import RunData, format_value, goodput

EVENT_STYLE = {
    "restart": dict(color="tab:red", linestyle="-", linewidth=1.6),
    "resize": dict(color="tab:orange", linestyle="-.", linewidth=1.4),
    "checkpoint": dict(color="0.6", linestyle=":", linewidth=1.0),
    "checkpoint_failed": dict(color="black", linestyle="--", linewidth=1.0),
}


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no data\n({what})", ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _mark_events(ax, data: RunData, axis: str) -> None:
    """Vertical lines at each event's `axis` coordinate ('step' or 'elapsed_s'); one legend entry per kind."""
    labelled = set()
    for event in data.events:
        kind = event.get("kind")
        x = event.get(axis)
        if kind not in EVENT_STYLE or x is None:
            continue
        label = kind.replace("_", " ") if kind not in labelled else None
        labelled.add(kind)
        ax.axvline(x, label=label, **EVENT_STYLE[kind])


def attempts(data: RunData, records: list[dict]) -> list[list[dict]]:
    """Split records at each restart (by elapsed time), so that steps re-done after a restart are drawn
    as a new line instead of a zig-zag back."""
    cuts = sorted(e["elapsed_s"] for e in data.events_of("restart") if e.get("elapsed_s") is not None)
    groups: list[list[dict]] = [[] for _ in range(len(cuts) + 1)]
    for r in records:
        t = r.get("elapsed_s") or 0.0
        groups[sum(1 for c in cuts if t >= c)].append(r)
    return [g for g in groups if g]


def panel_loss(ax, data: RunData) -> bool:
    have = [r for r in data.metrics if "step" in r and (r.get("loss") is not None or r.get("val_loss") is not None)]
    if not have:
        _no_data(ax, "loss / val_loss in metrics.jsonl")
        return False
    for i, group in enumerate(attempts(data, have)):
        suffix = f" (attempt {i + 1})" if data.events_of("restart") else ""
        train = [(r["step"], r["loss"]) for r in group if r.get("loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in group if r.get("val_loss") is not None]
        if train:
            ax.plot(*zip(*train), marker=".", markersize=3, color=f"C{2 * i}", label="loss" + suffix)
        if val:
            ax.plot(*zip(*val), marker="o", markersize=4, color=f"C{2 * i + 1}", label="val loss" + suffix)
    _mark_events(ax, data, "step")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7, loc="upper right")
    return True


def panel_throughput(ax, data: RunData) -> bool:
    rows = [(r["elapsed_s"], r.get("tokens_per_s"), r.get("mfu")) for r in data.train_records()
            if r.get("elapsed_s") is not None]
    if not rows:
        _no_data(ax, "tokens_per_s / mfu in metrics.jsonl")
        return False
    t = [r[0] for r in rows]
    ax.plot(t, [r[1] for r in rows], color="tab:blue", marker="o", linewidth=2.5, label="tokens/s")
    ax.set_xlabel("elapsed (s)")
    ax.set_ylabel("tokens/s", color="tab:blue")
    ax.set_ylim(bottom=0)
    handles = []
    mfu = [(r[0], r[2]) for r in rows if r[2] is not None]
    if mfu:  # MFU is tokens/s times a constant while the peak is fixed: dashed, on its own axis
        right = ax.twinx()
        handles = right.plot(*zip(*[(x, 100 * y) for x, y in mfu]), color="tab:green", linestyle="--",
                             marker="x", label="MFU (right)")
        right.set_ylabel("MFU (%)", color="tab:green")
        right.set_ylim(bottom=0)
    _mark_events(ax, data, "elapsed_s")
    mine, labels = ax.get_legend_handles_labels()
    ax.legend(mine + handles, labels + [h.get_label() for h in handles], fontsize=7, loc="lower right")
    return True


def panel_memory(ax, data: RunData) -> bool:
    per_rank = data.latest("mem_peak_mb_per_rank")
    if per_rank:
        values = per_rank["mem_peak_mb_per_rank"]
        ax.bar(range(len(values)), values, color="tab:purple")
        ax.set_xticks(range(len(values)))
        ax.set_xlabel(f"rank (step {per_rank.get('step')})")
        ax.set_ylabel("peak memory (MB)")
        return True
    rows = [(r["elapsed_s"], r["mem_peak_mb"]) for r in data.train_records()
            if r.get("mem_peak_mb") is not None and r.get("elapsed_s") is not None]
    if not rows:
        _no_data(ax, "mem_peak_mb_per_rank or mem_peak_mb in metrics.jsonl")
        return False
    ax.plot(*zip(*rows), color="tab:purple", marker=".", label="rank 0 peak")
    ax.set_ylim(0, 1.1 * max(v for _, v in rows))
    _mark_events(ax, data, "elapsed_s")
    ax.set_xlabel("elapsed (s)")
    ax.set_ylabel("peak memory (MB)")
    ax.legend(fontsize=7)
    return True


# (action kind, second chunk of its rank) -> colour: forward, backward (input gradient when split), weight
ACTION_COLORS = {("F", False): "tab:blue", ("B", False): "tab:green", ("W", False): "tab:orange",
                 ("F", True): "tab:cyan", ("B", True): "tab:olive", ("W", True): "gold"}


def panel_pipeline(ax, data: RunData) -> bool:
    """The measured schedule of one step: a bar per F/B/W action, a row per pipeline rank."""
    if not data.timeline:
        stats = data.latest("pipeline")
        if stats:
            p = stats["pipeline"]
            busy, idle = p.get("busy_s") or [], p.get("idle_s") or []
            stages = range(len(busy))
            ax.barh(stages, busy, color="tab:blue", label="busy")
            ax.barh(stages, idle, left=busy, color="0.85", label="idle")
            ax.set_yticks(list(stages))
            ax.set_ylabel("stage")
            ax.set_xlabel("seconds per step")
            ax.set_title(f"bubble {p.get('bubble', 0):.1%} (no timeline file)", fontsize=8)
            ax.legend(fontsize=7)
            return True
        _no_data(ax, "pipeline_timeline.json or pipeline in metrics.jsonl")
        return False
    ranks = sorted({a.get("rank", a.get("stage", 0)) for a in data.timeline})
    row = {r: i for i, r in enumerate(ranks)}
    for a in data.timeline:
        start, end = a.get("start_s", 0.0), a.get("end_s", 0.0)
        y = row[a.get("rank", a.get("stage", 0))]
        color = ACTION_COLORS.get((a.get("kind"), bool(a.get("chunk", 0))), "0.5")
        ax.barh(y, end - start, left=start, color=color, edgecolor="white", linewidth=0.5)
        if end - start > 0:
            ax.text((start + end) / 2, y, str(a.get("microbatch", "")), ha="center", va="center", fontsize=6,
                    color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the step (F blue, B green, W orange; a rank's second chunk lighter)")
    stats = data.latest("pipeline")
    if stats:
        ax.set_title(f"measured bubble {stats['pipeline'].get('bubble', 0):.1%}", fontsize=8)
    return True


def panel_events(ax, data: RunData) -> bool:
    """World size over time, with every event on the time axis."""
    rows = sorted((r["elapsed_s"], r["world_size"]) for r in [*data.metrics, *data.events]
                  if r.get("world_size") is not None and r.get("elapsed_s") is not None)
    if not rows and not data.events:
        _no_data(ax, "events.jsonl or world_size in metrics.jsonl")
        return False
    if rows:
        ax.step(*zip(*rows), where="post", color="tab:blue", label="world size")
        ax.set_ylabel("workers")
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(0, max(w for _, w in rows) + 1)
    _mark_events(ax, data, "elapsed_s")
    for event in data.events_of("start", "end"):
        if event.get("elapsed_s") is not None:
            ax.annotate(event["kind"], (event["elapsed_s"], 0.02), xycoords=("data", "axes fraction"), fontsize=7)
    if not data.events:
        ax.set_title("no events.jsonl: restarts and checkpoints not recorded", fontsize=8)
    ax.set_xlabel("elapsed (s)")
    ax.legend(fontsize=7, loc="center right")
    return True


def panel_goodput(ax, data: RunData) -> bool:
    g = goodput(data)
    ax.axis("off")
    lines = [f"{key.replace('_', ' ')}: {format_value(value)}" for key, value in g.items()]
    ax.text(0.02, 0.98, "\n".join(lines), va="top", ha="left", family="monospace", fontsize=8,
            transform=ax.transAxes)
    return True



# (id, title, draw function) in page order
PANELS: list[tuple[str, str, Callable]] = [
    ("loss", "Loss and validation loss", panel_loss),
    ("throughput", "Tokens/s and MFU over time", panel_throughput),
    ("memory", "Peak memory per rank", panel_memory),
    ("pipeline", "Pipeline timeline (one measured step)", panel_pipeline),
    ("events", "Restarts, resizes and checkpoints", panel_events),
    ("goodput", "Goodput summary", panel_goodput),
]


def render_panel(panel_id: str, data: RunData, size=(6.4, 3.6), with_title: bool = True) -> tuple[bytes, bool]:
    """One panel as PNG bytes, and whether it had data."""
    _, title, draw = next(p for p in PANELS if p[0] == panel_id)
    fig = Figure(figsize=size, dpi=100)  # not pyplot's: no global figure registry, no backend to select
    ax = fig.subplots()
    has_data = draw(ax, data)
    if with_title:
        ax.set_title(title if not ax.get_title() else f"{title}\n{ax.get_title()}", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")  # a Figure without a canvas prints through Agg
    return buf.getvalue(), has_data


def render_overview(data: RunData) -> bytes:
    """All panels on one page (report.png)."""
    fig = Figure(figsize=(13, 12), dpi=100)
    axes = fig.subplots(3, 2)
    for ax, (_, title, draw) in zip(axes.flat, PANELS):
        draw(ax, data)
        ax.set_title(title if not ax.get_title() else f"{title}\n{ax.get_title()}", fontsize=10)
    fig.suptitle(f"raydist run {data.name}", fontsize=13)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
