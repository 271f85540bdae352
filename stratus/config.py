"""One settings loader for every role: a TOML file, ``STRATUS_*`` variables and flags.

Each setting is a field of its role's frozen dataclass (``router/settings.py``,
``cloud_gateway/settings.py``, ``edge_agent/settings.py``), and its default is written there
only. A field ``concurrency`` of role ``agent`` is read from, weakest first:

* the dataclass default;
* ``concurrency = 2`` in the ``[agent]`` table of ``--config FILE``;
* ``STRATUS_AGENT_CONCURRENCY``;
* the flag whose argparse dest is ``concurrency`` (flags default to ``None``: not given).

A nested dataclass (``tls``, ``audit``) is a sub-table (``[router.tls]``), its variables
``STRATUS_ROUTER_TLS_CERT``, its flags' dests ``tls_cert``. A secret field holds a credential:
it is never written in a file or a flag, only a path to it is (``agent_token_file``), or
its own variables (``STRATUS_AGENT_TOKEN``), as before. Values are coerced to the field's
type and checked by the field's check; a bad one raises :class:`ConfigError` naming where
it came from (``stratus.toml:router.keepalive_s``, ``$STRATUS_ROUTER_KEEPALIVE_S``,
``--keepalive-s``), so the CLI prints one line, not a traceback. Adding a setting is adding
a field; a flag for it is one ``_option(...)`` in ``stratus/cli/main.py`` (an argparse option whose
dest is the field's name and whose default is ``None``), with no wiring: the loader finds it.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from stratus.config_values import coerce, show_value
from stratus.errors import ConfigError

T = TypeVar("T")
Check = Callable[[Any], "str | None"]  # a value's problem, or None where it is fine
ROLES = ("router", "cloud", "agent")

_CHECK = "stratus.check"
_SECRET = "stratus.secret"  # the variables a secret is read from, in order
_ITEM = "stratus.item"  # parses one item of a tuple field from its text
_OUTSIDE = "stratus.outside"  # not configurable: the caller hands it in (e.g. the CPU's flags)


def setting(
    default: Any = dataclasses.MISSING,
    *,
    check: Check | None = None,
    item: Callable[[str], Any] | None = None,
) -> Any:
    """A configurable field, with its one default and the check every source must pass."""
    return dataclasses.field(default=default, metadata={_CHECK: check, _ITEM: item})


def secret(*variables: str) -> Any:
    """A credential: read from the file a ``NAME_file`` key or flag names, else from the
    first of ``variables`` that is set; empty where none is."""
    return dataclasses.field(default="", metadata={_SECRET: variables})


def outside(default: Any = None) -> Any:
    """A field no file, variable or flag sets: the caller passes it to :func:`load`."""
    return dataclasses.field(default=default, metadata={_OUTSIDE: True})


def positive(value: Any) -> str | None:
    return None if value is None or value > 0 else f"must be more than 0, not {value}"


def not_negative(value: Any) -> str | None:
    return None if value is None or value >= 0 else f"must not be negative, not {value}"


def at_least_one(value: Any) -> str | None:
    return None if value is None or value >= 1 else f"must be at least 1, not {value}"


def share(value: Any) -> str | None:
    return None if 0.0 <= value <= 1.0 else f"is a share between 0 and 1, not {value}"


def validate(settings: Any) -> None:
    """Run every field's check on a built settings object (its ``__post_init__`` calls
    this, so settings built in code are checked as loaded ones are)."""
    for spec in dataclasses.fields(settings):
        check = spec.metadata.get(_CHECK)
        problem = check(getattr(settings, spec.name)) if check else None
        if problem:
            raise ConfigError(f"{spec.name} {problem}")


@dataclass(frozen=True)
class Flags:
    """The flags given: argparse dests with their values (``None``: not given), and each
    dest's option string, to name it in errors."""

    values: Mapping[str, object]
    names: Mapping[str, str]


NO_FLAGS = Flags({}, {})


@dataclass(frozen=True)
class Sources:
    """Where the TOML, variables and flags come from."""

    role: str
    table: Mapping[str, Any]
    file: Path | None
    environ: Mapping[str, str]
    flags: Flags
    read_secrets: bool
    partial: bool


@dataclass(frozen=True)
class Loaded(Generic[T]):
    """Built settings (``None`` where ``partial`` left a required one unset), and where each
    setting came from and how ``stratus config check`` shows it."""

    settings: T | None
    origins: dict[str, str]
    shown: dict[str, str]

    @property
    def built(self) -> T:
        assert self.settings is not None, "only a partial load leaves settings unbuilt"
        return self.settings


def read_file(path: Path) -> dict[str, Any]:
    """The TOML file's tables; only the roles' sections may be there."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not TOML: {exc}") from None
    for section, value in data.items():
        if section not in ROLES:
            raise ConfigError(f"{path}:{section}: unknown section (expected {', '.join(ROLES)})")
        if not isinstance(value, dict):
            raise ConfigError(f"{path}:{section}: must be a table ([{section}])")
    return data


def load(
    cls: type[T],
    role: str,
    *,
    file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Flags = NO_FLAGS,
    given: Mapping[str, object] | None = None,
    read_secrets: bool = True,
    partial: bool = False,
) -> Loaded[T]:
    """``cls`` built from its defaults, ``file``'s ``[role]`` table, ``STRATUS_ROLE_*`` in
    ``environ`` and ``flags``, strongest last; ``given`` holds its :func:`outside` fields.
    With ``read_secrets`` false, no credential file is opened; with ``partial``, a required
    setting left unset is reported, not refused (``config check``: flags may give it)."""
    table = read_file(file).get(role, {}) if file is not None else {}
    sources = Sources(role, table, file, environ if environ is not None else {}, flags, read_secrets, partial)
    walk = _Walk(sources)
    kwargs = _fields(walk, cls, (), table)
    kwargs.update(given or {})
    if "required" in walk.origins.values():
        return Loaded(None, walk.origins, walk.shown)
    try:
        built = cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a dataclass's own cross-field check
        raise ConfigError(f"{role} settings: {exc}") from None
    return Loaded(built, walk.origins, walk.shown)


@dataclass
class _Walk:
    """One load: its sources, and each setting's origin and shown value as they are read."""

    sources: Sources
    origins: dict[str, str] = dataclasses.field(default_factory=dict)
    shown: dict[str, str] = dataclasses.field(default_factory=dict)


def _fields(walk: _Walk, cls: type[Any], path: tuple[str, ...], table: Mapping[str, Any]) -> dict[str, Any]:
    """``cls``'s keyword arguments from ``table`` and the other sources (those given only)."""
    hints = typing.get_type_hints(cls)
    specs = [f for f in dataclasses.fields(cls) if not f.metadata.get(_OUTSIDE)]
    _refuse_unknown(specs, walk.sources, path, table)
    kwargs: dict[str, Any] = {}
    for spec in specs:
        key = (*path, spec.name)
        name = ".".join(key)
        if _SECRET in spec.metadata:
            kwargs[spec.name], walk.origins[name], walk.shown[name] = _secret(spec, key, walk.sources, table)
        elif dataclasses.is_dataclass(hints[spec.name]):
            kwargs[spec.name] = _nested(walk, hints[spec.name], key, table.get(spec.name, {}))
        elif (found := _strongest(spec, hints[spec.name], key, walk.sources, table)) is not None:
            kwargs[spec.name], walk.origins[name] = found
            walk.shown[name] = show_value(kwargs[spec.name])
        elif _required(spec):
            _missing(walk, key)
        else:
            walk.origins[name], walk.shown[name] = "default", show_value(_default(spec))
    return kwargs


def _missing(walk: _Walk, key: tuple[str, ...]) -> None:
    """A required setting no source gives: refused, or (``partial``) reported as unset."""
    name, role = ".".join(key), walk.sources.role
    if walk.sources.partial:
        walk.origins[name], walk.shown[name] = "required", "(not set: a flag must give it)"
        return
    dest = "_".join(key)
    flag = walk.sources.flags.names.get(dest, f"--{dest.replace('_', '-')}")
    raise ConfigError(f"{role} needs {name}: give {flag}, ${_variable(role, dest)} or {name} in [{role}]")


def _variable(role: str, dest: str) -> str:
    return f"STRATUS_{role}_{dest}".upper()


def _nested(walk: _Walk, cls: type[Any], path: tuple[str, ...], table: object) -> Any:
    """A nested dataclass (``tls``, ``audit``): its own table, built and checked as one."""
    sources = walk.sources
    if not isinstance(table, dict):
        raise ConfigError(f"{_in_file(sources, path)}: must be a table ([{sources.role}.{'.'.join(path)}])")
    kwargs = _fields(walk, cls, path, table)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{sources.role}.{'.'.join(path)}: {exc}") from None


def _refuse_unknown(
    specs: Sequence[dataclasses.Field[Any]],
    sources: Sources,
    path: tuple[str, ...],
    table: Mapping[str, Any],
) -> None:
    known = {f"{f.name}_file" if _SECRET in f.metadata else f.name for f in specs}
    secrets = {f.name for f in specs if _SECRET in f.metadata}
    for key in table:
        if key in secrets:
            raise ConfigError(
                f"{_in_file(sources, (*path, key))}: a credential is never written in the file: "
                f"give {key}_file, the path of a file that holds it"
            )
        if key not in known:
            raise ConfigError(f"{_in_file(sources, (*path, key))}: unknown setting")


def _strongest(
    spec: dataclasses.Field[Any], kind: Any, key: tuple[str, ...], sources: Sources, table: Mapping[str, Any]
) -> tuple[Any, str] | None:
    """The value of the strongest source that sets the field, coerced and checked."""
    dest = "_".join(key)
    variable = _variable(sources.role, dest)
    candidates = (
        (sources.flags.values.get(dest), sources.flags.names.get(dest, f"--{dest.replace('_', '-')}")),
        (sources.environ.get(variable), f"${variable}"),
        (table.get(spec.name), _in_file(sources, key)),
    )
    for raw, where in candidates:
        if raw is not None and raw != []:
            value = coerce(raw, kind, where, spec.metadata.get(_ITEM))
            check = spec.metadata.get(_CHECK)
            problem = check(value) if check else None
            if problem:
                raise ConfigError(f"{where}: {problem}")
            return value, where
    return None


def _secret(
    spec: dataclasses.Field[Any], key: tuple[str, ...], sources: Sources, table: Mapping[str, Any]
) -> tuple[str, str, str]:
    """A credential, where it came from, and how ``config check`` shows it (never the value)."""
    dest = "_".join(key) + "_file"
    flag = sources.flags.values.get(dest)
    if flag is not None:
        where = sources.flags.names.get(dest, f"--{dest.replace('_', '-')}")
        return _read_secret(Path(str(flag)), sources), where, f"file {flag}"
    for variable in spec.metadata[_SECRET]:
        if sources.environ.get(variable):
            return sources.environ[variable], f"${variable}", f"(from ${variable})"
    in_file = table.get(spec.name + "_file")
    if in_file is not None:
        where = _in_file(sources, (*key[:-1], spec.name + "_file"))
        if not isinstance(in_file, str):
            raise ConfigError(f"{where}: must be a path (a string)")
        return _read_secret(Path(in_file), sources), where, f"file {in_file}"
    return "", "default", "(none)"


def _read_secret(path: Path, sources: Sources) -> str:
    if not sources.read_secrets:
        return ""
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def _in_file(sources: Sources, key: tuple[str, ...]) -> str:
    return f"{sources.file}:{sources.role}.{'.'.join(key)}"


def _required(spec: dataclasses.Field[Any]) -> bool:
    return spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING


def _default(spec: dataclasses.Field[Any]) -> Any:
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return None


def default_of(cls: type[Any], name: str) -> Any:
    """A field's one default (``tls.cert`` for a nested one), for flags' help."""
    head, _, rest = name.partition(".")
    spec = next(f for f in dataclasses.fields(cls) if f.name == head)
    if rest:
        return default_of(typing.get_type_hints(cls)[head], rest)
    return _default(spec)
