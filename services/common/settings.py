"""Command-line flags and environment variables from one config dataclass.

Every service and the launcher describe their configuration once, as a dataclass whose
fields carry their environment variable, with a docstring under each that is its ``--help``::

    @dataclass
    class ExecutorConfig:
        port: int = setting(50052, env="TOKENMILL_EXECUTOR_PORT")
        '''gRPC port (0 = any free port).'''
        model: str = setting("", env="TOKENMILL_MODEL", path=True)
        '''Checkpoint directory.'''

    config = parse_config(ExecutorConfig, description="tokenmill executor")

Precedence: command-line flag > environment variable > dataclass default. ``--help``
shows each flag's environment variable and the default in effect (the environment's when
it is set). ``to_argv`` turns a config back into flags, so a launcher can hand its
settings to a child process.

Supported field types: str, int, float, bool (``--flag`` / ``--no-flag``: a boolean is named for
what it turns on, ``demo`` not ``no_demo``, which argparse would make ``--no-no-demo``), Path, Enum
(by value), ``X | None`` (the string "none" or an empty value means None), and
``list[X]`` / ``tuple[X, ...]`` (comma-separated, in flags and env alike; with
``metadata["repeat"]`` the flag is given once per item instead, for items that may hold
commas themselves, such as flags passed on to a child process).

A file or directory setting (a ``Path`` field, or one whose metadata has ``"path": True``) is
made absolute against the working directory where it is parsed, from a flag, the environment or
a relative default alike: a launcher hands it to children and files that resolve relative paths
elsewhere (a routes file resolves them against its own directory), so the path a person typed
must mean what it meant where they typed it.

A config may embed another config dataclass whole (``embedded``): its fields become flags of
their own names, with environment variables named by a prefix, so a dataclass that an engine
also uses (the scheduler's limits) is declared once and the service config holds it as is::

    @dataclass
    class SchedulerServiceConfig:
        port: int = ...
        limits: SchedulerLimits = embedded(SchedulerLimits, env_prefix="TOKENMILL_")
        # --max-num-seqs / TOKENMILL_MAX_NUM_SEQS, with the help from the limit's docstring
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import os
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_MISSING = dataclasses.MISSING


@dataclasses.dataclass(frozen=True, slots=True)
class _FieldSpec:
    name: str
    flag: str
    dest: str
    parse: Callable[[str], Any]
    kind: str  # "scalar", "bool", "sequence", "repeated"
    sequence_type: type | None
    optional: bool
    enum_type: type[enum.Enum] | None
    path: bool


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unsupported union type {tp!r}; only X | None is allowed")
    return tp, False


def _scalar_parser(tp: Any, field_name: str) -> Callable[[str], Any]:
    if tp is bool:
        return _parse_bool
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda text: _parse_enum(tp, text)
    if tp in (str, int, float, Path):
        return tp
    raise TypeError(f"field {field_name!r}: unsupported type {tp!r}")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false/1/0/yes/no/on/off), got {text!r}")


def _parse_enum(enum_type: type[enum.Enum], text: str) -> enum.Enum:
    for member in enum_type:
        if str(member.value) == text or member.name.lower() == text.lower():
            return member
    choices = ", ".join(str(m.value) for m in enum_type)
    raise ValueError(f"expected one of {choices}, got {text!r}")


def _field_spec(field: dataclasses.Field, tp: Any, prefix: str) -> _FieldSpec:
    inner, optional = _unwrap_optional(tp)
    origin = typing.get_origin(inner)
    flag = "--" + (prefix + field.name).replace("_", "-")
    dest = (prefix + field.name).replace("-", "_")
    enum_type = inner if isinstance(inner, type) and issubclass(inner, enum.Enum) else None
    if inner is bool and field.name.startswith("no_"):
        # argparse's --no-X of a field named no_X is --no-no-X, and both set False.
        raise TypeError(f"field {field.name!r}: name a boolean setting for what it turns on "
                        f"({field.name[3:]!r}, default flipped), so --{field.name[3:]} / --no-{field.name[3:]} work")
    path = bool(field.metadata.get("path")) or inner is Path
    if origin in (list, tuple):
        args = typing.get_args(inner)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"field {field.name!r}: only tuple[X, ...] is supported, got {inner!r}")
        item_parser = _scalar_parser(args[0] if args else str, field.name)
        kind = "repeated" if field.metadata.get("repeat") else "sequence"
        return _FieldSpec(field.name, flag, dest, item_parser, kind, origin, optional, None, False)
    kind = "bool" if inner is bool else "scalar"
    return _FieldSpec(field.name, flag, dest, _scalar_parser(inner, field.name), kind, None, optional, enum_type,
                      path and kind == "scalar")


def _absolute(spec: _FieldSpec, value: Any) -> Any:
    """A path setting's value made absolute against the working directory (empty stays unset)."""
    if not spec.path or value is None or value is _MISSING or str(value) == "":
        return value
    return type(value)(os.path.abspath(os.path.expanduser(str(value))))


def _convert(spec: _FieldSpec, text: str) -> Any:
    """Turn one flag or env string into the field's value."""
    if spec.optional and text.strip().lower() in ("", "none"):
        return None
    if spec.kind in ("sequence", "repeated"):
        items = [part.strip() for part in text.split(",") if part.strip()]
        return spec.sequence_type(spec.parse(item) for item in items)
    return _absolute(spec, spec.parse(text))


def setting(default: Any = _MISSING, *, env: str | None = None,
            default_factory: Any = _MISSING, **extra: Any) -> Any:
    """A setting declared once: its default and its environment variable (``None``: named by an
    ``embedded`` config's env_prefix, or none). Its ``--help`` is the docstring written under the
    field (``attribute_docs``). ``extra`` is more metadata: ``path=True`` (made absolute where
    parsed), ``repeat=True`` (one flag per item), ``choices=NAMES`` (listed after the help, so a
    docstring need not repeat a constant). Settings are values, so a sequence default is a
    tuple."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for a sequence default (settings are frozen)")
    if "help" in extra:
        raise TypeError("a setting's help is the docstring under its field, not a help= argument")
    metadata = {**({"env": env} if env else {}), **extra}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def attribute_docs(config_cls: type) -> dict[str, str]:
    """{field name: the docstring written under it (``inspect.cleandoc``-ed)} over config_cls and
    its bases.

    Read from the source, as vLLM's config classes and TGI's clap do: a string literal right
    after an annotated assignment documents that attribute. A class whose source cannot be read
    (made at run time) documents nothing; its fields carry ``metadata["help"]``.
    """
    docs: dict[str, str] = {}
    for klass in reversed(config_cls.__mro__):
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def field_help(config_cls: type, field: dataclasses.Field, *, first_paragraph: bool = False) -> str:
    """A field's one description, on one line as ``--help`` shows it: the docstring under it, else
    its metadata's help (benchmarks/harness/flags.py copies an engine setting's help into a run's
    flag that way)."""
    text = attribute_docs(config_cls).get(field.name) or field.metadata.get("help", "")
    if first_paragraph:
        text = text.split("\n\n")[0]
    return " ".join(text.split())


def embedded(config_cls: type, *, env_prefix: str, default: Any = None) -> Any:
    """A field that holds a whole config dataclass, whose fields become this config's flags.

    Each inner field keeps its own flag name (``--max-num-seqs``, under the caller's prefix
    only), takes its help from its docstring, and its environment variable from its metadata
    or else ``env_prefix + NAME`` (``TOKENMILL_MAX_NUM_SEQS``; an empty prefix gives the inner
    fields none). The defaults are the inner dataclass's own, or those of ``default``, an
    instance of it (a benchmark that runs the scheduler with a small batch by default).
    """
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"{config_cls!r} is not a dataclass")
    if default is not None and type(default) is not config_cls:
        raise TypeError(f"the default of an embedded {config_cls.__name__} must be one, got {default!r}")
    factory = config_cls if default is None else (lambda: default)
    return dataclasses.field(default_factory=factory, metadata={"embedded": True, "env_prefix": env_prefix})


def _is_embedded(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("embedded"))


def _field_default(field: dataclasses.Field) -> Any:
    if field.default is not _MISSING:
        return field.default
    if field.default_factory is not _MISSING:
        return field.default_factory()
    return _MISSING


def _fields_with_types(config_cls: type) -> list[tuple[dataclasses.Field, Any]]:
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"{config_cls!r} is not a dataclass")
    hints = typing.get_type_hints(config_cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(config_cls) if f.init]


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config_cls: type,
    *,
    prefix: str = "",
    env: Mapping[str, str] | None = None,
) -> None:
    """Add one flag per field of config_cls; defaults come from env, then the dataclass.

    prefix is prepended to the flag and dest names ("executor_" -> --executor-port), so a
    launcher can hold several configs in one parser. Environment variable names come from
    metadata["env"] unchanged (for the fields of an ``embedded`` config without one:
    its env_prefix + the field name in capitals).
    """
    environ = os.environ if env is None else env
    _add_arguments(parser, config_cls, prefix, environ, env_prefix=None, defaults=None)


def _add_arguments(
    parser: argparse.ArgumentParser,
    config_cls: type,
    prefix: str,
    environ: Mapping[str, str],
    env_prefix: str | None,
    defaults: Any,
) -> None:
    """One argument group per dataclass; an embedded dataclass gets its own group.
    ``defaults``: the embedding field's instance, whose values are the defaults (None: the class's)."""
    group = parser.add_argument_group(config_cls.__name__)
    for field, tp in _fields_with_types(config_cls):
        if _is_embedded(field):
            inner = _field_default(field) if defaults is None else getattr(defaults, field.name)
            _add_arguments(parser, tp, prefix, environ, env_prefix=field.metadata["env_prefix"], defaults=inner)
            continue
        spec = _field_spec(field, tp, prefix)
        env_name = field.metadata.get("env") or (env_prefix + field.name.upper() if env_prefix else None)
        help_text = field_help(config_cls, field)
        default = _absolute(spec, _field_default(field) if defaults is None else getattr(defaults, field.name))
        from_env = False
        if env_name and env_name in environ:
            try:
                default = _convert(spec, environ[env_name])
            except ValueError as exc:
                raise ValueError(f"environment variable {env_name}={environ[env_name]!r} for {spec.flag}: {exc}") from None
            from_env = True
        notes = []
        if default is not _MISSING:
            notes.append(f"default: {_format_value(default) or '(empty)'}" + (f" from {env_name}" if from_env else ""))
        if env_name and not from_env:
            notes.append(f"env: {env_name}")
        if "choices" in field.metadata:
            notes.append("choices: " + ", ".join(_format_value(c) for c in field.metadata["choices"]))
        full_help = f"{help_text} ({'; '.join(notes)})" if notes else help_text
        full_help = full_help.replace("%", "%%")  # argparse formats help with %
        kwargs: dict[str, Any] = {"dest": spec.dest, "help": full_help}
        if default is _MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        if spec.kind == "bool" and not spec.optional:
            group.add_argument(spec.flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if spec.kind == "repeated":
            # Each flag adds one item, after those of the environment or the default.
            kwargs["default"] = list(kwargs.get("default", ()))
            group.add_argument(spec.flag, action="append", type=spec.parse, metavar=spec.name.upper(), **kwargs)
            continue
        kwargs["type"] = _argparse_type(spec)
        kwargs["metavar"] = _metavar(spec)
        group.add_argument(spec.flag, **kwargs)


def _argparse_type(spec: _FieldSpec) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return _convert(spec, text)
        except ValueError as exc:
            # argparse reports ArgumentTypeError messages verbatim, naming the flag.
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = spec.name
    return parse


def _metavar(spec: _FieldSpec) -> str:
    if spec.enum_type is not None:
        return "{" + ",".join(str(m.value) for m in spec.enum_type) + "}"
    return spec.name.upper() + ("[,...]" if spec.kind == "sequence" else "")


def config_from_args(config_cls: type[T], args: argparse.Namespace, *, prefix: str = "") -> T:
    """Build config_cls from the namespace add_config_arguments filled in."""
    values = {}
    for f, tp in _fields_with_types(config_cls):
        if _is_embedded(f):
            values[f.name] = config_from_args(tp, args, prefix=prefix)
            continue
        value = getattr(args, (prefix + f.name).replace("-", "_"))
        if f.metadata.get("repeat"):
            value = _field_spec(f, tp, prefix).sequence_type(value)
        values[f.name] = value
    return config_cls(**values)


def parse_config(
    config_cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    description: str | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
) -> T:
    """Parse argv (sys.argv[1:] when None) and the environment into a config_cls instance."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description or config_cls.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_config_arguments(parser, config_cls, env=env)
    return config_from_args(config_cls, parser.parse_args(argv))


def to_argv(config: Any, *, prefix: str = "", only_changed: bool = True, _defaults: Any = None) -> list[str]:
    """Flags that reproduce config when parsed (by parse_config of the same class and prefix).

    only_changed leaves out fields equal to their default (the dataclass's, or an embedding
    field's instance), keeping command lines short; the child's own environment could then
    supply a different value, so pass only_changed=False when the child must see exactly
    this config.
    """
    argv: list[str] = []
    for field, tp in _fields_with_types(type(config)):
        value = getattr(config, field.name)
        default = _field_default(field) if _defaults is None else getattr(_defaults, field.name)
        if _is_embedded(field):
            argv.extend(to_argv(value, prefix=prefix, only_changed=only_changed, _defaults=default))
            continue
        spec = _field_spec(field, tp, prefix)
        if only_changed and value == default:
            continue
        if spec.kind == "bool" and not spec.optional:
            argv.append(spec.flag if value else "--no-" + spec.flag[2:])
            continue
        if spec.kind == "repeated":
            argv.extend(f"{spec.flag}={_format_value(item)}" for item in value)
            continue
        argv.extend([spec.flag, _format_value(value)])
    return argv


def _format_value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, (list, tuple)):
        return ",".join(_format_value(v) for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
