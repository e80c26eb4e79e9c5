"""Model bundles from an MLflow model registry: ``models:/NAME/VERSION``, ``models:/NAME@ALIAS``.

A registered model version holds a bundle folder (``model.toml`` + weights) as its artifacts.
Resolving a ``models:/`` URI asks the tracking server named by ``MLFLOW_TRACKING_URI`` which
version it means, downloads that version's artifacts once into a local cache keyed by the
version (reused while intact), and returns the local folder: from there the bundle loads as any
local bundle. The driver resolves once per run; workers get the local folder, and a worker on
another machine, which does not see it, downloads the same pinned version into its own cache
(:func:`fetch_pinned`). :func:`register` puts a bundle folder into the registry.

MLflow is an optional extra (``pip install 'score-catalog[mlflow]'``), imported only here and
only when a ``models:/`` URI is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import ConfigError, ModelError, RegistryError
from pipeline.model.bundle import read_bundle
from pipeline.model.program import load_model

logger = logging.getLogger(__name__)

SCHEME = "models:/"
TRACKING_ENV = "MLFLOW_TRACKING_URI"
INSTALL_HINT = "pip install 'score-catalog[mlflow]'"
# Tag on the registered version (and its run): the bundle's SHA-256 when it was registered, so
# a download that does not match is refused instead of scored.
SHA_TAG = "score_catalog.sha256"
BUNDLE_ARTIFACT_PATH = "bundle"  # where register() logs the bundle folder inside the run
DEFAULT_EXPERIMENT = "score-catalog"
MARKER = "resolved.json"  # beside the cached bundle: what was downloaded, from where, its SHA
# MLflow client settings while this module talks to the server, each unless the environment
# sets it. The client retries a failed request 7 times with exponential backoff (about 4 minutes
# against a server that is down) and waits up to 120 s per request; a nightly job should fail in
# seconds and say why. Its download progress bars (tqdm, where installed) would break the one
# JSON object per stderr line of --log-format json.
CLIENT_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}
_NOT_FOUND_CODES = frozenset({"RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE"})
_VERSION_RE = re.compile(r"^[1-9][0-9]*$")
_LOCK = threading.Lock()  # one resolution at a time per process: the cache, CLIENT_DEFAULTS


def is_registry_uri(uri: str) -> bool:
    """Whether ``uri`` names a registered model (``models:/...``) rather than a bundle folder."""
    return uri.startswith(SCHEME)


@dataclass(frozen=True)
class RegistryRef:
    """A parsed ``models:/`` URI: a name and either a version or an alias."""

    uri: str
    name: str
    version: str | None
    alias: str | None


def parse_uri(uri: str) -> RegistryRef:
    """``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``; anything else: :class:`ConfigError`."""
    rest = uri[len(SCHEME) :].strip("/")
    name, slash, version = rest.partition("/")
    if slash and name and _VERSION_RE.match(version):
        return RegistryRef(uri, name, version, None)
    name, at, alias = rest.rpartition("@")
    if at and name and alias and "/" not in rest:
        return RegistryRef(uri, name, None, alias)
    raise ConfigError(
        f"model = {uri!r} is not a registry URI this tool reads: use models:/NAME/VERSION "
        "(a version number, e.g. models:/catalog-ranker/3) or models:/NAME@ALIAS (e.g. "
        "models:/catalog-ranker@champion); for /latest or a stage such as /Production, point "
        "an alias at the version instead (MLflow deprecates stages)"
    )


@dataclass(frozen=True)
class RegistryVersion:
    """The registered version a ``models:/`` URI resolved to, and where its bundle lies here."""

    uri: str  # as configured (models:/NAME@ALIAS or models:/NAME/VERSION)
    name: str
    version: str
    alias: str | None
    run_id: str | None  # the MLflow run whose artifacts hold the bundle
    path: str  # the local folder holding the downloaded bundle
    # Where it was resolved: a worker that does not see ``path`` resolves the pinned version
    # there again. May carry credentials, so it is never reported or logged.
    tracking_uri: str

    @property
    def pinned(self) -> str:
        """``models:/NAME/VERSION``: this version whatever an alias says later."""
        return f"{SCHEME}{self.name}/{self.version}"

    def report(self) -> dict[str, Any]:
        """The report's ``model.registry`` section."""
        return {
            "uri": self.uri,
            "name": self.name,
            "version": self.version,
            "alias": self.alias,
            "run_id": self.run_id,
            "path": self.path,
        }


@dataclass(frozen=True)
class ModelSource:
    """Where a run's model comes from: the URI as configured and the bundle location to load."""

    uri: str  # as configured
    bundle: str  # what is read and loaded: ``uri`` itself, or the registry version's local copy
    registry: RegistryVersion | None = None

    @property
    def model_version(self) -> str | None:
        """The output's ``model_version`` value when it is not the bundle's own ``version``."""
        return None if self.registry is None else self.registry.pinned

    def report(self) -> dict[str, Any] | None:
        """The report's ``model.registry``: null for a bundle given by its location."""
        return None if self.registry is None else self.registry.report()


# --------------------------------------------------------------------------- resolution


def resolve_model(uri: str, *, cache_dir: Path | None = None) -> ModelSource:
    """The model of ``uri``: a bundle location as it is, or a registry version downloaded here.

    A ``models:/`` URI is resolved against ``MLFLOW_TRACKING_URI``: an unknown model, version or
    alias is a :class:`ModelError` (exit 3), a server that does not answer a
    :class:`RegistryError` (exit 1), MLflow not installed or no tracking URI a
    :class:`ConfigError` (exit 2).
    """
    if not is_registry_uri(uri):
        return ModelSource(uri=uri, bundle=uri)
    ref = parse_uri(uri)
    tracking = os.environ.get(TRACKING_ENV, "").strip()
    if not tracking:
        raise ConfigError(
            f"model = {uri!r} names a registered model, but {TRACKING_ENV} is not set: point it "
            "at the MLflow tracking server (e.g. export MLFLOW_TRACKING_URI=http://mlflow:5000)"
        )
    version = _resolve(ref, tracking, cache_dir)
    logger.info(
        "model %s is %s (run %s), bundle in %s", uri, version.pinned, version.run_id, version.path
    )
    return ModelSource(uri=uri, bundle=version.path, registry=version)


def fetch_pinned(pinned: str, tracking_uri: str, *, cache_dir: Path | None = None) -> str:
    """In a worker that does not see the driver's copy: the local folder of the same pinned
    version (``models:/NAME/VERSION``), downloaded into this machine's cache if needed."""
    return _resolve(parse_uri(pinned), tracking_uri, cache_dir).path


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/score-catalog/models``, else ``~/.cache/score-catalog/models``.

    Not a ``SCORE_CATALOG_*`` variable: the config layer rejects unknown ones.
    """
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "score-catalog" / "models"


def safe_uri(tracking_uri: str) -> str:
    """``tracking_uri`` without a user name or password, for messages."""
    parts = urllib.parse.urlsplit(tracking_uri)
    if not parts.hostname or "@" not in parts.netloc:
        return tracking_uri
    host = parts.hostname + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=host))


def _mlflow(uri: str) -> Any:
    """The ``mlflow`` package, or a :class:`ConfigError` saying how to install it."""
    # MLflow installs its own stderr handlers on import unless told not to; its records then
    # go through this tool's logging (text or JSON lines) like every other library's.
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    quiet = logging.getLogger("mlflow")
    if quiet.level == logging.NOTSET:  # its INFO lines ("Waiting up to 300 seconds ...") are noise
        quiet.setLevel(logging.WARNING)
    try:
        import mlflow
        import mlflow.artifacts
        import mlflow.exceptions
        import mlflow.tracking
    except ImportError as e:
        raise ConfigError(
            f"{uri}: models from an MLflow registry need MLflow, which is not installed: "
            f"{INSTALL_HINT}"
        ) from e
    return mlflow


@contextlib.contextmanager
def _client_defaults() -> Iterator[None]:
    """:data:`CLIENT_DEFAULTS` in the environment, where not set, for the block's duration."""
    added = [k for k in CLIENT_DEFAULTS if k not in os.environ]
    os.environ.update({k: CLIENT_DEFAULTS[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _client(mlflow: Any, tracking: str) -> Any:
    return mlflow.tracking.MlflowClient(tracking_uri=tracking, registry_uri=tracking)


def _resolve(ref: RegistryRef, tracking: str, cache_dir: Path | None) -> RegistryVersion:
    mlflow = _mlflow(ref.uri)
    with _LOCK, _client_defaults():
        client = _client(mlflow, tracking)
        mv = _model_version(mlflow, client, ref, tracking)
        if str(getattr(mv, "status", "READY")) != "READY":
            raise ModelError(
                f"{ref.uri}: version {mv.version} is {mv.status} in the registry, not READY; "
                "wait for its registration to finish, or register the bundle again"
            )
        path = _cached_bundle(mlflow, client, mv, ref, tracking, cache_dir or default_cache_dir())
    return RegistryVersion(
        uri=ref.uri,
        name=ref.name,
        version=str(mv.version),
        alias=ref.alias,
        run_id=mv.run_id or None,
        path=str(path),
        tracking_uri=tracking,
    )


def _model_version(mlflow: Any, client: Any, ref: RegistryRef, tracking: str) -> Any:
    """The registry's record of the version ``ref`` names."""
    try:
        if ref.alias is not None:
            return client.get_model_version_by_alias(ref.name, ref.alias)
        return client.get_model_version(ref.name, ref.version)
    except (mlflow.exceptions.MlflowException, OSError) as e:
        if not _is_not_found(mlflow, e):
            raise _unreachable(ref.uri, tracking, e) from e
        raise ModelError(
            f"{ref.uri}: {_what_exists(mlflow, client, ref)} on the MLflow tracking server "
            f"{safe_uri(tracking)}; check the name, version or alias (score-catalog bundle "
            "register PATH --name NAME [--alias ALIAS] adds a version)"
        ) from e


def _is_not_found(mlflow: Any, e: BaseException) -> bool:
    """The server answered that the name, version or alias does not exist."""
    rest = isinstance(e, mlflow.exceptions.RestException)
    return rest and getattr(e, "error_code", "") in _NOT_FOUND_CODES


def _reason(e: BaseException) -> str:
    """The useful end of a client error: ``[Errno 111] Connection refused`` rather than a
    paragraph about connection pools."""
    text = str(e)
    m = re.search(r"\[Errno -?\d+\][^'\")]*", text)
    if m:
        return m.group(0).strip()
    if "timed out" in text.lower():
        return "the request timed out"
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return first if len(first) <= 300 else first[:297] + "..."


def _unreachable(uri: str, tracking: str, e: BaseException) -> RegistryError:
    return RegistryError(
        f"cannot resolve {uri}: the MLflow tracking server {safe_uri(tracking)} "
        f"({TRACKING_ENV}) did not answer ({_reason(e)}). Check that it is up and reachable "
        "from here, then rerun; MLFLOW_HTTP_REQUEST_MAX_RETRIES and MLFLOW_HTTP_REQUEST_TIMEOUT "
        "set how long to try"
    )


def _what_exists(mlflow: Any, client: Any, ref: RegistryRef) -> str:
    """What the registry holds under ``ref.name``, for a not-found message."""
    errors = (mlflow.exceptions.MlflowException, OSError)
    try:
        rm = client.get_registered_model(ref.name)
    except errors:
        return f"there is no registered model named {ref.name!r}"
    aliases = dict(getattr(rm, "aliases", None) or {})
    try:
        name = ref.name.replace("'", "\\'")
        found = client.search_model_versions(f"name = '{name}'")
        versions = sorted(int(v.version) for v in found)
    except errors:
        versions = []
    have = f"versions: {', '.join(map(str, versions[-20:])) or 'none'}"
    if aliases:
        have += "; aliases: " + ", ".join(f"{a} -> {v}" for a, v in sorted(aliases.items()))
    missing = f"alias {ref.alias!r}" if ref.alias is not None else f"version {ref.version}"
    return f"registered model {ref.name!r} has no {missing} ({have})"


# --------------------------------------------------------------------------- the cache


def _version_folder(cache: Path, tracking: str, name: str, version: str) -> Path:
    """``<cache>/<server>/<name>/<version>``: one folder per registered version and server."""
    server = hashlib.sha256(safe_uri(tracking).encode()).hexdigest()[:16]
    return cache / server / urllib.parse.quote(name, safe="") / version


def bundle_sha256(path: Path) -> str:
    """The bundle's SHA-256 as the run computes it (``model.toml`` then the weights)."""
    return read_bundle(str(path))[2]


def _intact(folder: Path, mv: Any) -> bool:
    """Whether ``folder`` holds this version's bundle, whole: same source, same SHA-256."""
    try:
        facts = json.loads((folder / MARKER).read_text(encoding="utf-8"))
        if facts.get("source") != mv.source or facts.get("run_id") != (mv.run_id or None):
            return False
        return bool(bundle_sha256(folder / BUNDLE_ARTIFACT_PATH) == facts.get("sha256"))
    except (OSError, ValueError, AttributeError, ModelError):
        return False


def _cached_bundle(
    mlflow: Any, client: Any, mv: Any, ref: RegistryRef, tracking: str, cache: Path
) -> Path:
    """The version's bundle folder in the cache, downloaded unless an intact copy is there."""
    folder = _version_folder(cache, tracking, mv.name, str(mv.version))
    if _intact(folder, mv):
        logger.debug("%s: reusing the cached bundle in %s", ref.uri, folder)
        return folder / BUNDLE_ARTIFACT_PATH
    if folder.exists():
        logger.warning(
            "cached copy of %s in %s is incomplete or stale; downloading it again", ref.uri, folder
        )
        shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        bundle = _download(mlflow, client, mv, ref, tracking, tmp)
        sha = _checked_sha(bundle, mv, ref)
        facts = {
            "name": mv.name,
            "version": str(mv.version),
            "run_id": mv.run_id or None,
            "source": mv.source,
            "sha256": sha,
        }
        (tmp / MARKER).write_text(json.dumps(facts, indent=2), encoding="utf-8")
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another process downloaded the same version meanwhile: use its copy if whole.
            if not _intact(folder, mv):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("downloaded %s (version %s) into %s", ref.uri, mv.version, folder)
    return folder / BUNDLE_ARTIFACT_PATH


def _download(
    mlflow: Any, client: Any, mv: Any, ref: RegistryRef, tracking: str, tmp: Path
) -> Path:
    """Download the version's artifacts into ``tmp/bundle``."""
    try:
        source = client.get_model_version_download_uri(mv.name, mv.version)
        got = mlflow.artifacts.download_artifacts(
            artifact_uri=source, dst_path=str(tmp / "download"), tracking_uri=tracking
        )
    except (mlflow.exceptions.MlflowException, OSError) as e:
        if _is_not_found(mlflow, e):
            raise ModelError(
                f"{ref.uri}: the artifacts of version {mv.version} ({mv.source}) are gone from "
                f"the MLflow server {safe_uri(tracking)}; register the bundle again"
            ) from e
        raise RegistryError(
            f"cannot download {ref.uri} (version {mv.version}, {mv.source}) from the MLflow "
            f"server {safe_uri(tracking)}: {_reason(e)}; rerun once it answers"
        ) from e
    bundle = tmp / BUNDLE_ARTIFACT_PATH
    os.rename(got, bundle)
    return bundle


def _checked_sha(bundle: Path, mv: Any, ref: RegistryRef) -> str:
    """The downloaded bundle's SHA-256, refused if it is not a bundle or not what was registered."""
    where = f"{ref.uri} (version {mv.version}, {mv.source})"
    if not (bundle / "model.toml").is_file():
        held = sorted(p.name for p in bundle.iterdir()) if bundle.is_dir() else []
        raise ModelError(
            f"{where}: the registered artifacts hold no model.toml at their root (found: "
            f"{', '.join(held[:10]) or 'nothing'}); register a bundle folder with "
            "score-catalog bundle register PATH --name NAME"
        )
    sha = bundle_sha256(bundle)
    expected = (getattr(mv, "tags", None) or {}).get(SHA_TAG)
    if expected and expected != sha:
        raise ModelError(
            f"{where}: the downloaded bundle's SHA-256 is {sha[:12]}, but {expected[:12]} was "
            "registered; the artifacts changed after registration, register the bundle again"
        )
    return sha


# --------------------------------------------------------------------------- registration


def check_bundle(path: str) -> tuple[Any, str]:
    """Load and dry-run the bundle at ``path`` (as a run would); returns (spec, SHA-256)."""
    if is_registry_uri(path) or not os.path.isdir(path):
        raise ConfigError(f"{path}: not a bundle folder (a folder holding model.toml)")
    try:
        model = load_model(path, "cpu")
    except ModelError as e:
        raise ModelError(f"refusing to register {path}: {e}") from e
    return model.spec, model.sha256


def register(
    path: str,
    name: str,
    *,
    alias: str | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
) -> RegistryVersion:
    """Register the bundle folder ``path`` as a new version of the registered model ``name``.

    The bundle is checked first (loaded and dry-run, as a run would), then logged as the
    artifacts (under ``bundle/``) of a new run in ``experiment`` and registered as a model
    version tagged with its SHA-256; ``alias`` then points at the new version. Uses
    ``MLFLOW_TRACKING_URI``.
    """
    uri = f"{SCHEME}{name}"
    tracking = os.environ.get(TRACKING_ENV, "").strip()
    if not tracking:
        raise ConfigError(
            f"registering {path} needs {TRACKING_ENV}: point it at the MLflow tracking server"
        )
    spec, sha = check_bundle(path)
    mlflow = _mlflow(uri)
    with _LOCK, _client_defaults():
        client = _client(mlflow, tracking)
        try:
            run_id = _log_bundle(client, path, spec, sha, experiment)
            version = _new_version(mlflow, client, name, run_id, sha, spec)
        except (mlflow.exceptions.MlflowException, OSError) as e:
            raise _refused(mlflow, f"registering {path} as {name}", tracking, e) from e
        if alias is not None:
            try:
                client.set_registered_model_alias(name, alias, version)
            except (mlflow.exceptions.MlflowException, OSError) as e:
                what = f"version {version} of {name} was registered, but alias {alias!r}"
                raise _refused(mlflow, what, tracking, e) from e
    return RegistryVersion(
        uri=f"{SCHEME}{name}/{version}",
        name=name,
        version=version,
        alias=alias,
        run_id=run_id,
        path=os.path.abspath(path),
        tracking_uri=tracking,
    )


def _refused(mlflow: Any, what: str, tracking: str, e: BaseException) -> Exception:
    """The server refused (a bad name or alias: exit 2) or did not answer (exit 1)."""
    if isinstance(e, mlflow.exceptions.RestException):
        code = getattr(e, "error_code", "")
        if code == "INVALID_PARAMETER_VALUE":
            return ConfigError(f"{what}: refused by the MLflow server: {_reason(e)}")
        return RegistryError(
            f"{what}: the MLflow server {safe_uri(tracking)} refused it ({code}): {_reason(e)}"
        )
    return RegistryError(
        f"{what}: the MLflow tracking server {safe_uri(tracking)} ({TRACKING_ENV}) did not "
        f"answer ({_reason(e)}); check that it is up and reachable from here, then rerun"
    )


def _experiment_id(client: Any, experiment: str) -> str:
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return str(found.experiment_id)
    return str(client.create_experiment(experiment))


def _log_bundle(client: Any, path: str, spec: Any, sha: str, experiment: str) -> str:
    """A new, finished run whose artifacts under ``bundle/`` are the bundle folder's files."""
    tags = {
        SHA_TAG: sha,
        "score_catalog.bundle_name": spec.name,
        "score_catalog.bundle_version": spec.version,
    }
    run = client.create_run(
        _experiment_id(client, experiment),
        run_name=f"bundle {spec.name} v{spec.version}",
        tags=tags,
    )
    run_id = str(run.info.run_id)
    try:
        client.log_artifacts(run_id, path, artifact_path=BUNDLE_ARTIFACT_PATH)
    except BaseException:
        with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()):
            client.set_terminated(run_id, "FAILED")
        raise
    # set_terminated prints "View run ..." links on stdout, which is the command's own output.
    with contextlib.redirect_stdout(io.StringIO()):
        client.set_terminated(run_id)
    return run_id


def _new_version(mlflow: Any, client: Any, name: str, run_id: str, sha: str, spec: Any) -> str:
    """Register the run's ``bundle/`` artifacts as a new version of ``name`` (created if new)."""
    try:
        client.create_registered_model(name)
    except mlflow.exceptions.RestException as e:
        if getattr(e, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
            raise
    run = client.get_run(run_id)
    mv = client.create_model_version(
        name,
        source=f"{run.info.artifact_uri}/{BUNDLE_ARTIFACT_PATH}",
        run_id=run_id,
        tags={SHA_TAG: sha},
        description=f"score-catalog bundle {spec.name} v{spec.version} (sha256 {sha[:12]})",
    )
    return str(mv.version)
