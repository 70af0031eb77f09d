"""Docstrings and docs name what is there: every name a docstring of the package quotes in backticks
(`name`, `module.name`, `name()`) is found in the package's code (an identifier, a module, a word of
a string constant or of a .proto file), as written or in snake case (`reservedFor` is the field
`reserved_for`), so a rename that leaves a docstring naming the old name fails here. A few names of
other programs that the code never spells are listed with where they come from. The same for the
dotted names that docs/ and the README quote under one of the package's subpackages
(`extender.cache.ClusterCache`), which may also be the chart's values (`agent.healthPort`)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import sharegpu

PACKAGE = Path(sharegpu.__file__).resolve().parent
QUOTED = re.compile(r"`([A-Za-z_][\w.]*)(?:\(\))?`")
WORD = re.compile(r"[A-Za-z_]\w*")
OUTSIDE = {
    "control_privileged": "the MPS control daemon's privileged socket, in its pipe directory",
    "systemd": "a kubelet cgroup driver",
    "increase": "a PromQL function",
    "deviceSplitCount": "HAMi's device-plugin option",
    "ImageStatus": "a method of CRI's ImageService",
    "ignoredResources": "an argument of kube-scheduler's NodeResourcesFit",
    "transformations": "a field of Kueue's Configuration",
}


def docstrings(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, text) of each docstring: of the module, classes and functions, and of attributes (a
    string expression standing alone)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value


def spelled(tree: ast.Module) -> set[str]:
    """What the code itself spells: identifiers, and the words of string constants that are not
    docstrings."""
    docs = {
        id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        match node:
            case ast.Constant(value=str(text)) if id(node) not in docs:
                found.update(WORD.findall(text))
            case ast.Name(id=name) | ast.Attribute(attr=name) | ast.arg(arg=name):
                found.add(name)
            case ast.FunctionDef(name=name) | ast.AsyncFunctionDef(name=name) | ast.ClassDef(name=name):
                found.add(name)
            case ast.keyword(arg=str(name)):
                found.add(name)
            case ast.alias(name=name, asname=asname):
                found.update({name.rpartition(".")[2], asname or ""})
    return found


def snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def unknown(sources: dict[str, str], extra: frozenset[str] = frozenset()) -> list[str]:
    """'path:line: `name`' for each quoted name found nowhere in `sources` (path -> Python text)
    nor in `extra`."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    known = set(extra) | set(OUTSIDE)
    for path, tree in trees.items():
        known |= spelled(tree)
        known.update(Path(path).with_suffix("").parts)
    out = []
    for path, tree in trees.items():
        for line, text in docstrings(tree):
            for name in QUOTED.findall(text):
                last = name.rpartition(".")[2]
                if not {last, snake(last), last.removesuffix("_total")} & known:
                    out.append(f"{path}:{line}: `{name}`")
    return out


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE.parent)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_name_a_docstring_quotes_is_in_the_code() -> None:
    protos = frozenset(word for p in PACKAGE.rglob("*.proto") for word in WORD.findall(p.read_text()))
    assert unknown(package_sources(), protos) == []


def test_every_package_name_the_docs_quote_is_in_the_code_or_the_chart() -> None:
    root = PACKAGE.parent.parent
    chart = root / "deploy" / "helm" / "sharegpu"
    known = set(OUTSIDE) | {word for p in chart.rglob("*") if p.is_file() for word in WORD.findall(p.read_text())}
    for tree in map(ast.parse, package_sources().values()):
        known |= spelled(tree)
    modules = {".".join(p.relative_to(PACKAGE).with_suffix("").parts) for p in PACKAGE.rglob("*.py")}
    subpackages = tuple(f"{p.name}." for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert len(subpackages) >= 10
    out = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for quoted in sorted(set(QUOTED.findall(doc.read_text()))):
            name = quoted.removeprefix("sharegpu.")
            if name.startswith(subpackages) and name not in modules and name.rpartition(".")[2] not in known:
                out.append(f"{doc.name}: `{name}`")
    assert out == []


def test_a_docstring_naming_what_is_gone_is_found() -> None:
    sources = {
        "pkg/mod.py": '"""Calls `helper` and `Thing.size`, reads `status.nominatedNodeName`."""\n'
        "def helper() -> None:\n"
        '    """Was `old_helper`."""\n'
        "class Thing:\n"
        "    size = 1\n"
        '    """`size`; `nominated_node_name` is the field."""\n'
        "nominated_node_name = 1\n"
    }
    assert unknown(sources) == ["pkg/mod.py:3: `old_helper`"]
    sources["pkg/mod.py"] = sources["pkg/mod.py"].replace("size = 1", "length = 1")
    assert unknown(sources) == ["pkg/mod.py:1: `Thing.size`", "pkg/mod.py:3: `old_helper`", "pkg/mod.py:6: `size`"]
