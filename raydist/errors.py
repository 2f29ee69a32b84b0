"""The one exception type for bad user input, importable by leaf code without the config module.

A `ConfigError`'s message is one line naming the offending value and the fix
(`parallel.tp=3 does not divide model.num_heads=8; pick tp from [2, 4, 8]`), so the CLI prints it as
`error: ...` and exits 2, before any worker starts where the check can run on the driver.
"""


class ConfigError(ValueError):
    """Bad user input. The message is one line naming the value and the fix."""
