"""The registry of strategies: `@register(name)`, the discovery of the package's algorithms
(`_load_builtin`), and the look-ups by name (`get_strategy`, `strategy_names`,
`strategy_params`)."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import sys

from ._base import Strategy
from ._types import StrategyError



_REGISTRY: dict[str, type] = {}
# strategies that wrap another one and are not chosen by name in a config (an attack is the
# run config's `attack:` section), but a client must rebuild them from an announcement
_WRAPPER_MODULES = ("edgefl.attacks",)
_DISCOVERED = False


def _load_builtin() -> None:
    """Import every algorithm of this package once, so its `@register` has run.

    The rule: every module and subpackage of edgefl.strategies is an algorithm, except
    - names starting with "_" (Python's mark of a private module: the package's own
      machinery, `_types`, `_base`, this `_registry`, ..., lives in such modules), and
    - modules that say `HELPER = True` at module level: shared code the algorithms import
      (robust.py). They are imported too (that is harmless) but need not register.
    So adding an algorithm is dropping one file (or package) here; there is no list to keep.
    A module that is neither a helper nor registers a strategy is an error, not silence: a
    forgotten `@register` would otherwise surface later as "unknown strategy". The helper
    mark is a flag, not a leading underscore, because helpers such as `robust` are public
    API that tests and other modules import by name.
    """
    global _DISCOVERED
    if _DISCOVERED:
        return
    # the package's path is read at each discovery, not once at import: a test adds a
    # directory to it to stand in for files dropped into the package
    package = sys.modules[__package__]
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if getattr(module, "HELPER", False):
            continue
        if not any(cls.__module__ == module.__name__
                   or cls.__module__.startswith(module.__name__ + ".")
                   for cls in _REGISTRY.values()):
            raise StrategyError(f"{module.__name__} registers no strategy: decorate its "
                                f"Strategy class with @register(name), or mark the module "
                                f"HELPER = True if it only holds shared code")
    for module in _WRAPPER_MODULES:
        importlib.import_module(module)
    _DISCOVERED = True      # set last: a failed import is retried (and raises) next time


def register(name: str):
    """Class decorator: make a Strategy subclass available as get_strategy(name)."""
    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise TypeError(f"register({name!r}): {cls!r} is not a Strategy subclass")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise StrategyError(f"strategy {name!r} is registered twice "
                                f"({_REGISTRY[name].__module__} and {cls.__module__})")
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise TypeError(f"register({name!r}): {cls.__name__} must be a frozen dataclass")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def strategy_names() -> list:
    """The algorithms a config may name (not the wrappers: `Strategy.listed`)."""
    _load_builtin()
    return sorted(name for name, cls in _REGISTRY.items() if cls.listed)


def strategy_params(name: str, *, extensions: bool = False) -> dict:
    """{parameter: default} of strategy `name`; with extensions=True also its extension
    fields (`extension_field`, e.g. `robust`)."""
    cls = _lookup(name)
    return {f.name: f.default for f in dataclasses.fields(cls)
            if extensions or not f.metadata.get("extension")}


def get_strategy(name: str, **params) -> Strategy:
    """The strategy `name` with its hyper-parameters. An unknown name or parameter raises
    StrategyError listing the valid ones; a bad value raises naming the parameter."""
    cls = _lookup(name)
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in params:
        if key not in valid:
            raise StrategyError(f"strategy {name!r}: unknown parameter {key!r}; valid: "
                                f"{', '.join(valid) or '(none)'}")
    return cls(**params)


def _lookup(name: str) -> type:
    _load_builtin()
    if name not in _REGISTRY:
        raise StrategyError(f"unknown strategy {name!r}; valid: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]
