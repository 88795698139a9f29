"""Credentials out of everything batchgen prints or stores: `redact_url` for a URL it shows (a model, input, output,
endpoint or proxy), `redact` for any text (an error line, a log line, a store's message).

A URL loses its userinfo (`http://user:password@host` becomes `http://***@host`) and the values of query parameters
whose names suggest a secret (X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token, a SAS token's sig, token,
access_key, password, ...). Text loses, besides, every credential the process knows of: the environment's, the AWS
shared files', the userinfo of the proxies and endpoints it names, and those the AWS credential chain resolved
(`remember`)."""
from __future__ import annotations

import configparser
import functools
import logging
import os
import re
from urllib.parse import unquote, urlsplit

HIDDEN = "***"
SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "GOOGLE_SERVICE_ACCOUNT_KEY",
                    "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_KEY", "AZURE_STORAGE_TOKEN")
URL_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_STS", "HTTP_PROXY", "HTTPS_PROXY",
                 "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "RAY_ADDRESS")
PROFILE_SECRETS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
# A query parameter whose name holds one of these is taken for a secret: generous on purpose.
SECRET_NAME = re.compile(r"sig|token|credential|secret|pass|pwd|key|auth|session", re.IGNORECASE)
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>`]+")
QUERY_PARAMETER = re.compile(r"([?&;])([^=&;#\s]+)=([^&;#\s\"'<>)]*)")

_remembered: set[str] = set()  # credentials resolved in this process (remember)


def redact_url(url: str) -> str:
    """`url` without its userinfo and with the values of its secret-looking query parameters replaced by ***."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority_end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:authority_end], rest[authority_end:]
    if "@" in authority:
        authority = f"{HIDDEN}@{authority.rpartition('@')[2]}"
    tail = QUERY_PARAMETER.sub(lambda m: f"{m[1]}{m[2]}={HIDDEN}" if SECRET_NAME.search(unquote(m[2])) else m[0],
                               tail)
    return f"{scheme}://{authority}{tail}"


def redact(text: str) -> str:
    """`text` with every URL in it redacted (redact_url) and every credential the process knows of replaced by ***."""
    text = URL.sub(lambda m: redact_url(m[0]), text)
    for secret in sorted(known_secrets(), key=len, reverse=True):  # the longest first: one may hold another
        text = text.replace(secret, HIDDEN)
    return text


def remember(*secrets: str | None) -> None:
    """Credentials resolved at run time (the AWS chain's), for `redact` to remove from then on."""
    _remembered.update(secret for secret in secrets if secret)


def remember_url(url: str | None) -> None:
    """The password (and user) of a URL's userinfo, such as an endpoint the job names."""
    remember(*_userinfo(url))


def known_secrets() -> set[str]:
    found = {os.environ.get(name) for name in SECRET_VARIABLES} | _remembered | _shared_file_secrets()
    for name in URL_VARIABLES:
        found.update(_userinfo(os.environ.get(name)))
    return {secret for secret in found if secret and len(secret) >= 4}  # shorter ones would blank ordinary words


def _userinfo(url: str | None) -> tuple[str, ...]:
    try:
        parts = urlsplit(url or "")
        return tuple(unquote(part) for part in (parts.username, parts.password) if part)
    except ValueError:
        return ()


@functools.lru_cache(maxsize=None)
def _shared_file_secrets() -> frozenset[str]:
    """The keys of every profile in the AWS shared files (AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE, else
    ~/.aws/config and ~/.aws/credentials): read once per process."""
    found = set()
    for path in (os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config",
                 os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials"):
        parser = configparser.RawConfigParser()
        try:
            parser.read(os.path.expanduser(path))
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
        found.update(parser.get(section, key) for section in parser.sections() for key in PROFILE_SECRETS
                     if parser.has_option(section, key))
    return frozenset(found)


def redact_log_records() -> None:
    """Every log record created from now on, any library's included, carries its message redacted."""
    make_record = logging.getLogRecordFactory()
    if getattr(make_record, "redacts", False):
        return

    def redacted_record(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            record.msg, record.args = redact(record.getMessage()), ()
        except Exception:  # a record whose arguments do not fit its format: logging reports it as it would
            pass
        return record

    redacted_record.redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(redacted_record)
