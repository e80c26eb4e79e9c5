"""The job's ``[storage]`` options (fsspec/s3fs words) as pyiceberg FileIO properties, for an
Iceberg table on object storage: pyiceberg reads and writes the table's metadata (and readers
its data) through its own FileIO (pyarrow's S3 filesystem), not s3fs, and takes ``s3.*``
properties. Workers write the data files through fsspec as for any output."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import fsspec.utils

from pipeline.core import storage_options
from pipeline.core.errors import ConfigError

_S3 = frozenset({"s3", "s3a"})
# fsspec/s3fs options with no FileIO counterpart that change nothing it does: this tool's retry
# bound, fsspec's caches, botocore's retries (pyarrow's S3 client retries on its own).
_DROPPED = frozenset(
    {
        storage_options.RETRY_DEADLINE_OPTION,
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "use_ssl",  # the endpoint's scheme says it: pyarrow takes http:// endpoints as they are
    }
)
_DIRECT = {
    "key": "s3.access-key-id",
    "secret": "s3.secret-access-key",
    "token": "s3.session-token",
    "profile": "s3.profile-name",
}
#: The region S3-compatible servers are asked in when the job names an endpoint but no region
#: (without one, pyiceberg asks AWS where the bucket is: a call to the internet that an on-site
#: server's bucket cannot answer).
DEFAULT_REGION = "us-east-1"


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _nested(key: str, value: Mapping[str, Any], out: dict[str, str]) -> list[str]:
    """client_kwargs and config_kwargs: the entries a FileIO has a word for."""
    unknown = []
    for sub, v in value.items():
        if key == "client_kwargs" and sub == "endpoint_url":
            out.setdefault("s3.endpoint", str(v))
        elif key == "client_kwargs" and sub == "region_name":
            out["s3.region"] = str(v)
        elif key == "config_kwargs" and sub == "retries":
            continue  # botocore's; pyarrow's S3 client retries on its own
        elif key == "config_kwargs" and sub == "s3" and isinstance(v, Mapping):
            style = str(v.get("addressing_style", "auto"))
            if set(v) - {"addressing_style"}:
                unknown.append(f"config_kwargs.s3.{sorted(set(v) - {'addressing_style'})[0]}")
            elif style in ("path", "virtual"):
                out["s3.force-virtual-addressing"] = "true" if style == "virtual" else "false"
        else:
            unknown.append(f"{key}.{sub}")
    return unknown


def fileio_properties(uri: str, options: Mapping[str, Any] | None) -> dict[str, str]:
    """pyiceberg's FileIO properties for a table at ``uri`` from the job's fsspec/s3fs-style
    ``[storage]`` options.

    Local paths need none. For ``s3://``: key, secret, token, profile, endpoint_url (or
    client_kwargs.endpoint_url), client_kwargs.region_name, anon and config_kwargs.s3's
    addressing_style map to pyiceberg's ``s3.*`` properties; an endpoint without a region
    gets ``AWS_REGION``/``AWS_DEFAULT_REGION`` or :data:`DEFAULT_REGION`; this tool's retry
    deadline, fsspec's cache options, use_ssl and botocore's retries are dropped. Anything else
    is a :class:`ConfigError` naming the keys (never a value: they may be credentials). What is
    not given here, pyarrow's S3 client takes from the ``AWS_*`` environment, as s3fs does.
    """
    if storage_options.is_local_uri(uri):
        return {}
    proto = fsspec.utils.get_protocol(uri)
    if proto not in _S3:
        raise ConfigError(
            f"output {uri}: an Iceberg table is written to a local path or s3:// here, not "
            f"{proto}://"
        )
    out: dict[str, str] = {}
    unknown: list[str] = []
    for key, value in (options or {}).items():
        if key in _DROPPED:
            continue
        if key in _DIRECT:
            if value not in (None, ""):
                out[_DIRECT[key]] = str(value)
        elif key == "endpoint_url":
            out["s3.endpoint"] = str(value)
        elif key == "anon":
            out["s3.anonymous"] = "true" if _flag(value) else "false"
        elif key in ("client_kwargs", "config_kwargs") and isinstance(value, Mapping):
            unknown += _nested(key, value, out)
        else:
            unknown.append(key)
    if unknown:
        raise ConfigError(
            f"storage option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(k) for k in sorted(unknown))} cannot be passed to pyiceberg for "
            f"the Iceberg table {uri}: it takes key, secret, token, profile, endpoint_url, "
            "client_kwargs.endpoint_url, client_kwargs.region_name, anon and "
            "config_kwargs.s3.addressing_style (other settings: s3.* properties in a [catalog] "
            "table, or AWS_* variables in the environment)"
        )
    if "s3.endpoint" in out and "s3.region" not in out:
        env = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        out["s3.region"] = env or DEFAULT_REGION
    return out
