"""AWS credentials for an `s3://` store from the AWS SDKs' standard chain, through botocore (the `s3` extra): the
environment, the shared files' profile (AWS_PROFILE, else `default`: static keys, `role_arn` with `source_profile`,
`credential_process`, SSO), web identity (AWS_WEB_IDENTITY_TOKEN_FILE, as on Kubernetes), the container's and the
instance's metadata service. obstore asks `current_credentials` for them (its `credential_provider`), again before
they expire; every key it hands out is given to `redaction.remember`, so that no message shows it.

The chain is resolved once per process. Where nothing else gives credentials, botocore asks the instance metadata
service last, bounded by its defaults (1 s, 1 attempt; AWS_METADATA_SERVICE_TIMEOUT, AWS_EC2_METADATA_DISABLED)."""
from __future__ import annotations

import functools
import importlib.util
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from batchgen.redaction import remember

# How long obstore keeps keys that can expire before asking again: botocore refreshes them well before they expire
# (15 minutes before), so a key handed out is good for longer than this.
RECHECK = timedelta(minutes=5)


def has_botocore() -> bool:
    return importlib.util.find_spec("botocore") is not None


@functools.lru_cache(maxsize=None)
def _session() -> Any:
    import botocore.session

    return botocore.session.Session()  # the profile AWS_PROFILE names, else `default`


def aws_profile() -> dict[str, str]:
    """The AWS profile's settings from the shared files (AWS_CONFIG_FILE and AWS_SHARED_CREDENTIALS_FILE, else
    ~/.aws/config and ~/.aws/credentials; the latter winning): region, endpoint_url, ... Empty where there is none."""
    if not has_botocore():
        return {}
    from botocore.exceptions import ProfileNotFound

    try:
        return {key: value for key, value in _session().get_scoped_config().items() if isinstance(value, str)}
    except ProfileNotFound:
        return {}  # get_credentials says so, where credentials are looked for


@functools.lru_cache(maxsize=None)
def chain_credentials() -> Any:
    """botocore's credentials (refreshable where they expire), or None where the chain finds none. Raises what
    botocore raises for a profile it cannot use (one that does not exist, a credential_process that fails)."""
    return _session().get_credentials()


def credential_provider() -> Callable[[], dict[str, Any]] | None:
    """obstore's credential_provider for the chain's credentials; None where botocore is not installed or the chain
    finds none (obstore then looks in the environment and the metadata service itself). Asks for the keys once
    now, so that a profile that cannot give them (an assume-role refused, say) fails here, saying why."""
    if not has_botocore() or chain_credentials() is None:
        return None
    current_credentials()
    return current_credentials


def current_credentials() -> dict[str, Any]:
    """The chain's keys now, as obstore takes them. A module-level function: a store holding it stays picklable,
    and a Ray replica that unpickles one resolves the chain in its own process."""
    from botocore.credentials import RefreshableCredentials

    credentials = chain_credentials()
    if credentials is None:
        raise RuntimeError("the AWS credential chain found no credentials")
    frozen = credentials.get_frozen_credentials()
    remember(frozen.access_key, frozen.secret_key, frozen.token)
    expires = datetime.now(timezone.utc) + RECHECK if isinstance(credentials, RefreshableCredentials) else None
    return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
            "expires_at": expires}
