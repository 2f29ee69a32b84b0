"""A single self-contained HTML page: every panel as an inline base64 PNG, the goodput summary and the
event list as tables, the config verbatim. No scripts, no fonts, no links out: it opens from disk in a
browser with no network."""

from __future__ import annotations

import base64
import html
import time

from raydist.report.data import RunData, format_value, goodput
from raydist.report.plots import PANELS, render_panel

STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; max-width: 1400px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin: 0.2em 0; }
.grid { display: flex; flex-wrap: wrap; gap: 1em; }
section.panel { border: 1px solid #ddd; padding: 0.5em; flex: 1 1 560px; max-width: 680px; }
section.panel img { width: 100%; height: auto; }
section.panel.empty h2::after { content: " (no data)"; color: #999; font-weight: normal; }
table { border-collapse: collapse; font-size: 0.9em; } td, th { border: 1px solid #ddd; padding: 2px 8px; }
pre { background: #f6f6f6; padding: 0.8em; font-size: 0.8em; overflow-x: auto; }
"""


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def plan_comparison(data: RunData) -> str:
    """`raydist plan --from-run`'s comparison of the cost model with the run, or why there is none."""
    from raydist.errors import ConfigError
    from raydist.planner.from_run import compare_run, format_comparison

    try:
        return format_comparison(compare_run(data.run_dir))
    except ConfigError as exc:
        return f"n/a: {exc}"
    except Exception as exc:  # (an auxiliary section: records it cannot read must not cost the whole report)
        return f"n/a: {type(exc).__name__}: {exc}"


def render_html(data: RunData) -> str:
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>raydist run {html.escape(data.name)}</title>",
             f"<style>{STYLE}</style></head><body>",
             f"<h1>raydist run {html.escape(data.name)}</h1>",
             f"<p>{html.escape(data.run_dir)} &middot; report made {time.strftime('%Y-%m-%d %H:%M:%S')}</p>",
             "<div class='grid'>"]
    for panel_id, title, _ in PANELS:
        png, has_data = render_panel(panel_id, data, with_title=False)  # the page's <h2> is the title
        encoded = base64.b64encode(png).decode("ascii")
        css = "panel" if has_data else "panel empty"
        parts.append(f"<section class='{css}' id='panel-{panel_id}'><h2>{html.escape(title)}</h2>"
                     f"<img alt='{html.escape(title)}' src='data:image/png;base64,{encoded}'></section>")
    parts.append("</div>")
    parts.append("<section id='summary'><h2>Goodput summary</h2>"
                 + _table([(k.replace("_", " "), format_value(v)) for k, v in goodput(data).items()]) + "</section>")
    if data.events:
        rows = [(f"{format_value(e.get('elapsed_s'))} s, step {format_value(e.get('step'))}",
                 f"{e.get('kind')}: " + ", ".join(f"{k}={format_value(v)}" for k, v in e.items()
                                                    if k not in ("kind", "elapsed_s", "step", "time")))
                for e in data.events]
        parts.append("<section id='event-list'><h2>Events</h2>" + _table(rows) + "</section>")
    else:
        parts.append("<section id='event-list'><h2>Events</h2><p>no data (no events.jsonl)</p></section>")
    parts.append("<section id='plan'><h2>The plan against this run</h2><pre>" + html.escape(plan_comparison(data))
                 + "</pre></section>")
    if data.warnings:
        parts.append("<section id='warnings'><h2>Warnings</h2><pre>" + html.escape("\n".join(data.warnings))
                     + "</pre></section>")
    parts.append("<section id='config'><h2>config.toml</h2><pre>"
                 + html.escape(data.config_text or "no data (no config.toml)") + "</pre></section>")
    parts.append("</body></html>")
    return "\n".join(parts)
