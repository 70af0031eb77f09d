"""DRA device selectors: the CEL expressions of DeviceClasses and claim requests, evaluated against a
device of a ResourceSlice as kube-scheduler's allocator evaluates them.

The engine is cel-expr-python (Google's CEL runtime, cel-cpp, with its type checker and the
bindings, strings and optional-types extensions Kubernetes also loads). What Kubernetes adds is
written here, with its semantics (k8s.io/apiserver/pkg/cel/library, read on v0.37.2):

- the variable `device`: `driver`, `attributes` and `capacity` (maps from a domain to the device's
  attributes or capacities of that domain; a name without a domain is in the driver's), and
  `allowMultipleAllocations`. Looking up a domain the device has nothing of gives an empty map, so
  `"x" in device.attributes["other.example.com"]` is false; a missing attribute is an error;
- attribute values: `int`, `bool`, `string`, and `version` as a semantic version;
- the quantity library: `quantity(s)`, `isQuantity(s)`, `sign(q)`, and on a quantity
  `isGreaterThan`, `isLessThan`, `compareTo`, `add`, `sub` (a quantity or an int), `asInteger`,
  `isInteger`, `asApproximateFloat`; `==` compares values (`quantity("1Gi") == quantity("1024Mi")`);
- the semver library: `semver(s[, normalize])`, `isSemver(s[, normalize])`, and on a version
  `major`, `minor`, `patch`, `isGreaterThan`, `isLessThan`, `compareTo`; `==` ignores build
  metadata. Versions are parsed as the Go library Kubernetes uses parses them (semver 2.0.0, strict:
  no leading zeros, no "v"); normalisation drops a "v", fills a missing minor or patch with 0 and
  drops leading zeros.

Kubernetes' other libraries (regex `find`, lists, sets, URLs, IP and CIDR, format) are not loaded: an
expression that calls them does not compile here, and `compile` says which name it does not know.
Quantities are exact decimals (Kubernetes rounds one finer than a nano-unit up; no capacity sharegpu
publishes is that fine).

Outcomes are values: `compile` gives a `Selector` or a `Problem`, `Selector.judge` a `Verdict`
(matches, or the runtime error text, as kube-scheduler words them: a claim whose selector fails on a
device is not allocated by kube-scheduler at all).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Context, Decimal
from typing import Any, Final

from cel_expr_python import cel
from cel_expr_python.ext import ext_bindings, ext_optional, ext_strings
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from sharegpu.api import quantity as api_quantity
from sharegpu.core import errors

_PACKAGE: Final = "kubernetes"
_EXACT: Final = Context(prec=80)
_INT64: Final = 2**63


def _messages() -> tuple[descriptor_pool.DescriptorPool, Any, Any]:
    """The two object types Kubernetes' libraries add, as protobuf messages (how cel-cpp takes a type of
    its own): a quantity (its exact value, normalised, so that `==` compares values) and a version."""
    proto = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="sharegpu_cel.proto", package=_PACKAGE, syntax="proto3")
    quantity = file.message_type.add(name="Quantity")
    quantity.field.add(name="exact", number=1, type=proto.TYPE_STRING, label=proto.LABEL_OPTIONAL)
    version = file.message_type.add(name="Semver")
    for number, name in enumerate(("major", "minor", "patch"), start=1):
        version.field.add(name=name, number=number, type=proto.TYPE_UINT64, label=proto.LABEL_OPTIONAL)
    version.field.add(name="pre", number=4, type=proto.TYPE_STRING, label=proto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    made = (
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{n}")) for n in ("Quantity", "Semver")
    )
    return pool, next(made), next(made)


_POOL, _QuantityMessage, _SemverMessage = _messages()


# ----------------------------------------------------------------- quantities


def quantity_value(text: str) -> Any:
    """A quantity as CEL sees it (InvalidInputError for what is not a quantity)."""
    return _quantity(api_quantity.parse(text))


def _quantity(value: Decimal) -> Any:
    return _QuantityMessage(exact=str(value.normalize(_EXACT)))


def _decimal(message: Any) -> Decimal:
    return Decimal(message.exact or "0")


def _parse_quantity(text: str) -> Any:
    try:
        return quantity_value(text)
    except errors.InvalidInputError as exc:
        raise ValueError(f"quantities must match the regular expression of Kubernetes quantities: {exc}") from None


def _is_quantity(text: str) -> bool:
    try:
        api_quantity.parse(text)
    except errors.InvalidInputError:
        return False
    return True


def _compare(a: Decimal | tuple[Any, ...], b: Decimal | tuple[Any, ...]) -> int:
    return (a > b) - (a < b)  # type: ignore[operator]


def _as_integer(message: Any) -> int:
    value = _decimal(message)
    if value != value.to_integral_value() or not -_INT64 <= value < _INT64:
        raise ValueError("cannot convert value to integer")
    return int(value)


def _is_integer(message: Any) -> bool:
    value = _decimal(message)
    return value == value.to_integral_value() and -_INT64 <= value < _INT64


def _sign(message: Any) -> int:
    value = _decimal(message)
    return (value > 0) - (value < 0)


# ----------------------------------------------------------------- versions

_NUMBER = r"(?:0|[1-9][0-9]*)"
_IDENTIFIER = r"(?:0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)"
_SEMVER = re.compile(
    rf"^({_NUMBER})\.({_NUMBER})\.({_NUMBER})(?:-({_IDENTIFIER}(?:\.{_IDENTIFIER})*))?(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$"
)


def version_value(text: str, normalize: bool = False) -> Any:
    """A semantic version as CEL sees it (ValueError for what is not one), parsed as Kubernetes' Go
    library parses it; `normalize` as `semver(s, true)`."""
    if normalize:
        text = _normalized(text)
    found = _SEMVER.match(text)
    if found is None:
        raise ValueError(f"{text[:64]!r} is not a semantic version (MAJOR.MINOR.PATCH, no leading zeros)")
    major, minor, patch = (int(g) for g in found.groups()[:3])
    return _SemverMessage(major=major, minor=minor, patch=patch, pre=found.group(4) or "")


def _normalized(text: str) -> str:
    parts = text.removeprefix("v").split(".", 2)
    for i, part in enumerate(parts):
        if len(part) > 1:
            kept = part.lstrip("0")
            parts[i] = kept if kept and kept[0].isdigit() else "0" + kept
    if len(parts) < 3:
        if any(c in parts[-1] for c in "+-"):
            raise ValueError("short version cannot contain PreRelease/Build meta data")
        parts += ["0"] * (3 - len(parts))
    return ".".join(parts)


def published_version(text: str) -> str | None:
    """A version as a slice publishes it (a `version` attribute must be strict semver): "12.4" as
    "12.4.0", "535.104.05" as "535.104.5"; None for what normalisation cannot make one."""
    try:
        found = version_value(text, normalize=True)
    except ValueError:
        return None
    pre = f"-{found.pre}" if found.pre else ""
    return f"{found.major}.{found.minor}.{found.patch}{pre}"


def _is_version(text: str, normalize: bool = False) -> bool:
    try:
        version_value(text, normalize)
    except ValueError:
        return False
    return True


def _precedence(message: Any) -> tuple[Any, ...]:
    """A version's place in semver order: a release after its pre-releases; numeric identifiers before
    alphanumeric ones, numbers by value; a shorter list of identifiers first when the rest is equal."""
    pre = message.pre
    rank = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split(".")) if pre else ()
    return (message.major, message.minor, message.patch, 0 if pre else 1, rank)


def _order(a: Any, b: Any) -> int:
    """-1, 0 or 1: two quantities by value, two versions by precedence."""
    if isinstance(a, _QuantityMessage) and isinstance(b, _QuantityMessage):
        return _compare(_decimal(a), _decimal(b))
    if isinstance(a, _SemverMessage) and isinstance(b, _SemverMessage):
        return _compare(_precedence(a), _precedence(b))
    raise ValueError(f"no such overload: {type(a).__name__} and {type(b).__name__} cannot be compared")


# ----------------------------------------------------------------- the environment


def _overload(name: str, result: cel.Type, parameters: list[cel.Type], impl: Any, member: bool = False) -> cel.Overload:
    return cel.Overload(name, result, parameters, is_member=member, impl=impl)


_Q: Final = cel.Type(f"{_PACKAGE}.Quantity")
_V: Final = cel.Type(f"{_PACKAGE}.Semver")


def _ordered(name: str, result: cel.Type, impl: Any) -> list[cel.Overload]:
    return [
        cel.Overload(f"quantity_{name}", result, [_Q, _Q], is_member=True, impl=impl),
        cel.Overload(f"semver_{name}", result, [_V, _V], is_member=True),
    ]


def _declarations() -> list[cel.FunctionDecl]:
    q, v = _Q, _V
    s, b, i, d = cel.Type.STRING, cel.Type.BOOL, cel.Type.INT, cel.Type.DOUBLE

    table: dict[str, list[cel.Overload]] = {
        "quantity": [_overload("string_to_quantity", q, [s], _parse_quantity)],
        "isQuantity": [_overload("is_quantity_string", b, [s], _is_quantity)],
        "sign": [_overload("quantity_sign", i, [q], _sign)],
        "asApproximateFloat": [_overload("quantity_get_float", d, [q], lambda a: float(_decimal(a)), True)],
        "asInteger": [_overload("quantity_get_int", i, [q], _as_integer, True)],
        "isInteger": [_overload("quantity_is_integer", b, [q], _is_integer, True)],
        "add": [
            _overload("quantity_add", q, [q, q], lambda a, c: _quantity(_decimal(a) + _decimal(c)), True),
            _overload("quantity_add_int", q, [q, i], lambda a, c: _quantity(_decimal(a) + c), True),
        ],
        "sub": [
            _overload("quantity_sub", q, [q, q], lambda a, c: _quantity(_decimal(a) - _decimal(c)), True),
            _overload("quantity_sub_int", q, [q, i], lambda a, c: _quantity(_decimal(a) - c), True),
        ],
        "semver": [
            _overload("string_to_semver", v, [s], version_value),
            _overload("string_bool_to_semver", v, [s, b], version_value),
        ],
        "isSemver": [
            _overload("is_semver_string", b, [s], _is_version),
            _overload("is_semver_string_bool", b, [s, b], _is_version),
        ],
        "major": [_overload("semver_major", i, [v], lambda a: a.major, True)],
        "minor": [_overload("semver_minor", i, [v], lambda a: a.minor, True)],
        "patch": [_overload("semver_patch", i, [v], lambda a: a.patch, True)],
        # cel-cpp's runtime dispatches on the kind of a value, and both types are messages: each name has
        # one implementation (on the quantity overload), which compares two quantities or two versions.
        "isGreaterThan": _ordered("is_greater_than", b, lambda a, c: _order(a, c) == 1),
        "isLessThan": _ordered("is_less_than", b, lambda a, c: _order(a, c) == -1),
        "compareTo": _ordered("compare_to", i, _order),
    }
    return [cel.FunctionDecl(name, overloads) for name, overloads in table.items()]


_ENV: Final = cel.NewEnv(
    _POOL,
    variables={"device": cel.Type.Map(cel.Type.STRING, cel.Type.DYN)},
    functions=_declarations(),
    extensions=[ext_bindings.ExtBindings(), ext_strings.ExtStrings(), ext_optional.ExtOptional()],
)


# ----------------------------------------------------------------- devices


@dataclass(frozen=True, slots=True)
class Device:
    """One device of a ResourceSlice, as a selector sees it (`of` reads the slice's device)."""

    driver: str
    attributes: Mapping[str, Mapping[str, Any]]
    """Per domain, the device's attributes of that domain, as CEL values."""
    capacity: Mapping[str, Mapping[str, Any]]
    allow_multiple: bool = False
    _variable: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, driver: str, device: Mapping[str, Any]) -> Device:
        """A slice's device (`spec.devices[]`, as the API serves it) of `driver`. InvalidInputError
        for an attribute without a value of a type Kubernetes defines."""
        attributes: dict[str, dict[str, Any]] = {}
        for name, attribute in (device.get("attributes") or {}).items():
            domain, key = _qualified(name, driver)
            attributes.setdefault(domain, {})[key] = _attribute(name, attribute)
        capacity: dict[str, dict[str, Any]] = {}
        for name, held in (device.get("capacity") or {}).items():
            domain, key = _qualified(name, driver)
            capacity.setdefault(domain, {})[key] = quantity_value(str(held.get("value", "0")))
        return cls(driver, attributes, capacity, bool(device.get("allowMultipleAllocations", False)))

    def value_of(self, qualified: str) -> Any:
        """The value of the attribute `domain/name` (None: the device has none), as CEL sees it."""
        domain, _, name = qualified.partition("/")
        return self.attributes.get(domain, {}).get(name)

    def variable(self, domains: frozenset[str]) -> dict[str, Any]:
        """The `device` variable, with an empty map for each of `domains` the device has nothing of."""
        found = self._variable.get("")
        if found is None:
            found = {
                "driver": self.driver,
                "attributes": dict(self.attributes),
                "capacity": dict(self.capacity),
                "allowMultipleAllocations": self.allow_multiple,
            }
            self._variable[""] = found
        missing = [d for d in domains if d not in self.attributes or d not in self.capacity]
        if not missing:
            return found
        attributes, capacity = dict(found["attributes"]), dict(found["capacity"])
        for domain in missing:
            attributes.setdefault(domain, {})
            capacity.setdefault(domain, {})
        return {**found, "attributes": attributes, "capacity": capacity}


def _qualified(name: str, driver: str) -> tuple[str, str]:
    domain, slash, key = name.partition("/")
    return (domain, key) if slash else (driver, name)


def _attribute(name: str, attribute: Mapping[str, Any]) -> Any:
    if "int" in attribute:
        return int(attribute["int"])
    if "bool" in attribute:
        return bool(attribute["bool"])
    if "string" in attribute:
        return str(attribute["string"])
    if "version" in attribute:
        try:
            return version_value(str(attribute["version"]))
        except ValueError as exc:
            raise errors.InvalidInputError(f"attribute {name}: parse semantic version: {exc}") from None
    raise errors.InvalidInputError(f"attribute {name}: unsupported attribute value")


# ----------------------------------------------------------------- selectors


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one selector says of one device: it matches or not, or it failed (`error`)."""

    matches: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class Problem:
    """Why an expression does not compile here."""

    expression: str
    message: str


_LITERAL = re.compile(r"'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"")


@dataclass(frozen=True, slots=True)
class Selector:
    """A compiled CEL selector."""

    expression: str
    program: Any = field(compare=False, repr=False)
    domains: frozenset[str] = frozenset()
    """The string literals of the expression: the domains it may look up (the device's variable gets an
    empty map for each it has nothing of, as Kubernetes' lookup gives one)."""

    def judge(self, device: Device) -> Verdict:
        try:
            result = self.program.eval(data={"device": device.variable(self.domains)})
        except RuntimeError as exc:  # cel-cpp's status, where it raises rather than returning an error value
            return Verdict(False, str(exc))
        value = result.value()
        kind = result.type()
        if kind == cel.Type.ERROR:
            return Verdict(False, str(value))
        if kind != cel.Type.BOOL:
            return Verdict(False, f"CEL result of type {kind.name()} could not be converted to bool")
        return Verdict(bool(value))


@functools.lru_cache(maxsize=4096)
def compile_selector(expression: str) -> Selector | Problem:
    """`expression` compiled against the device environment, or why it does not compile here."""
    try:
        program = _ENV.compile(expression)
    except RuntimeError as exc:  # cel-cpp's status text: a syntax error, an undeclared reference...
        return Problem(expression, _compile_message(str(exc)))
    kind = program.return_type()
    if kind not in (cel.Type.BOOL, cel.Type.DYN):
        return Problem(expression, f"must evaluate to bool, not {kind.name().lower()}")
    domains = frozenset(a or b for a, b in _LITERAL.findall(expression))
    return Selector(expression, program, domains)


def _compile_message(text: str) -> str:
    text = text.removeprefix("INVALID_ARGUMENT: ")
    text = re.sub(r"\s*\[INVALID_ARGUMENT\]\s*$", "", text)
    return " ".join(text.split())
