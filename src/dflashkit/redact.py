"""What of a URL is secret, and how it is hidden: the one rule for every log line, message and file.

Usage:
    redact_url("https://u:pw@h:1/v1?api_key=k&x=2")        # 'https://***@h:1/v1?api_key=***&x=2'
    redact_text("cannot read http://u:pw@h/v1/models")      # 'cannot read http://***@h/v1/models'
    remember_secret("sk-abcdefgh12345"); mask_secrets("bad key sk-abcdefgh1…")  # 'bad key ***…'

The rule: a URL's user info (`user:password@`, the user too) becomes `***@`, and the value of every
query parameter whose name contains one of `SECRET_QUERY_WORDS` (`api_key`, `access_token`,
`X-Amz-Signature`, ...) becomes `***`; the scheme, host, port, path and the other query parameters
stay, so a message still says which server answered. `redact_text` applies it to every URL inside
free text (an exception's message, a log line, the JSON result line), which is how the CLI hides a
URL that reached a message it did not format itself. The config knows which of its fields are URLs
(`schema.f(..., url=True)`; `config.url_fields`): the resolved config and every result built from them
go through `redact_url`. API keys never sit in URLs here: `server.api_key_env` names the variable.

Credentials a server echoes back (a 401 quoting "Incorrect API key provided: Bearer sk-…") are the
other half. The HTTP client (`dflashkit.http1`) is the one place that sends credentials; it calls
`remember_secret` for every one (an Authorization-like header's value and its token, a URL's
password, `user:password` and their Basic token) and masks every body and error it hands on
(`mask_secrets`, `mask_bytes`). `redact_text` masks them too, so every log line and the JSON result
line are covered whoever formatted them. Masking replaces each secret with `***` wherever it appears;
in messages (`partial=True`) also any run of 8 or more characters that starts the secret or ends it
(a truncated `sk-proj-Zq81…`, a masked middle `…RcY7mBdE5hUf2`). Training text (a 200 reply's
content) is masked only where the whole secret appears. Secrets shorter than 4 characters are not
masked: hiding every `ab` of a message would hide the message, not the secret.
"""

from __future__ import annotations

import base64
import binascii
import re

SECRET_QUERY_WORDS = ("key", "token", "secret", "password", "passwd", "pwd", "sig", "auth")

# After `scheme://`, everything up to the LAST `@` before the path, query or fragment is user info
# (a raw `@` inside a password included: greedy). Never across whitespace, `"`, `\`, `<`, `>`, `[` or
# `]` (not characters of user info or a query): free text, a list or a JSON string may follow the URL.
_USERINFO = re.compile(r'(?<=://)[^/?#\s"<>\\\[\]]*@')
# One whole URL: user info is everything before the last `@` of the authority, whatever the characters.
_URL_USERINFO = re.compile(r"^([^/?#]*://)?[^/?#]*@")
_QUERY_PARAM = re.compile(r"""([?&;])([^=&#\s?;"'<>\\\[\]]*)=([^&#\s;"'<>\\\[\]]*)""")


def _hide_query(m: re.Match) -> str:
    name = m.group(2)
    if any(word in name.lower() for word in SECRET_QUERY_WORDS):
        return f"{m.group(1)}{name}=***"
    return m.group(0)


def redact_text(text: str) -> str:
    """`text` with the user info and secret query values of every `scheme://` URL in it hidden, and every
    credential this process sent masked (`mask_secrets`)."""
    text = str(text)
    if "@" in text:
        text = _USERINFO.sub("***@", text)
    if "=" in text:
        text = _QUERY_PARAM.sub(_hide_query, text)
    return mask_secrets(text) if _SENT else text


MASK = "***"
MIN_SECRET_CHARS = 4  # shorter values are not masked (see the module docstring)
PARTIAL_CHARS = 8  # a run this long of a secret's start or end is masked in messages

# Every credential sent from this process, longest first (a secret that contains another is masked whole).
_SENT: list[str] = []
# Header names whose values are credentials (besides those naming a SECRET_QUERY_WORDS word: X-Api-Key, ...).
_AUTH_HEADERS = ("authorization", "proxy-authorization")


def remember_secret(value: str | None) -> None:
    """Register a credential this process sends, so that every later `mask_secrets` / `redact_text` hides it."""
    if value and len(value) >= MIN_SECRET_CHARS and value not in _SENT:
        _SENT.append(value)
        _SENT.sort(key=len, reverse=True)


def remember_header(name: str, value: str) -> None:
    """Register the credentials in one request header (a no-op for a header that carries none): the value, or
    of a `<scheme> <token>` value the token, and for Basic its decoded `user:password` and password."""
    low = name.lower()
    if low not in _AUTH_HEADERS and not any(w in low for w in SECRET_QUERY_WORDS):
        return
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    remember_secret(token or scheme)  # not "Bearer <token>": its first 8 characters are every bearer's
    if not token:
        return
    if scheme.lower() == "basic":
        try:
            pair = base64.b64decode(token, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return
        remember_secret(pair)
        remember_secret(pair.partition(":")[2])


def _mask_runs(text: str, secret: str) -> str:
    """`text` with every run of >= PARTIAL_CHARS characters that starts or ends `secret` replaced by MASK."""
    head, tail = secret[:PARTIAL_CHARS], secret[-PARTIAL_CHARS:]
    pos = text.find(head)
    while pos >= 0:
        end, k = pos + PARTIAL_CHARS, PARTIAL_CHARS
        while k < len(secret) and end < len(text) and text[end] == secret[k]:
            end, k = end + 1, k + 1
        text = text[:pos] + MASK + text[end:]
        pos = text.find(head, pos + len(MASK))
    pos = text.find(tail)
    while pos >= 0:
        start, k = pos, len(secret) - PARTIAL_CHARS
        while k > 0 and start > 0 and text[start - 1] == secret[k - 1]:
            start, k = start - 1, k - 1
        text = text[:start] + MASK + text[pos + PARTIAL_CHARS:]
        pos = text.find(tail, start + len(MASK))
    return text


def mask_secrets(text: str, *, partial: bool = True) -> str:
    """`text` with every registered secret replaced by `***`; `partial`: also every run of 8 or more of its
    first or last characters (an echo cut short, or shown with its middle hidden)."""
    for secret in _SENT:
        if secret in text:
            text = text.replace(secret, MASK)
    if partial:
        for secret in _SENT:
            if len(secret) > PARTIAL_CHARS and (secret[:PARTIAL_CHARS] in text or secret[-PARTIAL_CHARS:] in text):
                text = _mask_runs(text, secret)
    return text


def mask_bytes(body: bytes, *, partial: bool = True) -> bytes:
    """`mask_secrets` over a response body (UTF-8, any undecodable bytes kept as they were); `body` itself,
    uncopied, when no secret shows in it."""
    probes = [s for secret in _SENT for s in ((secret, secret[:PARTIAL_CHARS], secret[-PARTIAL_CHARS:])
                                              if partial and len(secret) > PARTIAL_CHARS else (secret,))]
    if not any(p.encode("utf-8", "surrogateescape") in body for p in probes):
        return body
    text = body.decode("utf-8", "surrogateescape")
    return mask_secrets(text, partial=partial).encode("utf-8", "surrogateescape")


def redact_url(url: str) -> str:
    """`url` (one URL, with or without a scheme: `u:pw@host:1/v1`) with its secrets hidden, for logs and files."""
    url = _URL_USERINFO.sub(lambda m: (m.group(1) or "") + "***@", str(url))
    return _QUERY_PARAM.sub(_hide_query, url) if "=" in url else url
