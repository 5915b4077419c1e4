"""A stand-in for ``tensorrt`` and ``tensorrt.plugin`` that enforces what TensorRT's Python plugin API checks of the
decorated functions (TensorRT 10.9 ... 11.x, read from its ``tensorrt/plugin/_validate.py`` and ``_lib.py``), so the
plugin definitions are checked on machines where TensorRT cannot be installed. Written here, not copied:

- every decorator reads ``inspect.signature``; annotations are compared as objects (a string annotation, as under
  ``from __future__ import annotations``, is not a class and fails);
- ``register``: tensor parameters (``TensorDesc``) first, then attributes of a serialisable type, no defaults, no
  attribute named outputs, stream or tactic; returns ``TensorDesc`` or ``Tuple[TensorDesc, ...]`` with one entry per
  output;
- ``autotune``: the tensors, attributes in registration order (a subset), then ``outputs``; returns
  ``AutoTuneCombination`` or ``List[AutoTuneCombination]`` if annotated; each combination names a type per input and
  output;
- ``aot_impl``: the tensors, *every* attribute (TensorRT passes them all), ``outputs``, ``tactic``; the return
  annotation ``Tuple[str | bytes, str | bytes, KernelLaunchParams, SymExprs]`` is required; at build time the extra
  arguments are ``SymInt32`` expressions;
- ``impl``: the tensors, attributes (a subset), ``outputs``, ``stream`` [, ``tactic``]; ``Tuple[Tensor]`` outputs,
  ``int`` stream, ``None`` return when annotated.
"""

from __future__ import annotations

import inspect
import types
import typing

SERIALIZABLE = (int, float, bytes, bool, str)
RESERVED = {"outputs", "stream", "tactic"}


class PluginSignatureError(ValueError):
    pass


# ---- symbolic integers -------------------------------------------------------------------------------------------


class SymExpr:
    pass


class SymIntExpr(SymExpr):
    def __init__(self, value=None):
        if isinstance(value, SymIntExpr):
            value = value.value
        self.value = value  # an int, or a str naming a symbolic dimension

    @property
    def is_constant(self) -> bool:
        return isinstance(self.value, int)

    def constant_value(self) -> int:
        if not self.is_constant:
            raise ValueError(f"{self.value} is not constant")
        return self.value

    def _op(self, other, fn, sym):
        o = other.value if isinstance(other, SymIntExpr) else other
        if isinstance(self.value, int) and isinstance(o, int):
            return SymIntExpr(fn(self.value, o))
        return SymIntExpr(f"({self.value} {sym} {o})")

    def __mul__(self, other):
        return self._op(other, lambda a, b: a * b, "*")

    __rmul__ = __mul__

    def __add__(self, other):
        return self._op(other, lambda a, b: a + b, "+")

    __radd__ = __add__

    def __floordiv__(self, other):
        return self._op(other, lambda a, b: a // b, "//")


class SymInt32(SymIntExpr):
    pass


class ShapeExpr(SymInt32):
    pass


def cdiv(a, b) -> ShapeExpr:
    r = SymIntExpr(a)._op(b, lambda x, y: -(-x // y), "cdiv")
    return ShapeExpr(r.value)


class SymExprs:
    def __init__(self, length: int):
        self._exprs = [None] * length

    def __iter__(self):
        return iter(self._exprs)

    def __len__(self):
        return len(self._exprs)

    def __getitem__(self, i):
        return self._exprs[i]


class SymIntExprs(SymExprs):
    @classmethod
    def from_tuple(cls, exprs):
        inst = cls(len(exprs))
        inst._exprs = [e if isinstance(e, SymIntExpr) else SymIntExpr(e) for e in exprs]  # ints: not SymInt32
        return inst


class KernelLaunchParams:
    FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")

    def __init__(self):
        for f in self.FIELDS:
            object.__setattr__(self, f, SymInt32(0 if f == "shared_mem" else 1))

    def __setattr__(self, name, value):
        if name not in self.FIELDS:
            raise AttributeError(f"KernelLaunchParams has no field {name!r}")
        if not isinstance(value, (int, SymIntExpr)):
            raise TypeError(f"{name} must be an int or a symbolic integer, got {type(value).__name__}")
        object.__setattr__(self, name, SymInt32(value))


# ---- tensors and formats -----------------------------------------------------------------------------------------

float16, bfloat16, float32, int32, int64, bool_ = "float16", "bfloat16", "float32", "int32", "int64", "bool"
TYPE_NAMES = {"FP16": float16, "BF16": bfloat16, "FP32": float32, "INT32": int32, "INT64": int64, "BOOL": bool_}


class TensorDesc:
    def __init__(self, shape=(), dtype=float32):
        self.shape_expr = tuple(e if isinstance(e, ShapeExpr) else ShapeExpr(e) for e in shape)
        self.dtype = dtype

    def like(self) -> TensorDesc:
        return TensorDesc(self.shape_expr, self.dtype)


class Tensor:
    pass


class AutoTuneCombination:
    def __init__(self, io_types: str, layouts: str | None = None, tactics=None):
        self.types = [t.strip() for t in io_types.split(",")]
        for entry in self.types:
            for t in entry.replace("*", "|").split("|"):
                if t not in TYPE_NAMES:
                    raise AttributeError(f"unknown TensorRT data type {t!r}")


# ---- the decorators ----------------------------------------------------------------------------------------------

_plugins: dict[str, dict] = {}


def _fail(kind, fn, why):
    raise PluginSignatureError(f"{kind} {fn.__name__}{inspect.signature(fn)}: {why}")


def _is_class(a, base) -> bool:
    return inspect.isclass(a) and issubclass(a, base)


def _is_tuple_of(a, base) -> bool:
    args = typing.get_args(a)
    return typing.get_origin(a) is tuple and bool(args) and all(_is_class(x, base) for x in args)


def _is_str_or_bytes(a) -> bool:
    if a in (str, bytes):
        return True
    return typing.get_origin(a) in (typing.Union, types.UnionType) and set(typing.get_args(a)) <= {str, bytes}


def register(plugin_id: str):
    def deco(fn):
        sig = inspect.signature(fn)
        tensors, attrs, seen_attr = [], {}, False
        for i, (name, p) in enumerate(sig.parameters.items()):
            if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                _fail("register", fn, f"{name} is not a positional-or-keyword argument")
            if p.annotation is p.empty:
                _fail("register", fn, f"{name} has no annotation")
            if p.default is not p.empty:
                _fail("register", fn, f"{name} has a default value")
            if _is_class(p.annotation, TensorDesc):
                if seen_attr:
                    _fail("register", fn, "tensors and attributes are interspersed")
                tensors.append(name)
                continue
            if i == 0:
                _fail("register", fn, "tensor arguments come first")
            if name in RESERVED:
                _fail("register", fn, f"{name!r} is not allowed as an attribute name")
            if p.annotation not in SERIALIZABLE:
                _fail("register", fn, f"attribute {name} of type {p.annotation!r} is not serialisable")
            seen_attr = True
            attrs[name] = p.annotation
        ret = sig.return_annotation
        if _is_class(ret, TensorDesc):
            n_out = 1
        elif _is_tuple_of(ret, TensorDesc):
            n_out = len(typing.get_args(ret))
        else:
            _fail("register", fn, f"returns {ret!r}: only TensorDesc or Tuple[TensorDesc]")
        _plugins[plugin_id] = {"tensors": tensors, "attrs": attrs, "n_out": n_out, "desc": fn}
        return fn
    return deco


def _check_params(kind, fn, plugin_id, trailing, all_attrs, tensor_type, optional_trailing=()):
    if plugin_id not in _plugins:
        _fail(kind, fn, f"{plugin_id} is not registered")
    spec = _plugins[plugin_id]
    sig = inspect.signature(fn)
    names = list(sig.parameters)
    n_t = len(spec["tensors"])
    if names[:n_t] != spec["tensors"]:
        _fail(kind, fn, f"the tensors must be {spec['tensors']}")
    rest = names[n_t:]
    for tail in (list(trailing) + list(optional_trailing), list(trailing)):
        if len(rest) >= len(tail) and rest[len(rest) - len(tail):] == tail:
            given = rest[:len(rest) - len(tail)]
            break
    else:
        _fail(kind, fn, f"must end with {', '.join(trailing)}")
    registered = list(spec["attrs"])
    if all_attrs and given != registered:
        _fail(kind, fn, f"must take every attribute, in order: {registered}")
    if given != [a for a in registered if a in given]:
        _fail(kind, fn, f"attributes out of registration order: {registered}")
    for name in given:
        a = sig.parameters[name].annotation
        if a is not inspect.Parameter.empty and a != spec["attrs"][name]:
            _fail(kind, fn, f"attribute {name} annotated {a!r}, registered {spec['attrs'][name]!r}")
    for name in spec["tensors"]:
        a = sig.parameters[name].annotation
        if a is not inspect.Parameter.empty and not _is_class(a, tensor_type):
            _fail(kind, fn, f"tensor {name} annotated {a!r}, not {tensor_type.__name__}")
    out = sig.parameters["outputs"].annotation
    if out is not inspect.Parameter.empty and not _is_tuple_of(out, tensor_type):
        _fail(kind, fn, f"outputs annotated {out!r}, not Tuple[{tensor_type.__name__}]")
    for name in ("stream", "tactic"):
        if name in sig.parameters:
            a = sig.parameters[name].annotation
            if a is not inspect.Parameter.empty and not _is_class(a, int):
                _fail(kind, fn, f"{name} annotated {a!r}, not int")
    return spec, sig


def autotune(plugin_id: str):
    def deco(fn):
        spec, sig = _check_params("autotune", fn, plugin_id, ("outputs",), False, TensorDesc)
        ret = sig.return_annotation
        if ret is not sig.empty and not (_is_class(ret, AutoTuneCombination) or (
                typing.get_origin(ret) is list and _is_class(typing.get_args(ret)[0], AutoTuneCombination))):
            _fail("autotune", fn, f"returns {ret!r}: only AutoTuneCombination or List[AutoTuneCombination]")
        spec["autotune"] = fn
        return fn
    return deco


def aot_impl(plugin_id: str):
    def deco(fn):
        spec, sig = _check_params("aot_impl", fn, plugin_id, ("outputs", "tactic"), True, TensorDesc)
        ret = sig.return_annotation
        if ret is sig.empty:
            _fail("aot_impl", fn, "no return annotation")
        args = typing.get_args(ret)
        if not (typing.get_origin(ret) is tuple and len(args) == 4 and _is_str_or_bytes(args[0])
                and _is_str_or_bytes(args[1]) and _is_class(args[2], KernelLaunchParams)
                and _is_class(args[3], SymExprs)):
            _fail("aot_impl", fn, f"returns {ret!r}, not Tuple[str | bytes, str | bytes, KernelLaunchParams, "
                                  "SymExprs]")
        spec["aot"] = fn
        return fn
    return deco


def impl(plugin_id: str):
    def deco(fn):
        spec, sig = _check_params("impl", fn, plugin_id, ("outputs", "stream"), False, Tensor, ("tactic",))
        if sig.return_annotation is not sig.empty and sig.return_annotation is not None:
            _fail("impl", fn, f"returns {sig.return_annotation!r}: must be None")
        spec["impl"] = fn
        return fn
    return deco


def build_aot(plugin_id: str, inputs: list[TensorDesc], attrs: dict, tactic: int = 0):
    """What TensorRT does with an AOT plugin at build time: call ``aot_impl`` with every attribute positionally and
    check what it returns."""
    spec = _plugins[plugin_id]
    outputs = (spec["desc"](*inputs, *attrs.values()),)
    name, code, launch, extra = spec["aot"](*inputs, *[attrs[a] for a in spec["attrs"]], outputs, tactic)
    if not isinstance(name, (str, bytes)) or not isinstance(code, (str, bytes)):
        raise TypeError("the kernel name and PTX must be str or bytes")
    if not isinstance(launch, KernelLaunchParams) or not isinstance(extra, SymIntExprs):
        raise TypeError("launch params must be KernelLaunchParams, extra args SymIntExprs")
    for e in extra:
        if not isinstance(e, SymInt32):
            raise TypeError(f"extra args must be SymInt32, got {type(e).__name__}")
    return name, code, launch, extra


def formats(plugin_id: str) -> list[AutoTuneCombination]:
    spec = _plugins[plugin_id]
    combos = spec["autotune"](*[TensorDesc() for _ in spec["tensors"]], (TensorDesc(),) * spec["n_out"])
    for c in combos:
        if len(c.types) not in (1, len(spec["tensors"]) + spec["n_out"]):
            raise AssertionError(f"a combination of {len(c.types)} types for {len(spec['tensors'])} inputs and "
                                 f"{spec['n_out']} outputs")
    return combos


def modules() -> tuple[types.ModuleType, types.ModuleType]:
    """``(tensorrt, tensorrt.plugin)`` stand-ins to put in ``sys.modules``."""
    _plugins.clear()
    plugin = types.ModuleType("tensorrt.plugin")
    for name in ("TensorDesc", "Tensor", "AutoTuneCombination", "KernelLaunchParams", "SymExprs", "SymIntExprs",
                 "SymInt32", "ShapeExpr", "cdiv", "register", "autotune", "aot_impl", "impl"):
        setattr(plugin, name, globals()[name])
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "11.4.0.106"
    trt.plugin = plugin
    for name in ("float16", "bfloat16", "float32", "int32", "int64"):
        setattr(trt, name, globals()[name])
    trt.bool = bool_
    return trt, plugin

