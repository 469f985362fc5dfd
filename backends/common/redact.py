"""Credential scrubbing for the remote tiers: no password, key or token reaches a log line,
an error message or ``stats`` (fsspec's storage options and URL user-info, resp's URL and
password)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "auth", "session")
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


class Redactor:
    """Removes credential values (from ``storage_options`` and URL user-info) from text."""

    def __init__(self, url: str, storage_options: Mapping[str, Any]) -> None:
        self._secrets: list[str] = []
        self._collect(storage_options, sensitive=False)
        m = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://([^/@\s]*)@", url)
        if m:
            self._secrets.extend(p for p in re.split(r"[:]", m.group(1)) if len(p) >= 3)
        self._secrets.sort(key=len, reverse=True)

    def _collect(self, value: Any, sensitive: bool) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                word = str(k).lower()
                self._collect(v, sensitive or any(s in word for s in _SECRET_WORDS))
        elif isinstance(value, (list, tuple)):
            for v in value:
                self._collect(v, sensitive)
        elif sensitive and isinstance(value, str) and len(value) >= 3:
            self._secrets.append(value)

    def __call__(self, text: str) -> str:
        text = _USERINFO.sub(r"\g<scheme>***@", text)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def error(self, exc: BaseException) -> str:
        """``Type: message`` of an exception, credentials removed, bounded length."""
        msg = self(f"{type(exc).__name__}: {exc}")
        return msg if len(msg) <= 300 else msg[:297] + "..."
