"""The job's ``[storage]`` options (fsspec/s3fs words) in delta-rs's words, for a Delta table on
object storage: delta-rs has its own object store, not s3fs, and takes ``AWS_*`` options."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import fsspec.utils

from pipeline.core import storage_options
from pipeline.core.errors import ConfigError

_S3 = frozenset({"s3", "s3a"})
# fsspec/s3fs options with no delta-rs counterpart that change nothing it does: this tool's
# retry bound, fsspec's caches, botocore's retry settings (delta-rs retries on its own).
_DROPPED = frozenset(
    {
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
    }
)
_DIRECT = {
    "key": "AWS_ACCESS_KEY_ID",
    "secret": "AWS_SECRET_ACCESS_KEY",
    "token": "AWS_SESSION_TOKEN",
    "profile": "AWS_PROFILE",
}
SECRET_OPTIONS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


# Boolean options: (delta-rs option set to "true", the value of ours that sets it).
_FLAGS = {
    "anon": ("AWS_SKIP_SIGNATURE", True),
    "use_ssl": ("AWS_ALLOW_HTTP", False),
    "requester_pays": ("AWS_REQUEST_PAYER", True),
}


def _s3_options(options: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    out: dict[str, str] = {}
    unknown: list[str] = []
    endpoints: set[str] = set()
    # delta-rs retries each request on its own (10 tries, then up to 180 s by default): bounded
    # by the job's retry deadline, as every fsspec call is (a dead endpoint ends the run about
    # retry_deadline_s after it died, not three minutes per delta-rs call).
    deadline = options.get(
        storage_options.RETRY_DEADLINE_OPTION, storage_options.DEFAULT_RETRY_DEADLINE_S
    )
    out["retry_timeout"] = f"{max(1, math.ceil(float(deadline)))}s"
    for key, value in options.items():
        if key in _DROPPED or key == storage_options.RETRY_DEADLINE_OPTION:
            continue
        if key in _DIRECT:
            if value not in (None, ""):
                out[_DIRECT[key]] = str(value)
        elif key in _FLAGS:
            option, when = _FLAGS[key]
            if _flag(value) == when:
                out[option] = "true"
        elif key == "endpoint_url":
            endpoints.add(str(value))
        elif key == "client_kwargs" and isinstance(value, Mapping):
            unknown += _client_kwargs(value, out, endpoints)
        elif key == "config_kwargs" and isinstance(value, Mapping):
            unknown += _config_kwargs(value, out)
        else:
            unknown.append(key)
    _endpoint(endpoints, out)
    return out, unknown


def _endpoint(endpoints: set[str], out: dict[str, str]) -> None:
    if len(endpoints) > 1:
        raise ConfigError(
            "storage options endpoint_url and client_kwargs.endpoint_url name different "
            "endpoints; keep one"
        )
    for endpoint in endpoints:
        out["AWS_ENDPOINT_URL"] = endpoint
        if endpoint.lower().startswith("http://"):
            out["AWS_ALLOW_HTTP"] = "true"  # delta-rs refuses plain HTTP otherwise


def _client_kwargs(value: Mapping[str, Any], out: dict[str, str], endpoints: set[str]) -> list[str]:
    unknown = []
    for sub, v in value.items():
        if sub == "endpoint_url":
            endpoints.add(str(v))
        elif sub == "region_name":
            out["AWS_REGION"] = str(v)
        else:
            unknown.append(f"client_kwargs.{sub}")
    return unknown


def _config_kwargs(value: Mapping[str, Any], out: dict[str, str]) -> list[str]:
    unknown = []
    for sub, v in value.items():
        if sub == "retries":
            continue  # botocore's retries; delta-rs retries on its own
        if sub == "s3" and isinstance(v, Mapping) and set(v) <= {"addressing_style"}:
            style = str(v.get("addressing_style", "auto"))
            if style in ("path", "virtual"):
                out["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "true" if style == "virtual" else "false"
            continue
        unknown.append(f"config_kwargs.{sub}")
    return unknown


def delta_storage_options(uri: str, options: Mapping[str, Any] | None) -> dict[str, str]:
    """The delta-rs ``storage_options`` for the job's fsspec/s3fs-style ``[storage]`` options.

    Local paths need none. For ``s3://``: key, secret, token, profile, endpoint_url (or
    client_kwargs.endpoint_url; an ``http://`` endpoint also sets ``AWS_ALLOW_HTTP``),
    client_kwargs.region_name, anon, use_ssl, requester_pays and config_kwargs.s3's
    addressing_style map to delta-rs's ``AWS_*`` options; ``retry_deadline_s``, fsspec's cache
    options and botocore's retries are dropped. Anything else is a :class:`ConfigError` naming
    the keys (never a value: they may be credentials). What is not given here, delta-rs takes
    from the ``AWS_*`` environment variables, as s3fs does.
    """
    opts = dict(options or {})
    if storage_options.is_local_uri(uri):
        return {}
    proto = fsspec.utils.get_protocol(uri)
    if proto not in _S3:
        raise ConfigError(
            f"output {uri}: a Delta table is written to a local path or s3:// here, not {proto}://"
        )
    out, unknown = _s3_options(opts)
    if unknown:
        raise ConfigError(
            f"storage option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(k) for k in sorted(unknown))} cannot be passed to a Delta table's "
            "object store (delta-rs) for "
            f"{uri}: it takes key, secret, token, profile, endpoint_url, "
            "client_kwargs.endpoint_url, client_kwargs.region_name, anon, use_ssl, "
            "requester_pays and config_kwargs.s3.addressing_style (other AWS_* settings: set "
            "them in the environment)"
        )
    return out


def retention_text(value: str | None) -> str:
    """A retention table property as a person reads it: ``interval 30 days`` -> ``30 days``
    (Delta's default, 7 days, where the property is not set)."""
    if not value:
        return "7 days (Delta's default)"
    text = value.strip()
    return text[len("interval ") :] if text.lower().startswith("interval ") else text
