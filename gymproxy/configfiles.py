"""Config files as NeMo Gym reads them: YAML loaded with OmegaConf, several files merged in NeMo Gym's
`config_paths` order (later files win, a file after the ones it names), Hydra-style overrides
(`key=value`, `+key=value`, `++key=value`, `~key`) merged last, and `${...}` resolved by OmegaConf.

Every key is located at the file and line that set it, so a problem is reported where it was
written. Reading is bounded: the bytes, files and nesting of each file, its values with YAML aliases
expanded, and the resolved section with interpolations expanded (checked before OmegaConf builds
anything). Only OmegaConf's own `oc.*` resolvers run; `oc.env` reads the environment the caller
passes (`resolve`), and outside gymproxy's loader it behaves as OmegaConf's own.
"""

from __future__ import annotations

import contextvars
import io
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

MAX_FILE_BYTES: Final = 1 << 20
MAX_FILES: Final = 64
MAX_DEPTH: Final = 64  # nested mappings and lists in one file
MAX_NODES: Final = 20_000  # values of one file, YAML aliases expanded (NeMo Gym's have some 50)
MAX_EXPANDED: Final = 4 << 20  # characters and values of a resolved section, interpolations expanded
CONFIG_PATHS: Final = "config_paths"
MISSING: Final = "???"  # OmegaConf's mandatory value: given at serve time
# OmegaConf's built-in resolvers (NeMo Gym's configs use oc.env, oc.select and oc.decode). None reads
# a file or runs code; NeMo Gym's own `inherit_from` and `copy` are directives gymproxy does not apply.
RESOLVERS: Final = frozenset({"oc.env", "oc.select", "oc.decode", "oc.create", "oc.deprecated"})
_KEYED = frozenset({"oc.select", "oc.deprecated", "oc.dict.keys", "oc.dict.values"})  # first argument: a key
_DIRECTIVES = {"inherit_from", "copy"}


class Problem(NamedTuple):
    """One thing wrong with the config: the key (dotted, as written), what is wrong, and where."""

    path: str
    message: str
    where: str = "config"

    def line(self) -> str:
        return f"{self.where}: {self.path}: {self.message}" if self.path else f"{self.where}: {self.message}"


class ConfigError(Exception):
    """The configuration cannot be used; each line of the message is one problem, naming its key."""

    @classmethod
    def of(cls, problems: Iterable[Problem]) -> ConfigError:
        return cls("\n".join(dict.fromkeys(problem.line() for problem in problems)))


def join(path: str, key: object) -> str:
    """`a.b` + `c` is `a.b.c`; a list index is `a.b[0]`."""
    if isinstance(key, int) and not isinstance(key, bool):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


# --- placeholders: a value that has none yet --------------------------------------------------------
_MARK = "\x00"
_MARKED = re.compile(f"{_MARK}([^{_MARK}]*){_MARK}")


def placeholder(name: str) -> str:
    """A string that stands for `name` (`x` of `${x}`, `oc.env:X`, `???`) until it is given a value."""
    return f"{_MARK}{name}{_MARK}"


def placeholders_in(text: str) -> list[str]:
    """The placeholder names in a resolved string."""
    return _MARKED.findall(text)


def without_placeholders(text: str, value: Any) -> Any:
    """`text` with each placeholder replaced by its name, or `value` when it is one whole placeholder."""
    if _MARKED.fullmatch(text):
        return value
    return _MARKED.sub(lambda match: match.group(1), text)


# --- oc.env with the caller's environment -----------------------------------------------------------
_ENVIRON: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("gymproxy_environ", default=None)
_NO_DEFAULT: Final = object()


def _env(key: str, default: Any = _NO_DEFAULT) -> str | None:
    """OmegaConf's `oc.env`, reading the environment `resolve` was given; an unset variable with no
    default is a placeholder there (reported with its key), and a KeyError anywhere else, as OmegaConf's."""
    environ = _ENVIRON.get()
    source: Mapping[str, str] = os.environ if environ is None else environ
    if key in source:
        return source[key]
    if default is not _NO_DEFAULT:
        return None if default is None else str(default)
    if environ is not None:
        return placeholder(f"oc.env:{key}")
    raise KeyError(f"Environment variable '{key}' not found")


OmegaConf.register_new_resolver("oc.env", _env, replace=True)


# --- reading files ----------------------------------------------------------------------------------
class Files:
    """The merged config files and overrides, unresolved, with where each key was set."""

    def __init__(self, tree: DictConfig, paths: list[str], where: dict[str, str]) -> None:
        self.tree = tree
        self.paths = paths  # in merge order
        self.where = where  # dotted path -> "file:line" or "override KEY"
        self.added: set[str] = set()  # top-level keys only `provide` and `resolve` put there

    def locate(self, path: str) -> str:
        """Where `path` (or the nearest key above it) was set; the files when nothing above it was."""
        at = path
        while at:
            if at in self.where:
                return self.where[at]
            cut = max(at.rfind("."), at.rfind("["))
            at = at[: max(cut, 0)]
        return ", ".join(self.paths) or "config"

    def place(self, problem: Problem) -> Problem:
        """`problem` at the file and line (or override) that set its key."""
        where = self.locate(problem.path)
        if where.startswith("override ") and where.partition(" ")[2].lstrip("+~") == problem.path:
            return problem._replace(path="", where=where)  # the override names the key already
        return problem._replace(where=where)

    def provide(self, name: str, value: Any, where: str) -> None:
        """Give the top-level key `name` (a `${name}` of the files) a value, taken as it is (a `${`
        in it is no interpolation)."""
        if name not in self.tree:
            self.added.add(name)
        self.tree[name] = _literal(value)
        self.where[name] = where

    def placeholders(self) -> set[str]:
        """The top-level names that `${name}` interpolations refer to (not relative ones or resolvers)."""
        names: set[str] = set()
        for _, text in _strings(OmegaConf.to_container(self.tree, resolve=False), ""):
            for body in _interpolations(text):
                names.update(_names(body))
        return names

    def resolve(self, keys: Sequence[str], environ: Mapping[str, str]) -> tuple[Any, list[Problem]]:
        """The section at `keys` resolved into plain values (`oc.env` reading `environ`), with every
        problem found, located.

        A `${name}` the files use and nothing gives, an `oc.env` variable `environ` lacks and a `???`
        come back as `placeholder` strings, for the caller to report or stand in for."""
        for name in self.placeholders() - set(self.tree.keys()):
            self.added.add(name)
            self.tree[name] = placeholder(name)
        plain = OmegaConf.to_container(self.tree, resolve=False)
        problems = _expansion_problems(plain, tuple(keys))
        section = None
        if not problems:
            token = _ENVIRON.set(environ)
            try:
                node: Any = self.tree
                for depth, key in enumerate(keys, 1):
                    node = _item(node, key, ".".join(keys[:depth]), problems)
                    if not isinstance(node, DictConfig):
                        break
                section = _resolved(node, ".".join(keys), problems)
            finally:
                _ENVIRON.reset(token)
            if not problems and not isinstance(section, dict):
                problems.append(Problem(".".join(keys), "must be a mapping of config keys"))
        return section, [self.place(problem) for problem in problems]


def read(paths: Sequence[str | Path], overrides: Sequence[str] = ()) -> Files:
    """Load `paths` and the files their `config_paths` name, merge them as NeMo Gym does, and apply
    the Hydra-style `overrides` (whose `config_paths=[...]` adds files too); raises `ConfigError`."""
    problems: list[Problem] = []
    command, deletes, overridden = _overrides(overrides, problems)
    roots = [str(path) for path in paths]
    roots += _config_paths(command, "override config_paths", problems)
    entries = list(roots)
    children: list[list[int]] = [[] for _ in roots]
    loaded: list[DictConfig | None] = []
    named_by: dict[str, str] = {}
    where: dict[str, str] = {}
    index = 0
    while index < len(entries):
        entry = entries[index]
        config, found = _load(entry, named_by.get(entry, "--config"), problems)
        loaded.append(config)
        where.update(found)
        included = _config_paths(config, entry, problems)
        if included:
            for item in included:
                if str(item) not in entries:
                    entries.append(str(item))
                    children.append([])
                    children[index].append(len(entries) - 1)
                    named_by[str(item)] = f"{entry}: {CONFIG_PATHS}"
        if len(entries) > MAX_FILES:
            problems.append(Problem("", f"more than {MAX_FILES} config files (with their {CONFIG_PATHS})", entry))
            break
        index += 1
    if problems:
        raise ConfigError.of(problems)
    # A file after the ones it pulled in, each subtree in the order listed (NeMo Gym's merge order).
    order: list[int] = []
    pending = [(root, False) for root in reversed(range(len(roots)))]
    while pending:
        at, visited = pending.pop()
        if visited:
            order.append(at)
            continue
        pending.append((at, True))
        pending.extend((child, False) for child in reversed(children[at]))
    try:
        merged = OmegaConf.merge(*(loaded[i] for i in order), command)
    except OmegaConfBaseException as exc:
        raise ConfigError.of([Problem(_full_key(exc), f"cannot merge the files: {_first_line(exc)}")]) from None
    assert isinstance(merged, DictConfig)
    if CONFIG_PATHS in merged:
        del merged[CONFIG_PATHS]
    for key, text in overridden.items():
        where[key] = text
    for key, text in deletes.items():
        parent, _, last = key.rpartition(".")
        node = OmegaConf.select(merged, parent) if parent else merged
        if not isinstance(node, DictConfig) or last not in node:
            problems.append(Problem("", "is not in the config, so it cannot be deleted", text))
        else:
            del node[last]
    if problems:
        raise ConfigError.of(problems)
    return Files(merged, [entries[i] for i in order], where)


def _config_paths(config: DictConfig | None, path: str, problems: list[Problem]) -> list[str]:
    """The files a file's own `config_paths` names (taken out of it), as written: an interpolation
    there would be resolved before the environment is the loader's."""
    if config is None or CONFIG_PATHS not in config:
        return []
    plain = OmegaConf.to_container(config, resolve=False)
    value = plain.get(CONFIG_PATHS) if isinstance(plain, dict) else None
    del config[CONFIG_PATHS]
    value = [value] if isinstance(value, str) else value
    if isinstance(value, list) and all(isinstance(item, str) and "${" not in item for item in value):
        return value
    problems.append(Problem(CONFIG_PATHS, "must be a list of file paths, written out", path))
    return []


def _overrides(items: Sequence[str], problems: list[Problem]) -> tuple[DictConfig, dict[str, str], dict[str, str]]:
    """Hydra-style overrides as NeMo Gym's command line takes them: the config they make (merged last),
    the keys to delete (`~key`), and where each key was given."""
    command = OmegaConf.create({})
    deletes: dict[str, str] = {}
    given: dict[str, str] = {}
    if not items:
        return command, deletes, given
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import HydraException
    except ImportError:  # the optional extra `nemo`
        where = f"override {items[0].split('=', 1)[0]}"
        problems.append(
            Problem("", "Hydra-style overrides need hydra-core: pip install 'gymproxy[nemo]' (or use --set)", where)
        )
        return command, deletes, given

    parser = OverridesParser.create()
    for item in items:
        key = re.split(r"[=@]", item, maxsplit=1)[0].lstrip("~+")
        where = f"override {item.split('=', 1)[0]}"
        try:
            (override,) = parser.parse_overrides([item])
        except HydraException as exc:
            problems.append(Problem("", f"cannot be read: {_grammar(str(exc))}", where))
            continue
        key = override.key_or_group
        if not key or override.package is not None:
            problems.append(Problem("", "takes key=value, +key=value, ++key=value or ~key (a dotted key)", where))
        elif override.is_delete():
            deletes[key] = where
        elif override.is_sweep_override():
            problems.append(Problem("", "a,b is a sweep of values; quote it ('a,b'), or give a list ([a,b])", where))
        elif override.is_add() and OmegaConf.select(command, key, default=_NO_DEFAULT) is not _NO_DEFAULT:
            problems.append(Problem("", "is added twice (+key); use ++key to replace it", where))
        else:
            try:
                OmegaConf.update(command, key, override.value(), merge=True, force_add=True)
            except (OmegaConfBaseException, ValueError) as exc:
                problems.append(Problem("", f"cannot be set: {_first_line(exc)}", where))
            given[key] = where
    return command, deletes, given


def _grammar(message: str) -> str:
    """A Hydra parse error's one useful line."""
    lines = [line for line in message.splitlines() if line.strip()]
    useful = [
        line
        for line in lines
        if not line.startswith(("See https://", "Error parsing override", "LexerNoViableAltException"))
        and not line.strip() == "^"
    ]
    # Its fragments of the value are left out: an override may carry a key.
    return (
        re.sub(r"'[^']*'", "'...'", useful[0] if useful else "an unexpected character") + " (Hydra's override grammar)"
    )


def _load(path: str, named_by: str, problems: list[Problem]) -> tuple[DictConfig | None, dict[str, str]]:
    """One file as OmegaConf loads it, within bounds, and where each of its keys is."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        problems.append(Problem("", f"cannot read {path}: {exc.strerror or exc}", named_by))
        return None, {}
    if len(data) > MAX_FILE_BYTES:
        problems.append(Problem("", f"is larger than {MAX_FILE_BYTES >> 20} MiB; a config file is a few KB", path))
        return None, {}
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        problems.append(Problem("", f"is not UTF-8 text (byte {exc.start})", path))
        return None, {}
    try:
        _measure(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        config = OmegaConf.load(io.StringIO(text)) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f"{path}:{mark.line + 1}" if mark is not None else path
        problems.append(Problem("", f"is not valid YAML: {exc.problem or exc.context}", at))
        return None, {}
    except _TooBig as exc:
        problems.append(Problem("", str(exc), path))
        return None, {}
    except (yaml.YAMLError, OmegaConfBaseException, ValueError, OSError) as exc:
        problems.append(Problem("", f"cannot be loaded: {_first_line(exc)}", path))
        return None, {}
    except RecursionError:
        problems.append(Problem("", f"is nested more than {MAX_DEPTH} levels deep", path))
        return None, {}
    if node is None:
        problems.append(Problem("", "is empty: give it config keys (a mapping), or leave it out", path))
        return None, {}
    if not isinstance(node, yaml.MappingNode) or not isinstance(config, DictConfig):
        problems.append(
            Problem("", "must be a mapping of config keys at the top level", f"{path}:{node.start_mark.line + 1}")
        )
        return None, {}
    where: dict[str, str] = {}
    _locate(node, "", path, where)
    return config, where


class _TooBig(Exception):
    pass


def _measure(text: str) -> None:
    """Refuse YAML whose values, aliases expanded, are too many or too deep, or refer to themselves.
    Counted from the parser's events, before anything is built: a YAML alias bomb costs its
    expansion only when OmegaConf builds it, and PyYAML's own nodes cost some 700 bytes a value."""
    sizes: dict[str, int] = {}  # anchor -> its values, aliases expanded
    stack: list[list[Any]] = []  # the open collections: [values so far, anchor]
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            stack.append([1, event.anchor])
            if len(stack) > MAX_DEPTH:
                raise _TooBig(f"is nested more than {MAX_DEPTH} levels deep")
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            count, anchor = stack.pop()
            if anchor is not None:
                sizes[anchor] = count
        elif isinstance(event, yaml.ScalarEvent):
            count = 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor in (entry[1] for entry in stack):
                line = event.start_mark.line + 1 if event.start_mark is not None else "?"
                raise _TooBig(f"has an alias inside its own anchor (line {line})")
            count = sizes.get(event.anchor or "", 1)  # an undefined one: the composer says so
        else:
            continue
        if stack:
            stack[-1][0] += count
            count = stack[-1][0]
        if count > MAX_NODES:
            raise _TooBig(f"has more than {MAX_NODES:,} values, YAML aliases expanded")


def _locate(node: yaml.Node, at: str, path: str, where: dict[str, str]) -> None:
    """Record `file:line` for each key and list item under `node` (explicit keys over `<<` merges)."""
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            where[join(at, index)] = f"{path}:{item.start_mark.line + 1}"
            _locate(item, join(at, index), path, where)
    elif isinstance(node, yaml.MappingNode):
        merged: list[yaml.Node] = []
        for key, value in node.value:
            if key.tag == "tag:yaml.org,2002:merge":
                merged += value.value if isinstance(value, yaml.SequenceNode) else [value]
                continue
            name = join(at, key.value) if isinstance(key, yaml.ScalarNode) else at
            where[name] = f"{path}:{key.start_mark.line + 1}"
            _locate(value, name, path, where)
        for base in merged:
            found: dict[str, str] = {}
            _locate(base, at, path, found)
            for name, line in found.items():
                where.setdefault(name, line)


# --- interpolations ---------------------------------------------------------------------------------
_PATH = re.compile(r"\s*(\.*)([\w/-]+(?:\[\d+\])*(?:\.[\w/-]+(?:\[\d+\])*)*)\s*")
_RESOLVER = re.compile(r"\s*([A-Za-z_][\w.]*)\s*:(.*)", re.DOTALL)
_NAME = re.compile(r"\s*([A-Za-z_][\w-]*)\s*")


def _interpolations(text: str) -> Iterator[str]:
    """The bodies of the outermost `${...}` in `text` (braces balanced, `\\${` escaped)."""
    start = text.find("${")
    while start != -1:
        if start and text[start - 1] == "\\":
            start = text.find("${", start + 2)
            continue
        depth, at = 0, start
        while at < len(text):
            if text.startswith("${", at):
                depth, at = depth + 1, at + 2
                continue
            if text[at] == "}":
                depth -= 1
                if depth == 0:
                    break
            at += 1
        yield text[start + 2 : at]
        start = text.find("${", at + 1)


def _names(body: str) -> Iterator[str]:
    """Top-level names a `${...}` body refers to (`x` of `${x}`, and inside resolver arguments)."""
    if _NAME.fullmatch(body):
        yield body.strip()
    for inner in _interpolations(body):
        yield from _names(inner)


def _strings(value: Any, at: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, join(at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, join(at, index))
    elif isinstance(value, str) and "${" in value:
        yield at, value


def _keys_of(path: str) -> list[str | int]:
    keys: list[str | int] = []
    for part in path.split("."):
        name, *indexes = re.split(r"\[(\d+)\]", part)
        keys.append(name) if name else None
        keys += [int(i) for i in indexes if i]
    return keys


class _Unreadable(Exception):
    """An interpolation gymproxy does not resolve; the message says why."""


def _references(body: str, parent: tuple[str | int, ...]) -> Iterator[tuple[str | int, ...]]:
    """The keys a `${...}` body reads, absolute (`parent` is where the string sits)."""
    path = _PATH.fullmatch(body)
    if path is not None:
        dots, rest = path.groups()
        base = parent[: len(parent) - (len(dots) - 1)] if dots else ()
        if len(dots) - 1 > len(parent):
            raise _Unreadable(f"`${{{body}}}` goes above the top of the config")
        yield (*base, *_keys_of(rest))
        return
    call = _RESOLVER.fullmatch(body)
    if call is None:
        raise _Unreadable(f"`${{{body}}}` is not an interpolation gymproxy can read (a key, or an oc.* resolver)")
    name, arguments = call.groups()
    if name in _DIRECTIVES:
        raise _Unreadable(f"`${{{name}:...}}` is NeMo Gym's inheritance directive, which gymproxy does not apply")
    if name not in RESOLVERS | _KEYED:
        raise _Unreadable(f"the resolver `{name}` is not supported (only OmegaConf's: {', '.join(sorted(RESOLVERS))})")
    if name in _KEYED:
        first = arguments.split(",", 1)[0]
        if "${" not in first and _PATH.fullmatch(first):
            yield from _references(first, parent)
    for inner in _interpolations(arguments):
        yield from _references(inner, parent)


def _expansion_problems(tree: Any, at: tuple[str, ...]) -> list[Problem]:
    """What resolving the section at `at` would cost, counted before OmegaConf does it: its characters
    and values with every interpolation expanded. Too many, a cycle, or an interpolation gymproxy does
    not resolve is a problem at the key that holds it."""
    sizes: dict[tuple[str | int, ...], int] = {}
    active: list[tuple[str | int, ...]] = []
    problems: list[Problem] = []

    def name(keys: tuple[str | int, ...]) -> str:
        text = ""
        for key in keys:
            text = join(text, key)
        return text

    def lookup(keys: tuple[str | int, ...]) -> Any:
        node = tree
        for key in keys:
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
                node = node[key]
            else:
                return None
        return node

    def size(keys: tuple[str | int, ...]) -> int:
        if keys in sizes:
            return sizes[keys]
        if keys in active:
            cycle = " -> ".join(name(k) for k in active[active.index(keys) :] + [keys])
            raise _Unreadable(f"interpolation cycle: {cycle}")
        active.append(keys)
        value, total = lookup(keys), 1
        if isinstance(value, dict):
            total += sum(size((*keys, key)) for key in value)
        elif isinstance(value, list):
            total += sum(size((*keys, index)) for index in range(len(value)))
        elif isinstance(value, str):
            total += len(value)
            for body in _interpolations(value):
                try:
                    total += sum(size(ref) for ref in _references(body, keys[:-1]))
                except _Unreadable as exc:
                    problems.append(Problem(name(keys), str(exc)))
        active.pop()
        sizes[keys] = total
        if total > MAX_EXPANDED:
            raise _TooBig(f"expands to more than {MAX_EXPANDED:,} characters and values (interpolations expanded)")
        return total

    try:
        size(at)
    except _Unreadable as exc:
        problems.append(Problem(name(active[-1]) if active else name(at), str(exc)))
    except _TooBig as exc:
        problems.append(Problem(name(at), str(exc)))
    except RecursionError:
        problems.append(Problem(name(at), "its interpolations are chained too deeply"))
    return problems


def _resolved(node: Any, at: str, problems: list[Problem]) -> Any:
    """`node` as plain values, every interpolation resolved by OmegaConf; each value that cannot be is
    a problem (and None), a `???` a placeholder."""
    if isinstance(node, DictConfig):
        return {key: _resolved(_item(node, key, join(at, key), problems), join(at, key), problems) for key in node}
    if isinstance(node, ListConfig):
        items = range(len(node))
        return [_resolved(_item(node, index, join(at, index), problems), join(at, index), problems) for index in items]
    return node


def _item(container: DictConfig | ListConfig, key: Any, at: str, problems: list[Problem]) -> Any:
    """`container[key]` resolved (a container stays one), or None and a problem."""
    if OmegaConf.is_missing(container, key):
        return placeholder(MISSING)
    try:
        return container[key]
    except OmegaConfBaseException as exc:
        problems.append(Problem(at, _first_line(exc)))
        return None


def _literal(value: Any) -> Any:
    """`value` with every `${` escaped, so OmegaConf keeps it as written."""
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, list):
        return [_literal(item) for item in value]
    if isinstance(value, dict):
        return {key: _literal(item) for key, item in value.items()}
    return value


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _full_key(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    return str(key) if key else ""


def read_value(text: str) -> Any:
    """A `--set` or environment value: YAML when it reads as a list or mapping, else the string."""
    if not text.lstrip().startswith(("[", "{")):
        return text
    try:
        _measure(text)
        return yaml.safe_load(text)
    except (yaml.YAMLError, _TooBig, RecursionError):
        return text
