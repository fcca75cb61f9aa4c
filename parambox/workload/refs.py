"""References: how a user's function reaches worker processes without pickle.

A reference is a string naming a callable: ``package.module:function`` (importable, also from the
current directory) or ``path/to/file.py:function``. :func:`reference_of` turns a callable into one
(``module:qualname``; for a function of the main script, ``/abs/path/script.py:qualname``), and
:func:`resolve` turns one back into the callable in any process.

A worker imports the main script the way ``multiprocessing``'s spawn start method does
(``multiprocessing/spawn.py``: ``_fixup_main_from_path``): it runs the file with
``__name__ == "__mp_main__"``, so its ``if __name__ == "__main__":`` block does not run, and makes the
result ``sys.modules["__main__"]`` too. The launching process names the script in
``PARAMBOX_MAIN_SCRIPT``.

>>> reference_of(reference_of)
'parambox.workload.refs:reference_of'
>>> resolve("parambox.workload.refs:reference_of", "model") is reference_of
True
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import runpy
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parambox.errors import UserError

MAIN_SCRIPT_ENV = "PARAMBOX_MAIN_SCRIPT"  # the launching script, imported by workers as __mp_main__
IN_PROCESS = "<in-process>"  # the module part of a callable no other process can import

_importing_main = False  # True while a worker runs the main script's body


def is_reference(text: str) -> bool:
    """A reference has a ``:`` before the function's name; a zoo or registry name has none."""
    return ":" in text


def describe(fn: Any) -> str:
    """A callable's name for messages: ``make_model``, ``MyModel``, ``<lambda>``."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def reference_of(fn: Callable[..., Any], what: str = "function") -> str:
    """The reference another process resolves to ``fn``; a ``UserError`` when there is none (a lambda,
    a closure, a function defined in a notebook or an interactive session)."""
    qualname = getattr(fn, "__qualname__", None)
    module_name = getattr(fn, "__module__", None)
    if not qualname or not module_name:
        raise UserError(
            f"{what} {describe(fn)!r} is a {type(fn).__name__}, not a function or class: worker processes "
            "import functions by name; define a module-level function (or use workers=1)"
        )
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise UserError(
            f"{what} {qualname!r} is a lambda or a function defined inside another function: it cannot "
            "reach worker processes; define it at module level (or use workers=1)"
        )
    module = sys.modules.get(module_name)
    if module_name in ("__main__", "__mp_main__") or _is_file_module(module):
        path = getattr(module, "__file__", None)
        if not path or not Path(path).is_file():
            raise UserError(
                f"{what} {qualname!r} is defined in a notebook or an interactive session: it cannot reach "
                "worker processes; put it in a .py file and import it (or use workers=1)"
            )
        return f"{Path(path).resolve()}:{qualname}"
    return f"{module_name}:{qualname}"


def in_process_reference(fn: Any) -> str:
    """What config.json records for a callable that has no reference (a lambda run in-process)."""
    return f"{IN_PROCESS}:{describe(fn)}"


def resolve(ref: str, what: str = "function") -> Callable[..., Any]:
    """The callable ``ref`` names; a one-line ``UserError`` naming ``ref`` when it cannot be imported or
    is not callable."""
    target, sep, qualname = ref.rpartition(":")
    if not sep or not target or not qualname:
        raise UserError(f"{what} {ref!r}: expected module:function or path/to/file.py:function")
    if target == IN_PROCESS:
        raise UserError(
            f"{what} {ref!r} was a function of the process that started the run; it cannot be imported here"
        )
    module = _import_file(target, ref, what) if _is_path(target) else _import_module(target, ref, what)
    obj: Any = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UserError(f"{what} {ref!r}: {target} has no {qualname!r}") from None
    if not callable(obj):
        raise UserError(f"{what} {ref!r} is a {type(obj).__name__}, not callable")
    return obj


def absolute(ref: str) -> str:
    """``ref`` with a file path made absolute (what config.json records, so that ``parambox export``
    finds the file from any directory); module references are left as they are."""
    target, sep, qualname = ref.rpartition(":")
    if sep and target != IN_PROCESS and _is_path(target):
        return f"{Path(target).expanduser().resolve()}:{qualname}"
    return ref


def importing_main() -> bool:
    """True while this process (a worker) runs the main script's body."""
    return _importing_main


def _is_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _is_file_module(module: types.ModuleType | None) -> bool:
    # Modules this file imported by path: no other process can import them by name.
    return module is not None and module.__name__.startswith("parambox_file_")


def _import_module(name: str, ref: str, what: str) -> types.ModuleType:
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # "importable from the current directory too"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):
            raise UserError(f"{what} {ref!r}: no module named {e.name!r}") from None
        raise UserError(f"{what} {ref!r}: importing {name} failed: {e}") from e
    except (Exception, SystemExit) as e:  # a module's sys.exit() on import is a failure, not the run's end
        raise UserError(f"{what} {ref!r}: importing {name} {raised(e)}") from e


def _import_file(target: str, ref: str, what: str) -> types.ModuleType:
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise UserError(f"{what} {ref!r}: file {path} does not exist")
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if main_file and Path(main_file).resolve() == path:
        return main  # the script that is running is the one named: use it as it is
    if os.environ.get(MAIN_SCRIPT_ENV) and Path(os.environ[MAIN_SCRIPT_ENV]).resolve() == path:
        return _import_main_script(path, ref, what)
    name = f"parambox_file_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # its sibling modules import, as when it runs as a script
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise UserError(f"{what} {ref!r}: importing {path} {raised(e)}") from e
    return module


def _import_main_script(path: Path, ref: str, what: str) -> types.ModuleType:
    """Run the launching script as ``__mp_main__`` (once), as multiprocessing's spawn does."""
    global _importing_main
    if getattr(sys.modules.get("__mp_main__"), "__file__", None) == str(path):
        return sys.modules["__mp_main__"]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    module = types.ModuleType("__mp_main__")
    _importing_main = True
    try:
        module.__dict__.update(runpy.run_path(str(path), run_name="__mp_main__"))
    except (Exception, SystemExit) as e:
        raise UserError(f"{what} {ref!r}: importing {path} {raised(e)}") from e
    finally:
        _importing_main = False
    module.__file__ = str(path)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    return module


def raised(e: BaseException) -> str:
    """What a user's code did: ``raised ValueError: ...``, or ``called sys.exit(0)``.

    >>> raised(SystemExit(3)), raised(KeyError("k"))
    ('called sys.exit(3)', "raised KeyError: 'k'")
    """
    if isinstance(e, SystemExit):
        return f"called sys.exit({'' if e.code is None else repr(e.code)})"
    return f"raised {_one_line(e)}"


def exit_site(e: SystemExit) -> str:
    """The user's function a ``SystemExit`` came from: the innermost frame of its traceback outside
    parambox, torch and the standard library, as ``make_model (/path/m.py:12)``."""
    import sysconfig
    import traceback

    ours = (str(Path(__file__).parents[1]) + os.sep, torch_dir() + os.sep)
    stdlib = sysconfig.get_paths()["stdlib"] + os.sep

    def users(name: str) -> bool:
        if name.startswith(("<", *ours)):
            return False
        return not name.startswith(stdlib) or "-packages" in name  # site- or dist-packages: a user's library

    frames = [f for f in traceback.extract_tb(e.__traceback__) if users(f.filename)]
    if not frames:
        return "a user's function"
    f = frames[-1]
    return f"{f.name} ({f.filename}:{f.lineno})"


def torch_dir() -> str:
    spec = importlib.util.find_spec("torch")
    return str(Path(spec.origin).parent) if spec and spec.origin else "/nonexistent-torch"


def _one_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
