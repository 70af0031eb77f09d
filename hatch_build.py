"""Hatch build hook: generates the protobuf code for the .proto files under src/ before a wheel (or an
editable install) is built, so the generated code is never committed and always matches its .proto.

The output lies beside its .proto (`podresources.proto` gives `podresources_pb2.py` and its typed
`podresources_pb2.pyi`). Git ignores it, so it is named as a build artifact to get into the wheel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpc_tools import protoc
from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCES = "src"
PROTOS = (
    "sharegpu/agent/podresources.proto",
    "sharegpu/agent/draplugin.proto",
    "sharegpu/agent/pluginregistration.proto",
    "sharegpu/agent/csi.proto",
    "sharegpu/devcluster/cri.proto",
    "sharegpu/devcluster/deviceplugin.proto",
)


class ProtocBuildHook(BuildHookInterface):
    """Runs protoc (from grpcio-tools) on each file of PROTOS."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":  # an sdist carries the .proto; its wheel build generates
            return
        sources = Path(self.root) / SOURCES
        for proto in PROTOS:
            args = ["protoc", f"--proto_path={sources}", f"--python_out={sources}", f"--pyi_out={sources}", proto]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {SOURCES}/{proto}")
            stem = proto.removesuffix(".proto")
            build_data["artifacts"].extend(f"{SOURCES}/{stem}_pb2{suffix}" for suffix in (".py", ".pyi"))
