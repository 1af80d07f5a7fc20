"""Values as plain data: what crosses between the sandboxed program and the trusted judge.

A function's arguments and return value travel as JSON with type tags, and the decoder builds only
Python's own built-in types (``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``,
``list``, ``tuple``, ``dict``, ``set``, ``frozenset``) plus ``Opaque`` for anything else. So whatever
the program returns, the judge compares values it built itself: an object whose ``__eq__`` always
says yes arrives as an ``Opaque`` that equals nothing but itself.

    encode(value) -> JSON-able         decode(obj) -> value (raises PlainDataError on bad input)

This file is also the sandbox side's encoder (``judge.py`` sends its source into the sandbox):
keep it standard-library only and self-contained.
"""
import math

MAX_DEPTH = 100
_BIG = 10 ** 4000  # larger ints travel as hex (JSON parsers refuse > 4300 digits)


class PlainDataError(ValueError):
    """A message that is not plain data of the form ``encode`` writes."""


class Opaque:
    """A value of a type plain data cannot carry (a generator, an object): equal only to itself,
    true, shown as its type and ``repr`` (cut)."""

    def __init__(self, type_name, text):
        self.type_name, self.text = str(type_name)[:100], str(text)[:200]

    def __repr__(self):
        return f"<{self.type_name}: {self.text}>"

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)


def _float(x):
    if math.isfinite(x):
        return x
    return {"$": "float", "v": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def encode(x, depth=0):
    """``x`` as JSON-able plain data. Subclasses of the built-in types travel as their base type
    (a ``namedtuple`` as a tuple, a ``defaultdict`` as a dict); values with ``item()`` (NumPy
    scalars) as that; anything else as an opaque type name and ``repr``."""
    if depth > MAX_DEPTH:
        raise PlainDataError(f"a value nested over {MAX_DEPTH} levels deep")
    d = depth + 1
    if x is None or x is True or x is False:
        return x
    if isinstance(x, int):
        x = int.__index__(x)
        return x if -_BIG < x < _BIG else {"$": "int", "v": format(x, "x")}
    if isinstance(x, float):
        return _float(float.__float__(x))
    if isinstance(x, str):
        return str.__str__(x)
    if isinstance(x, complex):
        return {"$": "complex", "v": [_float(x.real), _float(x.imag)]}
    if isinstance(x, (bytes, bytearray)):
        return {"$": "bytes", "v": bytes(x).hex()}
    if isinstance(x, list):
        return [encode(v, d) for v in list.__iter__(x)]
    if isinstance(x, tuple):
        return {"$": "tuple", "v": [encode(v, d) for v in tuple.__iter__(x)]}
    if isinstance(x, dict):
        return {"$": "dict", "v": [[encode(k, d), encode(v, d)] for k, v in dict.items(x)]}
    if isinstance(x, (set, frozenset)):
        return {"$": "frozenset" if isinstance(x, frozenset) else "set", "v": [encode(v, d) for v in x]}
    item = getattr(type(x), "item", None)
    if callable(item):
        try:
            v = x.item()
        except Exception:
            v = x
        if v is not x and isinstance(v, (bool, int, float, complex, str, bytes)):
            return encode(v, d)
    try:
        text = repr(x)
    except Exception:
        text = "?"
    return {"$": "opaque", "type": type(x).__name__, "v": text[:200]}


def _float_of(v):
    if type(v) in (int, float):
        return float(v)
    if v in ("nan", "inf", "-inf"):
        return float(v)
    raise PlainDataError(f"not a float: {str(v)[:50]!r}")


def _hashable(v):
    try:
        hash(v)
    except TypeError:
        raise PlainDataError(f"an unhashable {type(v).__name__} as a set member or dict key") from None
    return v


def decode(obj, depth=0):
    """The value ``obj`` (parsed JSON) stands for, built of built-in types only."""
    if depth > MAX_DEPTH:
        raise PlainDataError(f"a value nested over {MAX_DEPTH} levels deep")
    d = depth + 1
    t = type(obj)
    if obj is None or t in (bool, int, float, str):
        return obj
    if t is list:
        return [decode(v, d) for v in obj]
    if t is not dict or not isinstance(obj.get("$"), str):
        raise PlainDataError(f"not plain data: a {t.__name__}")
    tag, v = obj["$"], obj.get("v")
    if tag == "float":
        return _float_of(v)
    if tag == "int" and type(v) is str and len(v) <= 20000:
        try:
            return int(v, 16)
        except ValueError:
            raise PlainDataError("a malformed big int") from None
    if tag == "complex" and type(v) is list and len(v) == 2:
        parts = [decode(p, d) for p in v]
        if all(type(p) in (int, float) for p in parts):
            return complex(*parts)
    if tag == "bytes" and type(v) is str:
        try:
            return bytes.fromhex(v)
        except ValueError:
            raise PlainDataError("malformed bytes") from None
    if tag == "opaque":
        return Opaque(obj.get("type", "object"), v)
    if type(v) is not list:
        raise PlainDataError(f"tag {tag[:20]!r} without a list of values")
    if tag == "tuple":
        return tuple(decode(x, d) for x in v)
    if tag in ("set", "frozenset"):
        items = (_hashable(decode(x, d)) for x in v)
        return set(items) if tag == "set" else frozenset(items)
    if tag == "dict":
        out = {}
        for pair in v:
            if type(pair) is not list or len(pair) != 2:
                raise PlainDataError("a dict entry that is not a [key, value] pair")
            out[_hashable(decode(pair[0], d))] = decode(pair[1], d)
        return out
    raise PlainDataError(f"unknown tag {tag[:20]!r}")
