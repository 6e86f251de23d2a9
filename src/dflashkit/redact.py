"""What of a URL is secret, and how it is hidden: the one rule for every log line, message and file.

Usage:
    redact_url("https://u:pw@h:1/v1?api_key=k&x=2")        # 'https://***@h:1/v1?api_key=***&x=2'
    redact_text("cannot read http://u:pw@h/v1/models")      # 'cannot read http://***@h/v1/models'

The rule: a URL's user info (`user:password@`, the user too) becomes `***@`, and the value of every
query parameter whose name contains one of `SECRET_QUERY_WORDS` (`api_key`, `access_token`,
`X-Amz-Signature`, ...) becomes `***`; the scheme, host, port, path and the other query parameters
stay, so a message still says which server answered. `redact_text` applies it to every URL inside
free text (an exception's message, a log line, the JSON result line), which is how the CLI hides a
URL that reached a message it did not format itself. The config knows which of its fields are URLs
(`schema.f(..., url=True)`; `config.url_fields`): the resolved config and every result built from them
go through `redact_url`. API keys never sit in URLs here: `server.api_key_env` names the variable.
"""

from __future__ import annotations

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
    """`text` with the user info and secret query values of every `scheme://` URL in it hidden."""
    text = str(text)
    if "@" in text:
        text = _USERINFO.sub("***@", text)
    if "=" in text:
        text = _QUERY_PARAM.sub(_hide_query, text)
    return text


def redact_url(url: str) -> str:
    """`url` (one URL, with or without a scheme: `u:pw@host:1/v1`) with its secrets hidden, for logs and files."""
    url = _URL_USERINFO.sub(lambda m: (m.group(1) or "") + "***@", str(url))
    return _QUERY_PARAM.sub(_hide_query, url) if "=" in url else url
