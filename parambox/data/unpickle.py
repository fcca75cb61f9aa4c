"""Restricted unpickling for the pickled data-set files users hand us (mnist.pkl.gz, CIFAR batches).

A plain ``pickle.load`` on a user's file runs whatever callables the file names. These files only
need numpy's array reconstruction, so every global outside that short list is refused.
Plain containers (list, dict, tuple, str, bytes, numbers) are built by opcodes, not by
``find_class``, so they need no allow-list entry.
"""

from __future__ import annotations

import codecs
import gzip
import io
import pickle
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from parambox.errors import UserError


def _numpy_callables() -> dict[str, Any]:
    # Ask numpy for its own reconstruction functions instead of importing them by path: numpy 2
    # moved numpy.core to numpy._core and warns on the old name, but old pickles still spell it.
    reconstruct = np.ndarray((0,), np.uint8).__reduce__()[0]
    scalar = np.float32(0).__reduce__()[0]
    frombuffer = np.arange(2, dtype=np.uint8).__reduce_ex__(5)[0]
    return {"_reconstruct": reconstruct, "scalar": scalar, "_frombuffer": frombuffer}


_NUMPY = _numpy_callables()

# (module, name) as written in the pickle -> the object it may resolve to.
ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    # Python 3 pickles bytes at protocol <= 2 as _codecs.encode(str, "latin1").
    ("_codecs", "encode"): codecs.encode,
}
for _module in ("numpy.core.multiarray", "numpy._core.multiarray"):
    ALLOWED[(_module, "_reconstruct")] = _NUMPY["_reconstruct"]
    ALLOWED[(_module, "scalar")] = _NUMPY["scalar"]
for _module in ("numpy.core.numeric", "numpy._core.numeric"):
    ALLOWED[(_module, "_frombuffer")] = _NUMPY["_frombuffer"]


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds numpy arrays and plain containers, and refuses every other global.

    >>> import io, pickle
    >>> RestrictedUnpickler(io.BytesIO(pickle.dumps([1, 2])), source="x.pkl").load()
    [1, 2]
    """

    def __init__(self, file: io.BufferedIOBase, source: str | Path, encoding: str = "latin1"):
        super().__init__(file, encoding=encoding)
        self.source = str(source)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise UserError(
                f"{self.source}: refusing to unpickle {module}.{name} (only numpy arrays and plain "
                "containers are allowed in a data file)"
            ) from None


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected a pickle file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    # Decide by content, not by name: a renamed .gz file still loads.
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise UserError(f"{path}: corrupt gzip data ({e})") from None
    return raw


def load_restricted(path: str | Path, encoding: str = "latin1") -> Any:
    """Unpickle ``path`` (gzip-compressed or not) allowing only numpy arrays and plain containers.

    ``encoding`` decodes Python 2 ``str`` objects; ``latin1`` is what numpy arrays pickled by
    Python 2 need. Every failure is a ``UserError`` that names the file.
    """
    path = Path(path)
    raw = _read_bytes(path)
    try:
        return RestrictedUnpickler(io.BytesIO(raw), source=path, encoding=encoding).load()
    except UserError:
        raise
    except Exception as e:  # a truncated or garbled pickle raises almost anything
        raise UserError(f"{path}: not a valid pickle file ({type(e).__name__}: {e})") from None
