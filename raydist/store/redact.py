"""Credentials out of every URI raydist writes or prints.

A storage URI may carry secrets: user info (`s3://KEY:SECRET@bucket/...`, `ftp://user:pw@host/...`) or
query parameters (`?token=...`, a presigned `?X-Amz-Signature=...&X-Amz-Credential=...`, an Azure SAS
`?sig=...`). The real URI is what the I/O uses; `redact` is applied to the copies that leave the
process as text: config.toml, events.jsonl, log and error lines, DCP's metadata.

    redact("s3://AKIA:abc@bucket/runs")               -> "s3://***@bucket/runs"
    redact("see https://h/x?token=abc&a=1 for more")  -> "see https://h/x?token=***&a=1 for more"

It takes any text: every `scheme://...` inside it is redacted, the rest is left as it is.
"""

from __future__ import annotations

import re

MASK = "***"

# scheme://rest-of-the-URI up to whitespace or a quote (TOML strings, JSON, messages quote URIs).
_URI = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://(?P<rest>[^\s'\"<>`]+)")
# A query parameter whose name says it is a secret.
_USER_PASSWORD = re.compile(r"[^/?#@:]*:[^?#@]*@")
_SECRET_NAME = re.compile(r"(token|secret|signature|sig|password|passwd|pwd|credential|key|auth|session|sas)",
                          re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with the user info and secret-looking query values of every URI in it replaced by ***."""
    if not isinstance(text, str) or "://" not in text:
        return text
    return _URI.sub(_redact_match, text)


def _redact_match(match: re.Match) -> str:
    rest = match.group("rest")
    userinfo = _USER_PASSWORD.match(rest)  # user:password@ (secret keys may hold an unescaped "/")
    if userinfo:
        rest = MASK + "@" + rest[userinfo.end():]
    else:
        authority = re.match(r"[^/?#]*", rest).group(0)
        if "@" in authority:  # token@host
            rest = MASK + "@" + rest[authority.rindex("@") + 1:]
    path, question, query = rest.partition("?")
    if question:
        query, hash_, fragment = query.partition("#")
        rest = path + "?" + "&".join(_redact_param(p) for p in query.split("&")) + hash_ + fragment
    return f"{match.group('scheme')}://{rest}"


def _redact_param(param: str) -> str:
    name, eq, value = param.partition("=")
    if not (eq and value and _SECRET_NAME.search(name)):
        return param
    secret = re.match(r"[^)\];,]*", value).group(0)  # a URI quoted in prose may end in ")", ";" or ","
    return f"{name}={MASK}{value[len(secret):]}"


def redact_tree(value):
    """`redact` applied to every string in a nested dict/list (event records)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_tree(v) for v in value]
    return value
