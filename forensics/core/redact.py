"""Credentials taken out of a command line before a dump, a pack, `inspect` or a report shows it.

By rule, not by list of tools: a key whose last component names a secret (token, key, secret, password, credential,
auth, signature ...) has its value replaced, in every spelling a command line uses for a setting:

    --hf-token X   --hf_token=X   --hftoken X   -token X        (flags; the value may be the next argument)
    hub.token=X   +trainer.hf_token=X   ++a.b.api_key=X         (Hydra / OmegaConf overrides)
    --config.wandb_api_key=X   HF_TOKEN=X   apiKey=X              (dotted, env-style, camelCase)
    https://TOKEN@host   s3://user:pw@bucket                    (a URL's user information, whole)
    https://h/p?token=X&X-Amz-Credential=Y&X-Amz-Signature=Z    (query parameters named for a secret)
    "Authorization: Bearer X"   '{"hf_token": "X"}'             (headers, JSON inside one argument)
    hf_…  ghp_…  github_pat_…  sk-…  AKIA…  xox?-…  glpat-…      (well-known token shapes, wherever they stand)

A key's last component is what follows the last `.`, `_`, `-` or lower-to-upper case change (`wandb_api_key` →
`key`, `X-Amz-Security-Token` → `token`, `apiKey` → `key`); it names a secret when it is one of SECRET_WORDS or ends in
one of SECRET_ENDINGS (`hftoken`, `dbpassword`). Over-redacting costs a reader one value of the command line; missing
one leaks a credential into every copy of the dump, so the rule errs towards hiding.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

REDACTED = "<redacted>"

SECRET_WORDS = frozenset(
    {
        "token",
        "key",
        "apikey",
        "secret",
        "password",
        "passwd",
        "pwd",
        "credential",
        "credentials",
        "auth",
        "authorization",
        "signature",
        "sig",
        "cookie",
    }
)
SECRET_ENDINGS = ("token", "secret", "password", "passwd", "credential", "credentials", "apikey", "auth")

_COMPONENTS = re.compile(r"[._\-\s]+|(?<=[a-z0-9])(?=[A-Z])")
_KEY = r"[A-Za-z_][\w.\-]*"
# One whole argument that is a setting: `--k`, `--k=v`, `-k v`, `k=v`, `+k=v`, `++k=v`, `~k`.
_SETTING = re.compile(rf"(?P<prefix>-{{1,2}}|\+{{1,2}}|~)?(?P<key>{_KEY})(?:(?P<eq>=)(?P<value>.*))?", re.DOTALL)
# A setting inside free text (a URL's query, `HF_TOKEN=x python ...` in one argument): the value runs to the next
# separator of a query or a command line.
_EMBEDDED = re.compile(rf"(?<![\w.\-+~])(?P<key>[+~]*{_KEY})(?P<eq>=)(?P<value>[^\s&;,\"'#]*)")
# `Authorization: Bearer x` (the rest of the line) and `"hf_token": "x"` (a JSON string).
_HEADER = re.compile(rf"(?<![\w.\-])(?P<key>{_KEY})(?P<eq>\s*:[ \t]*)(?P<value>[^\r\n]*)")
_JSON = re.compile(rf"(?P<key>[\"']{_KEY}[\"'])(?P<eq>\s*:\s*)(?P<value>\"(?:[^\"\\]|\\.)*\"|'[^']*'|[^\s,}}\]]+)")
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#@\s]+@")
_SCHEMES = re.compile(r"(?i)\b(?P<scheme>bearer|basic|token)(?P<space>\s+)(?P<value>[A-Za-z0-9._~+/=\-]{8,})")
_TOKEN_SHAPES = re.compile(
    r"(?<![A-Za-z0-9])(?:"
    r"hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"  # GitHub
    r"|glpat-[A-Za-z0-9_\-]{20,}"  # GitLab
    r"|sk-[A-Za-z0-9_\-]{20,}"  # OpenAI-style API keys
    r"|xox[abposr]-[A-Za-z0-9\-]{10,}"  # Slack
    r"|(?:AKIA|ASIA)[A-Z0-9]{16}"  # AWS access key ids
    r"|AIza[A-Za-z0-9_\-]{35}"  # Google API keys
    r"|eyJ[A-Za-z0-9_\-]{10,}\.eyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]+"  # JSON web tokens
    r")"
)


def names_secret(key: str) -> bool:
    """Whether a setting's key names a credential: its last component (see the module docstring).

    Example:
        >>> [names_secret(k) for k in ("hub.token", "--hftoken", "wandb_api_key", "X-Amz-Credential", "tokenizer")]
        [True, True, True, True, False]
    """
    parts = [p for p in _COMPONENTS.split(key.strip("-+~\"'")) if p]
    if not parts:
        return False
    last = parts[-1].lower()
    return last in SECRET_WORDS or last.endswith(SECRET_ENDINGS)


def _hide(match: re.Match) -> str:
    if not names_secret(match.group("key")):
        return match.group(0)
    return match.group("key") + match.group("eq") + REDACTED


def _hide_json(match: re.Match) -> str:
    if not names_secret(match.group("key")):
        return match.group(0)
    value = match.group("value")
    quote = value[0] if value[:1] in "\"'" else ""
    return match.group("key") + match.group("eq") + quote + REDACTED + quote


def redacted_text(text: str) -> str:
    """`text` (one argument, a URL, a header) without the credentials it holds (the module docstring's forms)."""
    text = _USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)
    text = _SCHEMES.sub(rf"\g<scheme>\g<space>{REDACTED}", text)
    text = _JSON.sub(_hide_json, text)
    text = _HEADER.sub(_hide, text)
    text = _EMBEDDED.sub(_hide, text)
    return _TOKEN_SHAPES.sub(REDACTED, text)


def _takes_next(arg: str) -> bool:
    """A flag whose value is the next argument: `--hf-token X`, `-token X` (not `--hf-token=X`, not `HF_TOKEN`)."""
    setting = _SETTING.fullmatch(arg)
    return bool(
        setting
        and (setting.group("prefix") or "").startswith("-")
        and not setting.group("eq")
        and names_secret(setting.group("key"))
    )


def redacted_argv(argv: Iterable[Any]) -> list:
    """A command line as a dump records it, without credentials (the module docstring's forms); anything that is not
    a string is kept as it is.

    Example:
        >>> redacted_argv(["train.py", "--hf-token", "abc", "hub.token=xyz", "https://me:pw@host/x", "--lr", "3"])
        ['train.py', '--hf-token', '<redacted>', 'hub.token=<redacted>', 'https://<redacted>@host/x', '--lr', '3']
    """
    out: list = []
    hide_next = False
    for arg in argv:
        if not isinstance(arg, str):
            out.append(arg)
            hide_next = False
            continue
        if hide_next and not (arg.startswith("--") and len(arg) > 2):  # `--use-auth-token --lr 3`: no value
            out.append(REDACTED)
            hide_next = False
            continue
        setting = _SETTING.fullmatch(arg)
        if setting and setting.group("eq") and names_secret(setting.group("key")):
            out.append(f"{setting.group('prefix') or ''}{setting.group('key')}={REDACTED}")
        else:
            out.append(redacted_text(arg))
        hide_next = _takes_next(arg)
    return out


def redacted_environment(environment: Any) -> Any:
    """A manifest's `environment` with its `argv` redacted (a dump written before a form was known keeps it in its
    manifest; every reader shows it through this). Anything that is not a mapping comes back as it is."""
    if not isinstance(environment, dict) or not isinstance(environment.get("argv"), list):
        return environment
    return {**environment, "argv": redacted_argv(environment["argv"])}


__all__ = ["REDACTED", "names_secret", "redacted_argv", "redacted_environment", "redacted_text"]
