"""Methods, data stages, datasets and partitions from the user's own modules.

A plugin is a Python module whose import registers things through the
registries the package itself uses (``register_method``,
``register_stage``, ``register_dataset``, ``data.protocol.PARTITIONS``), so
nothing in the package has to change.  Two ways to load one:

* a config's top-level ``plugins: [my_module, pkg.other]``: module names
  importable from the current directory, ``PYTHONPATH`` or an installed
  package, imported before the config's names are looked up
  (``config.validate``);
* an installed distribution's entry points in the group ``rayfed_dg.plugins``
  (``[project.entry-points."rayfed_dg.plugins"] my_methods = "my_pkg.methods"``:
  each names a module, whose import registers), imported once per process,
  the first time a config is validated.

Ray worker processes build the method from the config they are sent, not
from the YAML, so they must import the same modules: a pickled
``ExperimentConfig`` carries the plugins imported in the process that sent
it, with the folder each was found in (``pickled_plugins``), and unpickling
imports them first (``restore_plugins``).  A module the driver imported from
a folder the workers' ``sys.path`` lacks (a notebook's ``sys.path.insert``)
is found there too.

Nothing here imports torch or Ray; a name that does not import is one
``ConfigError`` line naming it.  That includes a method written for the
first hook contract: ``register_method`` refuses it at import, saying what
to change (``methods/base.py``, "Contract v1").
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from .errors import ConfigError

ENTRY_POINT_GROUP = "rayfed_dg.plugins"

# module name -> the sys.path folder it was imported from (None: a built-in or frozen module), in import order
_LOADED: dict[str, str | None] = {}
_ENTRY_POINTS_DONE = False


def _root_of(name: str) -> str | None:
    """The folder on ``sys.path`` that holds module ``name``'s top-level package."""
    top = sys.modules.get(name.split(".")[0])
    if top is None:
        return None
    where = getattr(top, "__file__", None)
    if where is not None:
        p = Path(where).resolve()
        return str(p.parent.parent if p.name == "__init__.py" else p.parent)
    paths = list(getattr(top, "__path__", []) or [])  # a namespace package
    return str(Path(paths[0]).resolve().parent) if paths else None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _import(name: str, what: str) -> None:
    if name in _LOADED:
        return
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise ConfigError(f"{what}: no module named {e.name!r} (a plugin is a module importable from the current "
                              f"directory, PYTHONPATH or an installed package; cwd is {os.getcwd()})") from None
        raise ConfigError(f"{what}: its import failed: {_first_line(e)}") from e
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from e
    except Exception as e:  # the plugin's own error (a syntax error, a name registered twice): one line, chained
        raise ConfigError(f"{what}: its import failed: {_first_line(e)}") from e
    _LOADED[name] = _root_of(name)


def load_entry_points() -> None:
    """Import every installed ``rayfed_dg.plugins`` entry point (once per process)."""
    global _ENTRY_POINTS_DONE
    if _ENTRY_POINTS_DONE:
        return
    from importlib.metadata import entry_points

    _ENTRY_POINTS_DONE = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep.dist, "name", None)
        what = f"plugin entry point {ep.name} = {ep.value!r}" + (f" (package {dist})" if dist else "")
        if ep.attr:  # a worker re-imports plugins by module name, so a registering function would not run there
            raise ConfigError(f"{what}: name a module (its import registers), not {ep.attr!r} inside it")
        _import(ep.module, what)


def import_plugins(names: list[str] | tuple[str, ...], source: str = "<config>") -> None:
    """The installed entry points, then each of ``names`` (a config's
    ``plugins:``), importable from the current directory as well: the
    ``rayfed-dg`` script, unlike ``python -m``, does not put it on
    ``sys.path``, and Ray workers get it on theirs."""
    load_entry_points()
    if not names:
        return
    cwd = os.getcwd()
    # for these imports only, and last: a plugin never shadows an installed module, and a later cwd is not
    # searched after this one
    extra = cwd not in sys.path and "" not in sys.path
    if extra:
        sys.path.append(cwd)
    try:
        for name in names:
            _import(name, f"{source}: plugins: {name}")
    finally:
        if extra and cwd in sys.path:
            sys.path.remove(cwd)


def loaded_plugins() -> list[str]:
    """The plugin modules imported in this process, in import order."""
    return list(_LOADED)


def pickled_plugins() -> tuple[tuple[str, str | None], ...]:
    """(module, folder) of every plugin imported here: what a pickled config
    carries to the process that unpickles it."""
    return tuple(_LOADED.items())


def restore_plugins(plugins: tuple[tuple[str, str | None], ...]) -> None:
    """In a process unpickling a config (a Ray worker): import the sender's
    plugins, adding the folder each came from to ``sys.path`` if needed."""
    for name, folder in plugins:
        if name in _LOADED or name in sys.modules:
            _LOADED.setdefault(name, folder)
            continue
        if folder is not None and folder not in sys.path:
            sys.path.append(folder)
        _import(name, f"plugins: {name} (imported in a process that received the config)")
