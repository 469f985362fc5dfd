"""The one redaction rule: no password, key or token reaches a log line, an exception, ``stats``
or a command's output (``kvplug config check``, ``kvplug serve``, ``kvplug inspect``).

Three parts, applied together wherever text leaves kvplug:

* structure (:func:`scrub`): a URL's user-info (``scheme://user:password@``) and every query
  parameter whose name says secret (``?password=``, ``token``, ``X-Amz-Signature``...) become
  ``***``, whatever their length;
* names (:func:`redact_data`, :func:`is_secret_name`): in a mapping (a tier's options, fsspec's
  ``storage_options``, nested ``client_kwargs``...) the value under a key whose name says secret
  (``key``, ``secret``, ``token``, ``password``, ``aws_secret_access_key``...) becomes ``***``; a
  ``*_env`` key holding a variable name is kept (it names where the secret is, not the secret);
* values (:class:`Redactor`): the secrets collected from a tier's options by the two rules above
  are replaced wherever they appear in free text (a library's exception, pydantic's echo of an
  input): anywhere when 6 characters or longer, as whole tokens when shorter (a one-letter
  password is inside every word; it is replaced where it stands alone: ``'x'``, ``=x``).

Command lines (:func:`redact_argv`): the value of ``--api-key``, ``--hf-token`` and any flag whose
name says secret, in both ``--flag VALUE`` and ``--flag=VALUE`` forms, abbreviated as argparse
accepts them (``--api-k``) or spelt with underscores (``--api_key``).

Names are read in any case and spelling (``AWS_SECRET_ACCESS_KEY``, ``secretKey``,
``Authorization``, ``passphrase``); a URL's user-info runs to the last ``@`` of its authority, so
a password holding ``@`` or a quote is masked whole. A variable's name (a ``*_env`` option) is
shown only when it looks like one (:func:`looks_like_variable`): a key pasted there is masked.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

MASK = "***"
#: A key or flag whose name holds one of these words (as a ``_``/``-``/camelCase part, or the end
#: of one: ``apikey``, ``secretkey``) holds a secret.
SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "pwd", "passphrase", "credential",
                "credentials", "auth", "authorization", "bearer", "cookie", "session",
                "signature", "user", "username")
#: Secrets shorter than this are replaced only as whole tokens.
SHORT = 6

#: a URL's user-info: everything up to the LAST ``@`` of its authority (a password may hold ``@``,
#: quotes or ``:``); over-masking a neighbour in text without spaces is the safe side
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^/?#\s]*)@")
_QUERY = re.compile(r"(?P<sep>[?&;])(?P<name>[A-Za-z0-9_.\-]+)=(?P<value>[^&#\s'\"]*)")
_CAMEL = (re.compile(r"([A-Z]+)([A-Z][a-z])"), re.compile(r"([a-z0-9])([A-Z])"))
_VARIABLE = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
_LIKE_KEY = re.compile(r"[0-9a-fA-F]{32,}")


def _name_parts(name: str) -> list[str]:
    """The words of a name in any spelling: ``AWS_SECRET_ACCESS_KEY``, ``awsSecretKey``,
    ``AWSSecretKey``, ``api-key`` all give their lower-case words."""
    text = str(name)
    for camel in _CAMEL:
        text = camel.sub(r"\1_\2", text)
    return [p for p in re.split(r"[^a-z0-9]+", text.lower()) if p]


def is_secret_name(name: str) -> bool:
    """Whether a key, query parameter, header or flag called ``name`` holds a secret."""
    for part in _name_parts(name):
        if part in SECRET_WORDS or part.endswith(("password", "secret", "token", "key")):
            return True
    return False


def looks_like_variable(value: str) -> bool:
    """Whether ``value`` (what a ``*_env`` option holds) looks like an environment variable's
    name, fit to print: upper-case letters, digits and underscores, not a run of hex, and short
    or with an underscore. Anything else may be a secret pasted where its name belongs."""
    return bool(_VARIABLE.fullmatch(value)) and not _LIKE_KEY.fullmatch(value) and (
        len(value) <= 24 or "_" in value)


def _env_name(key: str, value: Any) -> bool:
    """A ``*_env``/``*_envs`` option names environment variables, which are not secrets (shown
    when they look like names: :func:`looks_like_variable`)."""
    k = str(key).lower()
    values = value if isinstance(value, (list, tuple)) else [value]
    return k.endswith(("_env", "_envs")) and all(
        isinstance(v, str) and looks_like_variable(v) for v in values)


def scrub(text: str) -> str:
    """``text`` with URL user-info and secret query parameters masked (any length)."""
    text = _USERINFO.sub(lambda m: m["scheme"] + MASK + "@", text)
    return _QUERY.sub(lambda m: f"{m['sep']}{m['name']}={MASK}" if is_secret_name(m["name"])
                      else m[0], text)


def redact_data(value: Any) -> Any:
    """A copy of ``value`` (options, settings) fit to print: values under secret names masked,
    every string scrubbed (:func:`scrub`)."""
    if isinstance(value, Mapping):
        return {k: (MASK if is_secret_name(k) and not _env_name(k, v)
                    and v not in (None, "") and not isinstance(v, bool)
                    else redact_data(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_data(v) for v in value)
    if isinstance(value, str):
        return scrub(value)
    return value


def _url_secrets(text: str) -> Iterable[str]:
    """The user and password of each URL's user-info (the password whole: it may hold ``:``), and
    the values of secret query parameters; each also as percent-decoded (a client's message may
    show the decoded form)."""
    found: list[str] = []
    for m in _USERINFO.finditer(text):
        user, _, password = m["info"].partition(":")
        found += [user, password]
    for m in _QUERY.finditer(text):
        if is_secret_name(m["name"]):
            found.append(m["value"])
    for value in found:
        if value:
            yield value
            if "%" in value and unquote(value) != value:
                yield unquote(value)


def secrets_in(value: Any, sensitive: bool = False) -> list[str]:
    """Every secret string ``value`` holds: under a secret name (at any depth), in a URL's
    user-info or a secret query parameter of any string."""
    out: list[str] = []
    if isinstance(value, Mapping):
        for k, v in value.items():
            out += secrets_in(v, sensitive or (is_secret_name(k) and not _env_name(k, v)))
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            out += secrets_in(v, sensitive)
    elif isinstance(value, str):
        if sensitive and value:
            out.append(value)
        out += _url_secrets(value)
    elif sensitive and isinstance(value, (int, float)) and not isinstance(value, bool):
        out.append(str(value))
    return out


class Redactor:
    """Masks the secrets of some configuration (URLs, option mappings, any nesting) in text:
    :func:`scrub` first, then each secret value (module docstring)."""

    def __init__(self, *sources: Any) -> None:
        found = {s for s in secrets_in(list(sources)) if s and s != MASK}
        self._secrets = sorted(found, key=len, reverse=True)
        self._patterns = [re.compile(re.escape(s) if len(s) >= SHORT else
                                     rf"(?<![A-Za-z0-9]){re.escape(s)}(?![A-Za-z0-9])")
                          for s in self._secrets]

    def __call__(self, text: str) -> str:
        text = scrub(str(text))
        for pattern in self._patterns:
            text = pattern.sub(MASK, text)
        return text

    def holds_secret(self, text: str) -> bool:
        """Whether ``text`` says something :meth:`__call__` would mask."""
        return self(text) != str(text)

    def error(self, exc: BaseException) -> str:
        """``Type: message`` of an exception, credentials removed, bounded length."""
        msg = self(f"{type(exc).__name__}: {exc}")
        return msg if len(msg) <= 300 else msg[:297] + "..."


#: Flags of vLLM's server whose value is a secret whatever their name says.
SECRET_FLAGS = ("--api-key", "--hf-token")


def _secret_flag(flag: str) -> bool:
    """Whether ``flag`` takes a secret: one of :data:`SECRET_FLAGS` or abbreviated as argparse
    accepts (``--api-k``), in either spelling (``--api_key``), or a flag whose name says secret."""
    if not flag.startswith("--"):
        return False
    norm = flag.replace("_", "-")
    if len(norm) >= 4 and any(f.startswith(norm) for f in SECRET_FLAGS):
        return True
    return is_secret_name(norm[2:]) and not norm.endswith(("-file", "-path", "-env"))


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line fit to print: ``--api-key X`` and ``--api-key=X`` (and every flag whose
    name says secret) become ``--api-key ***``; every argument is scrubbed (:func:`scrub`)."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if _secret_flag(flag):
            out += [flag, MASK] if eq else [flag]
            mask_next = not eq
            continue
        out.append(scrub(arg))
    return out


def describe_validation_error(err: Mapping[str, Any], redact: Redactor) -> str:
    """One pydantic error as ``loc: message (got VALUE)``: the input is echoed only when it is a
    plain value under a name that is not secret, and the whole line goes through ``redact``
    (pydantic's own message may quote the input, e.g. ``input_value='...'``)."""
    loc = [str(p) for p in err.get("loc", ())]
    where = ".".join(loc) or "options"
    value = err.get("input")
    secret = any(is_secret_name(p) for p in loc)
    shown = ""
    if not secret and err.get("type") != "missing" and (
            isinstance(value, (int, float, bool)) or (isinstance(value, str) and len(value) < 80)):
        shown = f" (got {value!r})"
    return redact(f"{where}: {err.get('msg', '')}{shown}")
