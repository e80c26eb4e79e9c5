"""What a table format needs from a job, checked with every other problem of the job: an
output template whose folders are partitions, the packages of the ``iceberg`` extra, and an
Iceberg table's ``catalog`` and ``table`` keys (:class:`CatalogSpec`, :func:`table_identifier`).

Nothing here opens a catalog (pyiceberg is imported by the driver only, through
``pipeline.sinks.iceberg.catalog``): a catalog is checked for its shape, and described for
reports and logs without its secrets (:meth:`CatalogSpec.public`).
"""

from __future__ import annotations

import importlib.util
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.core import storage_options
from pipeline.core.errors import ConfigError
from pipeline.core.settings import Keyed
from pipeline.core.templates import partition_columns

#: What ``format = "iceberg"`` imports (the ``iceberg`` extra): pyiceberg and its SQL catalog.
ICEBERG_PACKAGES = ("pyiceberg", "sqlalchemy")
#: The table formats: an output template's fixed part is the table, its key={...} folders
#: partition columns (pipeline.core.templates.partition_columns).
TABLE_FORMATS = ("delta", "iceberg")
#: The namespace of a table whose identifier names none (and of every default identifier).
DEFAULT_NAMESPACE = "score_catalog"
#: The catalog's name where a job names none: pyiceberg's SQL catalog keys its rows by it, so a
#: reader opens the catalog with this name or finds no table.
CATALOG_NAME = "score_catalog"
#: A catalog property whose key holds one of these words, or starts with one of the prefixes,
#: is a secret: never in a report, a log line or a message. ``header.``: pyiceberg's REST
#: catalog sends every ``header.<name>`` property as an HTTP header (``header.Authorization =
#: "Bearer ..."``), so any of them may carry a credential (a break-it review found one in the
#: report under the words alone).
SECRET_WORDS = (
    "secret",
    "token",
    "password",
    "credential",
    "key",
    "auth",
    "signature",
    "session",
    "cookie",
)
SECRET_PREFIXES = ("header.",)

_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
_URI_FIX = (
    "give sqlite:///PATH (a SQL catalog in a SQLite file), http(s)://HOST/PATH (a REST "
    "catalog), or a [catalog] table of pyiceberg catalog properties (type, uri, ...: e.g. "
    'type = "sql", uri = "postgresql+psycopg2://HOST/DB")'
)


def missing_packages(names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` that cannot be imported here (found without importing them)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def is_secret(key: str) -> bool:
    """Whether a catalog property named ``key`` holds a secret (see :data:`SECRET_WORDS`)."""
    low = key.lower()
    return any(word in low for word in SECRET_WORDS) or low.startswith(SECRET_PREFIXES)


def public_uri(uri: str) -> str:
    """``uri`` without its secrets: a password in it, and query values under secret names,
    shown as ``***``."""
    try:
        parts = urllib.parse.urlsplit(uri)
        password = parts.password
    except ValueError:
        return uri
    pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if password is None and not any(is_secret(k) for k, _ in pairs):
        return uri  # as given (urlunsplit would rewrite sqlite:////abs as sqlite://abs)
    netloc = parts.netloc
    if password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    query = "&".join(f"{k}={'***' if is_secret(k) else v}" for k, v in pairs)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _query_secrets(value: str) -> list[str]:
    """The values under secret names in ``value``'s query string, if it is a URI (a REST
    catalog's ``?token=...``: pyiceberg's connection errors quote the URL whole)."""
    if "?" not in value:
        return []
    try:
        query = urllib.parse.urlsplit(value).query
    except ValueError:
        return []
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    found = [v for k, v in pairs if is_secret(k) and v]
    # As written in the URI, and percent-encoded as a client prints the URL it called.
    found += [v for k, _, v in (p.partition("=") for p in query.split("&")) if is_secret(k) and v]
    found += [urllib.parse.quote(v, safe="") for v in found]
    return sorted(set(found))


@dataclass(frozen=True)
class CatalogSpec:
    """A pyiceberg catalog a job names: a ``sqlite:///`` SQL catalog, an ``http(s)://`` REST
    catalog, or a table of pyiceberg catalog properties (passed to its ``load_catalog``)."""

    kind: Literal["sql", "rest", "properties"]
    name: str  # the catalog's name (pyiceberg's SQL catalog keys its rows by it)
    properties: Mapping[str, str]  # for load_catalog, secrets included: never shown

    @classmethod
    def of(cls, value: str | Mapping[str, Any]) -> CatalogSpec:
        """The catalog ``value`` names (a ``catalog`` key that :func:`catalog_problems`
        passed); a relative SQLite path is made absolute (every reader finds the same file)."""
        problems = catalog_problems("catalog", value)
        if problems:
            raise ConfigError(problems)
        if isinstance(value, str):
            if value.startswith("sqlite:"):
                path = Path(value[len("sqlite:///") :]).absolute()
                return cls("sql", CATALOG_NAME, {"type": "sql", "uri": f"sqlite:///{path}"})
            return cls("rest", CATALOG_NAME, {"type": "rest", "uri": value})
        props = {str(k): _text(v) for k, v in value.items() if k != "name"}
        return cls("properties", str(value.get("name") or CATALOG_NAME), props)

    @property
    def sqlite_path(self) -> str | None:
        """The SQLite file of a ``sqlite:///`` catalog (None for any other)."""
        uri = self.properties.get("uri", "")
        if self.kind == "sql" and uri.startswith("sqlite:///"):
            return uri[len("sqlite:///") :]
        return None

    def public(self) -> str | dict[str, str]:
        """What a report says of the catalog: its URI, or its properties (and name) without
        the secret ones; a password in any URI shown as ``***``."""
        if self.kind != "properties":
            return public_uri(self.properties["uri"])
        shown = {"name": self.name}
        shown.update({k: public_uri(v) for k, v in self.properties.items() if not is_secret(k)})
        return shown

    def text(self) -> str:
        """The catalog in a message, after the word "catalog" (no secret)."""
        found = self.public()
        if isinstance(found, str):
            return found
        rest = ", ".join(f"{k}={v}" for k, v in found.items() if k != "name")
        return f"{self.name!r}" + (f" ({rest})" if rest else "")

    def secrets(self) -> list[str]:
        """Every secret value of the catalog (scrubbed from any text that may quote them)."""
        found = [v for k, v in self.properties.items() if is_secret(k) and v]
        for v in self.properties.values():
            password = _password(v)
            if password:
                found.append(password)
            found += _query_secrets(v)
        return found

    def scrub(self, text: str) -> str:
        """``text`` with every secret of the catalog shown as ``***``."""
        for secret in sorted(self.secrets(), key=len, reverse=True):
            text = text.replace(secret, "***")
        return text


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _password(uri: str) -> str | None:
    try:
        return urllib.parse.urlsplit(uri).password
    except ValueError:
        return None


def catalog_problems(key: str, value: str | Mapping[str, Any]) -> list[str]:
    """The ``catalog`` key's shape: a URI of a SQLite file or a REST catalog, or a table of
    catalog properties (scalar values) that names a catalog. No message quotes a secret."""
    if isinstance(value, str):
        shown = public_uri(value)
        if value.startswith(("http://", "https://")):
            if urllib.parse.urlsplit(value).hostname:
                return []
            return [f"{key} = {shown!r} names no host: give http(s)://HOST/PATH"]
        if value.startswith("sqlite:"):
            path = value[len("sqlite:///") :] if value.startswith("sqlite:///") else ""
            if not path or path == ":memory:" or path.startswith(("file:", "?")):
                return [
                    f"{key} = {shown!r} names no SQLite file: every run must find the same "
                    "catalog, so give sqlite:///PATH (relative to where you run) or "
                    "sqlite:////ABSOLUTE/PATH"
                ]
            return []
        return [f"{key} = {shown!r} is not a catalog URI: {_URI_FIX}"]
    problems = [
        f"{key}.{k} must be a string, a number or true/false"
        for k, v in value.items()
        if not isinstance(k, str) or not isinstance(v, (str, int, float, bool))
    ]
    name = value.get("name")
    if "name" in value and (not isinstance(name, str) or not name.strip()):
        problems.append(f"{key}.name must be the catalog's name, a non-empty string")
    if not any(k in value for k in ("name", "type", "uri", "py-catalog-impl")):
        problems.append(
            f"[{key}] names no catalog: give its type and uri (pyiceberg catalog properties), "
            "or the name of a catalog configured in ~/.pyiceberg.yaml or PYICEBERG_CATALOG__* "
            "variables"
        )
    return problems


def table_problems(key: str, value: str) -> list[str]:
    """The ``table`` key: ``<namespace>.<table>`` or ``<table>``, plain names."""
    parts = value.split(".")
    if all(_PART.match(p) for p in parts):
        return []
    return [
        f"{key} = {value!r} is not a table identifier: give <namespace>.<table> or <table> (in "
        f"the namespace {DEFAULT_NAMESPACE}), each part letters, digits, '_' and '-'"
    ]


def table_identifier(table: str | None, folder_name: str) -> str:
    """The identifier of the table: ``table`` (a bare name in :data:`DEFAULT_NAMESPACE`), or
    ``score_catalog.<the table folder's name>`` ('-' as '_')."""
    if table is None:
        return f"{DEFAULT_NAMESPACE}.{folder_name.replace('-', '_')}"
    return table if "." in table else f"{DEFAULT_NAMESPACE}.{table}"


def format_problems(good: Mapping[str, Any], bad: set[str]) -> list[Keyed]:
    """What a table format needs: an output template whose folders are partitions; for
    ``format = "iceberg"`` the ``iceberg`` extra, and a catalog where the embedded one cannot
    live (object storage); ``catalog`` and ``table`` for Iceberg only."""
    problems: list[Keyed] = []
    fmt = good.get("format")
    output = good.get("output") if "output" not in bad else None
    if fmt in TABLE_FORMATS and output is not None:
        try:
            partition_columns(output, fmt=fmt)
        except ConfigError as e:
            problems += [("output", p) for p in e.problems]
    for key in ("catalog", "table"):
        if good.get(key) is not None and fmt is not None and fmt != "iceberg":
            problems.append(
                (
                    key,
                    f"{key} is for format = 'iceberg', and format is {fmt!r}: set format = "
                    f"'iceberg' (--format iceberg), or leave {key} unset",
                )
            )
    if fmt != "iceberg":
        return problems
    if missing := missing_packages(ICEBERG_PACKAGES):
        problems.append(
            (
                "format",
                f"format = 'iceberg' needs {' and '.join(missing)}, which "
                f"{'is' if len(missing) == 1 else 'are'} not installed here: pip install "
                "'score-catalog[iceberg]', or use format 'delta' or 'parquet'",
            )
        )
    if (
        output is not None
        and good.get("catalog") is None
        and "catalog" not in bad
        and not storage_options.is_local_uri(output)
    ):
        problems.append(
            (
                "catalog",
                f"output = {output!r} is on object storage, where the embedded SQLite catalog "
                "cannot live (it is a local file): set catalog (--catalog, "
                "SCORE_CATALOG_CATALOG) to a catalog every run reaches: sqlite:///PATH on this "
                "machine's disk, an http(s):// REST catalog, or a [catalog] table of pyiceberg "
                "catalog properties",
            )
        )
    return problems
