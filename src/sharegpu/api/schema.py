"""Kubernetes structural schemas (apiextensions.k8s.io/v1) from the project's own message types.

A custom resource's schema is generated from the msgspec types that the readers and writers of the
resource use, so the API server validates exactly what the code reads. msgspec writes JSON Schema
2020-12; Kubernetes accepts a structural subset of OpenAPI v3, so the translation:

- inlines every `$ref` (Kubernetes has no references; the project's types are not recursive);
- writes `Optional[X]` (`anyOf: [X, null]`) as X with `nullable: true`;
- gives enums their type (`Literal["a", "b"]` has none in JSON Schema; structural schemas need one);
- writes a fixed-length tuple of one item type as an array with minItems = maxItems;
- writes `int | str` as `x-kubernetes-int-or-string` (a quantity such as `nvidia.com/gpu: 2` or "2");
- writes `dict[str, Any]` as an object that keeps unknown fields (a PodSpec carried as it is);
- drops what Kubernetes does not take or should not do: `title`, `$defs`, empty `required`, and
  `default` (the API server would write defaults into stored objects; the readers apply them).

Anything else that has no structural form (a union of two object types, a tuple of mixed types)
raises `SchemaError`, naming where it is.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sharegpu.core import errors

Json = dict[str, Any]

_TYPE_OF_VALUE: dict[type, str] = {str: "string", bool: "boolean", int: "integer", float: "number"}


class SchemaError(errors.SharegpuError):
    """A type that has no Kubernetes structural schema."""


def structural(kind: Any) -> Json:
    """The structural schema of a msgspec type (a Struct, or any type msgspec can describe)."""
    try:
        generated = msgspec.json.schema(kind)
    except TypeError as exc:
        raise SchemaError(f"{getattr(kind, '__name__', kind)}: {exc}") from None
    definitions: Json = generated.pop("$defs", {})
    return _convert(generated, definitions, "")


def _convert(node: Json, definitions: Json, where: str) -> Json:
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        if name not in definitions:
            raise SchemaError(f"{where or '<root>'}: unknown reference {node['$ref']}")
        merged = {**definitions[name], **{k: v for k, v in node.items() if k != "$ref"}}
        return _convert(merged, definitions, where)
    if "anyOf" in node:
        return _union(node, definitions, where)
    out: Json = {}
    for key, value in node.items():
        if key in ("title", "default", "$defs"):
            continue
        if key == "properties":
            out[key] = {name: _convert(sub, definitions, f"{where}.{name}") for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _convert(value, definitions, f"{where}[]")
        elif key == "items" and value is False:
            continue  # "no items beyond prefixItems": expressed by maxItems below
        elif key == "prefixItems":
            out["items"] = _same_items(value, definitions, where)
        elif key == "required":
            if value:
                out[key] = list(value)
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True  # dict[str, Any]: kept as written
    if "enum" in out and "type" not in out:
        types = {_TYPE_OF_VALUE.get(type(v)) for v in out["enum"]}
        if len(types) != 1 or None in types:
            raise SchemaError(f"{where or '<root>'}: an enum of mixed or unknown types: {out['enum']}")
        out["type"] = types.pop()
    if (
        "type" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
        and not out.get("x-kubernetes-int-or-string")
    ):
        raise SchemaError(f"{where or '<root>'}: no type (structural schemas need one everywhere)")
    return out


def _union(node: Json, definitions: Json, where: str) -> Json:
    options = node["anyOf"]
    real = [o for o in options if o != {"type": "null"}]
    if sorted(o.get("type", "") for o in real) == ["integer", "string"] and all(len(o) == 1 for o in real):
        rest = {k: v for k, v in node.items() if k not in ("anyOf", "title", "default")}
        return {**rest, "x-kubernetes-int-or-string": True, **({"nullable": True} if len(real) != len(options) else {})}
    if len(real) != 1:
        raise SchemaError(f"{where or '<root>'}: a union of {len(real)} types has no structural form")
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    out = _convert({**real[0], **rest}, definitions, where)
    if len(real) != len(options):
        out["nullable"] = True
    return out


def _same_items(items: list[Json], definitions: Json, where: str) -> Json:
    converted = [_convert(i, definitions, f"{where}[{n}]") for n, i in enumerate(items)]
    if any(c != converted[0] for c in converted):
        raise SchemaError(f"{where or '<root>'}: a tuple of mixed item types has no structural form")
    return converted[0]
