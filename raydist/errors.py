"""The exception types for bad user input, importable by leaf code without the config or data modules.

A `ConfigError`'s message is one line naming the offending value and the fix
(`parallel.tp=3 does not divide model.num_heads=8; pick tp from [2, 4, 8]`), so the CLI prints it as
`error: ...` and exits 2, before any worker starts where the check can run on the driver. A `DataError`
names a file on storage (and its row) and what is wrong with it; the CLI treats it the same way.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator


class ConfigError(ValueError):
    """Bad user input. The message is one line naming the value and the fix."""


class DataError(ValueError):
    """Bad data on storage: the message names the file (and row) and what is wrong."""


def wrapped(error: BaseException, more: Callable[[BaseException], Iterable] = lambda e: ()) -> Iterator[BaseException]:
    """`error` and every error it wraps, each once, depth first: its cause and context, a Ray task error's
    `cause` (the worker's own exception) and what `more(e)` names (e.g. Ray Train's per-worker failures)."""
    seen: set[int] = set()
    stack: list = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend([getattr(e, "cause", None), e.__cause__, e.__context__, *more(e)])
