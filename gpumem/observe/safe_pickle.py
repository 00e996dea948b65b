"""Loading a pickle someone else wrote, that should hold only data (a PyTorch memory snapshot),
with work proportional to its size whatever it says.

``pickle`` runs code named by the file (GLOBAL/REDUCE...): those opcodes are refused. Even a
data-only pickle can make the unpickler do far more than its size suggests, so the opcodes are
checked first, in one pass that builds nothing (``pickletools.genops`` decodes them):

- a memo index (``LONG_BINPUT 4000000000``: 6 bytes) makes CPython's unpickler allocate and
  zero a memo array that long: indexes must stay below the file's length;
- hashing a tuple walks it, and a tuple shared through the memo can nest 2**k copies of one
  in k steps, so a dict key or set item built that way takes exponential time; a big int or
  a tuple used as a key thousands of times is quadratic (their hashes are not cached): keys
  and set items must be strings, bytes, floats, None, bools or 64-bit ints;
- lengths declared in the file are checked against the bytes that are there (the data is read
  first and unpickled from memory, so a length never allocates more than the file holds).

Nesting depth costs nothing (the unpickler and the check are loops, not recursion). The check
takes about two to three times as long as the unpickling itself.
"""
from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

from gpumem.errors import InvalidInputError, brief

__all__ = ["load_data_pickle"]

# opcodes that refer to Python objects by name, call them, or need a persistent-id hook
_CODE = frozenset({"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ",
                   "NEWOBJ_EX", "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER",
                   "READONLY_BUFFER"})
# what each pushes: a value that hashes in constant time (may be a dict key), or another value
_KEYS = frozenset({"INT", "BININT", "BININT1", "BININT2", "STRING", "BINSTRING",
                   "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "UNICODE",
                   "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "FLOAT", "BINFLOAT",
                   "NONE", "NEWTRUE", "NEWFALSE"})
_OTHERS = frozenset({"EMPTY_LIST", "EMPTY_DICT", "EMPTY_TUPLE", "EMPTY_SET", "BYTEARRAY8"})
_LONGS = frozenset({"LONG", "LONG1", "LONG4"})
_BUILDS = frozenset({"LIST", "TUPLE", "DICT", "FROZENSET"})       # items since MARK -> one
_ADDS = frozenset({"APPENDS", "SETITEMS", "ADDITEMS"})           # items since MARK -> into top
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_NOTHING = frozenset({"PROTO", "FRAME", "STOP"})
# stack entries: _OTHER, _KEY, or the str itself (a key too; kept to name a refused global)
_KEY, _OTHER = object(), object()
_STRINGS = frozenset({"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE",
                      "BINUNICODE", "BINUNICODE8"})
_INT64 = (-(1 << 63), 1 << 64)


class _Refused(Exception):
    pass


def _check_keys(items: list, start: int, step: int, what: str) -> None:
    if any(item is _OTHER for item in items[start::step]):
        raise _Refused(f"holds a {what} that is not a string, bytes, number, bool or None")


def _check(data: bytes) -> None:
    """Raise _Refused (or whatever genops raises on a malformed pickle) unless unpickling
    ``data`` is bounded by its length (see the module docstring)."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    limit = len(data)
    for op, arg, _pos in pickletools.genops(data):
        name = op.name
        if name in _STRINGS:
            stack.append(arg if isinstance(arg, str) else _KEY)
        elif name in _KEYS:
            stack.append(_KEY)
        elif name in _GETS:
            if arg not in memo:
                raise _Refused(f"holds a memo reference ({arg}) to nothing")
            stack.append(memo[arg])
        elif name in _PUTS or name == "MEMOIZE":
            if not stack or (marks and len(stack) == marks[-1]):
                raise _Refused("stores a memo entry with nothing to store")
            index = len(memo) if name == "MEMOIZE" else arg
            if not 0 <= index < limit:
                raise _Refused(f"holds a memo index ({index}) past the file's length")
            memo[index] = stack[-1]
        elif name == "MARK":
            marks.append(len(stack))
        elif name in _ADDS or name in _BUILDS:
            if not marks:
                raise _Refused(f"holds {name} without a MARK")
            base = marks.pop()
            items = stack[base:]
            del stack[base:]
            if name in ("SETITEMS", "DICT"):
                if len(items) % 2:
                    raise _Refused(f"holds {name} with an odd number of items")
                _check_keys(items, 0, 2, "dict key")
            elif name in ("ADDITEMS", "FROZENSET"):
                _check_keys(items, 0, 1, "set item")
            if name in _BUILDS:
                stack.append(_OTHER)
            elif not stack:
                raise _Refused(f"holds {name} with no container")
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3", "APPEND", "SETITEM"):
            n = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "APPEND": 1, "SETITEM": 2}[name]
            floor = marks[-1] if marks else 0
            if len(stack) - floor < n + (name in ("APPEND", "SETITEM")):
                raise _Refused(f"holds {name} on too few values")
            if name == "SETITEM" and stack[-2] is _OTHER:
                raise _Refused("holds a dict key that is not a string, bytes, number, bool or None")
            del stack[len(stack) - n:]
            if name.startswith("TUPLE"):
                stack.append(_OTHER)
        elif name in _LONGS:
            stack.append(_KEY if _INT64[0] <= arg < _INT64[1] else _OTHER)
        elif name in _OTHERS:
            stack.append(_OTHER)
        elif name == "POP":
            if marks and len(stack) == marks[-1]:
                marks.pop()
            elif stack:
                stack.pop()
            else:
                raise _Refused("holds POP on an empty stack")
        elif name == "POP_MARK":
            if not marks:
                raise _Refused("holds POP_MARK without a MARK")
            del stack[marks.pop():]
        elif name == "DUP":
            if not stack:
                raise _Refused("holds DUP on an empty stack")
            stack.append(stack[-1])
        elif name in _CODE:
            if isinstance(arg, str):                    # GLOBAL, INST: "module name"
                what = f"refers to {arg.replace(' ', '.')}"
            elif name == "STACK_GLOBAL" and len(stack) >= 2 and \
                    all(isinstance(v, str) for v in stack[-2:]):
                what = f"refers to {stack[-2]}.{stack[-1]}"
            else:
                what = f"holds code ({name})"
            raise _Refused(f"{what}; a data file holds only dicts, lists, strings and numbers")
        elif name not in _NOTHING:
            raise _Refused(f"holds the opcode {name}")


class _DataOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:   # unreachable after _check
        raise pickle.UnpicklingError(f"refers to {module}.{name}")


def load_data_pickle(data: bytes, name: str, *, what: str = "a data pickle") -> Any:
    """Unpickle ``data`` (the file's bytes) after checking that it holds only data and that
    the unpickling is bounded by its length; InvalidInputError naming ``name`` otherwise."""
    try:
        _check(data)
    except _Refused as exc:
        raise InvalidInputError(f"{name}: not {what}: the pickle {exc}") from None
    except Exception as exc:        # genops on malformed bytes: ValueError, EOFError, ...
        raise InvalidInputError(f"{name}: not {what} (not a readable pickle: "
                                f"{brief(str(exc), 200)})") from None
    try:
        return _DataOnlyUnpickler(io.BytesIO(data)).load()
    except MemoryError:
        raise
    except Exception as exc:        # what the check cannot see (APPEND onto a dict...)
        raise InvalidInputError(f"{name}: not {what} (not a readable pickle: "
                                f"{type(exc).__name__}: {brief(str(exc), 200)})") from None
