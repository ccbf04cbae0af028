"""A reward named in a config: a built-in (``"exact_match"``), a function in an importable module
(``"my_pkg.rewards:score"``) or one in a file (``"path/to/rewards.py:score"``)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from odcfn._check import ArgTypeError
from odcfn.rewards.answer import ExactMatch
from odcfn.rewards.regex import RegexFormat

__all__ = ["BUILTINS", "load_function", "resolve"]

# built-in rewards by the name a config gives them; keyword arguments configure them
BUILTINS: dict[str, Callable[..., Any]] = {"exact_match": ExactMatch, "regex_format": RegexFormat}


def _import_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise ValueError(f"reward {spec!r}: no file {str(path)!r}")
    # a name unique to the file's path, so two rewards.py files in different folders do not
    # replace each other in sys.modules (and pickling by reference can find the module)
    name = f"odcfn_reward_{path.stem}_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    mspec = importlib.util.spec_from_file_location(name, path)
    if mspec is None or mspec.loader is None:
        raise ValueError(f"reward {spec!r}: {str(path)!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[name] = module
    try:
        mspec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_function(spec: str) -> Callable[..., Any]:
    """The callable named by ``spec``: ``"module:attr"`` (``module`` importable, dotted) or
    ``"path/to/file.py:attr"``; ``attr`` may be dotted (``"mod:Class.method"``). A
    ``ValueError`` naming ``spec`` when the module, file or attribute is missing, an
    ``ArgTypeError`` when the attribute is not callable. Errors raised while importing the
    module itself propagate, with their own traceback."""
    if not isinstance(spec, str):
        raise ArgTypeError(f"a function spec must be a str 'module:function', got {type(spec).__name__}")
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"function spec {spec!r} must be 'module:function' or 'path/to/file.py:function'")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _import_file(Path(where).expanduser(), spec)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            # only the named module (or a parent package) missing is the spec's fault; a missing
            # dependency inside an existing module is that module's error, reported as it is
            if e.name is None or not (where == e.name or where.startswith(e.name + ".")):
                raise
            raise ValueError(f"reward {spec!r}: no module named {where!r} ({e})") from e
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = where if i == 0 else f"{where}:{'.'.join(attr.split('.')[:i])}"
            raise ValueError(f"reward {spec!r}: {owner!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ArgTypeError(f"reward {spec!r} names a {type(obj).__name__}, not a function")
    return obj


def resolve(spec: Any, **kwargs: Any) -> Callable[..., Any]:
    """A reward function from ``spec``: a callable is returned as it is; a built-in name from
    ``BUILTINS`` is built with ``kwargs`` (``resolve("regex_format", pattern=r"<answer>.*</answer>")``);
    ``"module:function"`` or ``"path/to/file.py:function"`` is loaded with ``load_function``."""
    if callable(spec) and not isinstance(spec, str):
        if kwargs:
            raise ValueError(
                f"resolve() got options {sorted(kwargs)} for a callable: they configure built-ins only"
            )
        return spec
    if not isinstance(spec, str):
        raise ArgTypeError(
            f"a reward must be a callable or a str naming one, got {type(spec).__name__} {spec!r:.80}"
        )
    if spec in BUILTINS:
        try:
            return BUILTINS[spec](**kwargs)
        except TypeError as e:
            raise ArgTypeError(f"built-in reward {spec!r}: {e}") from e
    if ":" not in spec:
        raise ValueError(
            f"unknown reward {spec!r}: built-ins are {', '.join(BUILTINS)}; name your own as "
            "'module:function' or 'path/to/file.py:function'"
        )
    if kwargs:
        raise ValueError(f"reward {spec!r}: options {sorted(kwargs)} configure built-ins only")
    return load_function(spec)
