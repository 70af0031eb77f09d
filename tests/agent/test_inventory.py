"""The agent's inventory: the fake NVML's file, and the Device spec built from what NVML says."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from sharegpu.agent import inventory, nvml
from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.api import devices as api_devices
from sharegpu.api import names, wire
from sharegpu.core import units
from tests.builders import NVML_FILE, MakeAllocation, nvml_with, write_nvml


def test_the_fake_reads_its_file_and_derives_the_topology(tmp_path: Path) -> None:
    path = tmp_path / "nvml.yaml"
    write_nvml(path, NVML_FILE)
    fake = fakenvml.FakeNvml(path).open()
    assert [(g.index, g.uuid, g.minor, g.pcie_switch, g.numa_node) for g in fake.gpus()] == [
        (0, "GPU-0", 0, 0, 0), (1, "GPU-1", 1, 0, 0), (2, "GPU-2", 2, None, 1)
    ]  # fmt: skip
    assert fake.links() == [
        nvml.Link(0, 1, 12, True, True), nvml.Link(0, 2, 0, False, False), nvml.Link(1, 2, 0, False, False)
    ]  # fmt: skip
    assert fake.running() == [nvml.GpuProcess(42, "GPU-2", 2048)]
    assert fake.xid_events(0) == [] and fake.unreadable() == set()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpus: [{uuid: a, memoryMiB: -1}]", "Expected `int` >= 1 - at `$.gpus[0].memoryMiB`"),
        ("gpus: [{uuid: a}, {uuid: a}]", "GPU UUIDs must be unique"),
        ("gpus: [{uuid: a}]\nnvlinks: [{a: 0, b: 3}]", "nvlinks[0] names GPU 3, but there are 1 GPU(s)"),
        ("gpus: [{uuid: a}]\nxids: [{gpu: 1, code: 79}]", "xids[0] names GPU 1"),
        ("gpus: [{uuid: a, colour: red}]", "Object contains unknown field `colour`"),
        ("gpus: [", "not YAML"),
    ],
)
def test_a_malformed_file_is_refused_naming_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "nvml.yaml"
    write_nvml(path, text)
    with pytest.raises(fakenvml.FakeNvmlError) as refused:
        fakenvml.FakeNvml(path).open()
    assert message in str(refused.value) and str(path) in str(refused.value)


def test_changes_while_running_faults_and_xids_delivered_once(tmp_path: Path) -> None:
    path = tmp_path / "nvml.yaml"
    write_nvml(path, NVML_FILE)
    fake = fakenvml.FakeNvml(path).open()
    write_nvml(path, NVML_FILE + "faults: {unreadable: [1]}\nxids: [{gpu: 0, code: 79}]\n")
    assert fake.refresh()
    assert fake.unreadable() == {"GPU-1"}
    assert fake.xid_events(0) == [nvml.Xid("GPU-0", 79)]
    assert fake.xid_events(0) == []  # once
    write_nvml(path, NVML_FILE + "faults: {unreadable: [1]}\nxids: [{gpu: 0, code: 79}, {gpu: 2, code: 13}]\n")
    assert fake.xid_events(100) == [nvml.Xid("GPU-2", 13)]
    write_nvml(path, "gpus: [{uuid: a, memoryMiB: 0}]")  # broken: the last good configuration stays
    assert not fake.refresh() and len(fake.gpus()) == 3
    write_nvml(path, "gpus: []\nfaults: {library: true}\n")
    with pytest.raises(nvml.NvmlUnavailableError, match="NVML cannot be loaded here"):
        fakenvml.FakeNvml(path).open()


def gpus(*uuids: str) -> list[nvml.Gpu]:
    return [nvml.Gpu(index=i, uuid=u, minor=i, model="NVIDIA A100-SXM4-80GB", memory_mib=81920)
            for i, u in enumerate(uuids)]  # fmt: skip


def test_a_device_spec_keeps_indexes_by_uuid_and_a_held_gpu_that_vanished() -> None:
    first = inventory.device_spec(gpus("A", "B", "C", "D"), [], {}, None, set())
    assert [(g.index, g.uuid, g.healthy) for g in first.gpus] == [(0, "A", True), (1, "B", True), (2, "C", True),
                                                                  (3, "D", True)]  # fmt: skip
    # B falls off the bus: NVML renumbers C and D to 1 and 2; pods still hold B.
    second = inventory.device_spec(gpus("A", "C", "D"), [], {}, first, {"B"})
    assert [(g.index, g.uuid, g.healthy, g.reason) for g in second.gpus] == [
        (0, "A", True, ""), (1, "B", False, api_devices.GONE), (2, "C", True, ""), (3, "D", True, "")
    ]  # fmt: skip
    # Once nothing holds it, it is dropped; a new GPU takes a free index.
    third = inventory.device_spec(gpus("A", "C", "D", "E"), [], {"C": "XID 79"}, second, set())
    assert [(g.index, g.uuid, g.healthy, g.reason) for g in third.gpus] == [
        (0, "A", True, ""), (1, "E", True, ""), (2, "C", False, "XID 79"), (3, "D", True, "")
    ]  # fmt: skip


def test_switches_come_from_nvmls_common_ancestors_and_nvlinks_are_pairs() -> None:
    links = [nvml.Link(0, 1, 0, True, True), nvml.Link(1, 2, 0, True, True), nvml.Link(2, 3, 4, False, True),
             nvml.Link(0, 3, 0, False, False)]  # fmt: skip
    spec = inventory.device_spec(gpus("A", "B", "C", "D"), links, {}, None, set())
    assert [g.pcie_switch for g in spec.gpus] == [0, 0, 0, None]
    assert spec.nvlinks == [(2, 3)]


def test_node_labels_and_the_gpus_pods_hold() -> None:
    spec = inventory.device_spec(gpus("A", "B"), [], {}, None, set())
    no_modes = {"sharegpu.io/isolation-hami-core": None, "sharegpu.io/isolation-mps": None,
                "sharegpu.io/isolation-mig": None}  # fmt: skip
    assert inventory.node_labels(spec) == {
        inventory.MODEL_LABEL: "NVIDIA-A100-SXM4-80GB", inventory.COUNT_LABEL: "2", inventory.HEALTHY_LABEL: "2",
        **no_modes,
    }  # fmt: skip
    assert inventory.node_labels(wire.DeviceSpec()) == {
        inventory.MODEL_LABEL: None, inventory.COUNT_LABEL: None, inventory.HEALTHY_LABEL: None, **no_modes
    }  # fmt: skip
    sick = inventory.device_spec(gpus("A", "B"), [], {"B": "XID 79"}, None, set())
    assert inventory.node_labels(sick)[inventory.HEALTHY_LABEL] == "1", "a GPU's health changes the Node"
    offered = msgspec.structs.replace(spec, isolation=["mps"])
    assert inventory.node_labels(offered)["sharegpu.io/isolation-mps"] == "true"
    alloc = MakeAllocation(units.pod_key("ns", "s"), "n0").grant(1, 500).obj()
    pods = [
        wire.Pod(metadata=wire.ObjectMeta(name="s", namespace="ns", annotations={names.ALLOCATION: alloc.to_json()})),
        wire.Pod(metadata=wire.ObjectMeta(name="r", namespace="x", annotations={names.GPU_UUID: "A"})),
        wire.Pod(metadata=wire.ObjectMeta(name="bad", namespace="x", annotations={names.ALLOCATION: "{"})),
    ]
    assert inventory.held_uuids(pods, spec) == {"A", "B"}


def test_a_nodes_inventory_becomes_a_fake_nvml_file_that_reads_back_the_same() -> None:
    from sharegpu.core import devices

    node = devices.uniform_node("n", gpu_count=4, model="A100", gpu_memory_mib=40960, cpu_milli=1, memory_mib=1,
                                nvlink_all=True)  # fmt: skip
    fake = fakenvml.parse(fakenvml.describe(node))
    assert [(g.uuid, g.model, g.memory_mib, g.numa_node, g.pcie_switch) for g in fake.gpus] == [
        (g.uuid, g.model, g.memory_mib, g.numa_node, g.pcie_switch) for g in node.gpus
    ]
    assert {(link.a, link.b) for link in fake.nvlinks} == set(node.nvlinks)


def test_the_fake_reports_what_dra_selectors_read_from_its_file_or_its_models_defaults(tmp_path: Path) -> None:
    path = tmp_path / "nvml.yaml"
    write_nvml(
        path,
        "driverVersion: 535.104.05\ncudaDriverVersion: '12.2'\ngpus:\n"
        "  - {uuid: a, model: Tesla T4}\n"
        "  - {uuid: b, model: NVIDIA H100 80GB HBM3, architecture: Hopper, computeCapability: '9.0',"
        " pciBusId: 0000:3b:00.0, pcieRoot: pci0000:3a}\n"
        "  - {uuid: c, model: Mystery GPU}\n",
    )
    found = fakenvml.FakeNvml(path).open().gpus()
    assert [(g.architecture, g.compute_capability, g.pci_bus_id, g.pcie_root) for g in found] == [
        ("Turing", "7.5", "0000:01:00.0", "pci0000:00"),
        ("Hopper", "9.0", "0000:3b:00.0", "pci0000:3a"),
        ("", "", "0000:03:00.0", "pci0000:00"),
    ]
    assert {(g.driver_version, g.cuda_driver_version) for g in found} == {("535.104.05", "12.2")}
    spec = inventory.device_spec(found, [], {}, None, set())
    assert [(g.architecture, g.compute_capability, g.pcie_root) for g in spec.gpus][1] == (
        "Hopper",
        "9.0",
        "pci0000:3a",
    )
    write_nvml(path, "gpus: [{uuid: a, computeCapability: eight}]")
    with pytest.raises(fakenvml.FakeNvmlError, match="computeCapability"):
        fakenvml.FakeNvml(path).open()


def test_a_pci_devices_root_complex_and_address_are_read_as_kubernetes_reads_them(tmp_path: Path) -> None:
    device = tmp_path / "devices" / "pci0000:3a" / "0000:3a:00.0" / "0000:3b:00.0"
    device.mkdir(parents=True)
    listed = tmp_path / "bus" / "pci" / "devices"
    listed.mkdir(parents=True)
    (listed / "0000:3b:00.0").symlink_to("../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0")
    (listed / "0000:5e:00.0").symlink_to("../../../elsewhere/0000:5e:00.0")
    assert nvml.sysfs_address("00000000:3B:00.0") == "0000:3b:00.0"
    assert nvml.pcie_root("0000:3b:00.0", tmp_path) == "pci0000:3a"
    assert nvml.pcie_root("0000:5e:00.0", tmp_path) == ""  # not under devices/pci*: unknown
    assert nvml.pcie_root("0000:99:00.0", tmp_path) == ""  # no such device


class UnsupportedError(Exception):
    """NVML's error, in the stand-in library."""


def test_nvml_answers_become_what_the_slice_publishes() -> None:
    """The adapter over nvidia-ml-py, on a stand-in for the library: architecture numbers by the
    library's own names, CUDA's version number as major.minor, the bus ID in sysfs's form (the
    real calls are held against nvidia-smi by `sharegpu gpu-check` on a GPU)."""

    class Lib:
        NVMLError = UnsupportedError
        NVML_DEVICE_ARCH_AMPERE = 7
        NVML_DEVICE_ARCH_HOPPER = 9
        NVML_DEVICE_ARCH_UNKNOWN = 0xFFFFFFFF
        NVML_DEVICE_MIG_ENABLE = 1

        def nvmlDeviceGetPciInfo(self, handle: object) -> object:  # noqa: N802 - NVML's name
            return type("Pci", (), {"busId": b"00000000:3B:00.0"})()

        def nvmlDeviceGetMigMode(self, handle: object) -> tuple[int, int]:  # noqa: N802
            raise UnsupportedError("not supported")

        def nvmlDeviceGetArchitecture(self, handle: object) -> int:  # noqa: N802
            return 9

        def nvmlDeviceGetCudaComputeCapability(self, handle: object) -> tuple[int, int]:  # noqa: N802
            return (9, 0)

        def nvmlSystemGetDriverVersion(self) -> bytes:  # noqa: N802
            return b"570.86.15"

        def nvmlSystemGetCudaDriverVersion(self) -> int:  # noqa: N802
            return 12080

        def nvmlDeviceGetUUID(self, handle: object) -> str:  # noqa: N802
            return "GPU-h"

        def nvmlDeviceGetMinorNumber(self, handle: object) -> int:  # noqa: N802
            return 3

        def nvmlDeviceGetName(self, handle: object) -> str:  # noqa: N802
            return "NVIDIA H200"

        def nvmlDeviceGetMemoryInfo(self, handle: object) -> object:  # noqa: N802
            return type("Memory", (), {"total": 143771 << 20})()

    reader = nvml.Nvml()
    reader.lib = Lib()
    reader.handles = [object()]
    (gpu,) = reader.gpus()
    assert (gpu.architecture, gpu.compute_capability, gpu.driver_version, gpu.cuda_driver_version) == (
        "Hopper", "9.0", "570.86.15", "12.8"
    )  # fmt: skip
    assert (gpu.pci_bus_id, gpu.mig, gpu.memory_mib) == ("0000:3b:00.0", False, 143771)


def test_the_fake_reports_sm_use_per_process_and_none_where_a_gpu_takes_no_samples(tmp_path: Path) -> None:
    path = tmp_path / "nvml.yaml"
    text = nvml_with()
    write_nvml(
        path,
        text + "processes: [{pid: 7, gpu: 0, smPercent: 70}, {pid: 8, gpu: 0, smPercent: 50}, {pid: 9, gpu: 1},"
        " {pid: 10, gpu: 2, smPercent: 30}]\nfaults: {noProcessSamples: [2]}\n",
    )
    fake = fakenvml.FakeNvml(path).open()
    assert fake.utilization() == [
        nvml.Utilization("GPU-0", 100, ((7, 70), (8, 50))),  # the GPU's own figure is capped
        nvml.Utilization("GPU-1", 0, ()),  # a process that used no SM is not named
        nvml.Utilization("GPU-2", 30, None),
    ]
    write_nvml(path, NVML_FILE + "faults: {noProcessSamples: [3]}\n")
    with pytest.raises(fakenvml.FakeNvmlError, match=r"faults.noProcessSamples\[0\] names GPU 3"):
        fakenvml.FakeNvml(path).open()


def test_nvml_per_process_samples_are_read_since_the_last_and_averaged_per_process() -> None:
    """The adapter over nvidia-ml-py's process samples, on a stand-in for the library: samples since
    the newest one read before, their mean per process; NOT_FOUND (none since) is no use at all, and
    any other error (MIG: not supported) is no per-process figure."""

    class NotFoundError(Exception):
        value = 6

    class Lib:
        NVMLError = Exception
        NVML_ERROR_NOT_FOUND = 6

        def __init__(self, answers: list[object]) -> None:
            self.asked: list[int] = []
            self.answers = answers

        def nvmlDeviceGetUUID(self, handle: object) -> str:  # noqa: N802 - NVML's name
            return f"GPU-{handle}"

        def nvmlDeviceGetUtilizationRates(self, handle: object) -> object:  # noqa: N802
            return type("Rates", (), {"gpu": 64})()

        def nvmlDeviceGetProcessUtilization(self, handle: object, since: int) -> list[object]:  # noqa: N802
            self.asked.append(since)
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            assert isinstance(answer, list)
            return answer

    def sample(pid: int, stamp: int, sm: int) -> object:
        return type("Sample", (), {"pid": pid, "timeStamp": stamp, "smUtil": sm})()

    lib = Lib([[sample(5, 100, 40), sample(5, 200, 60), sample(6, 150, 10)], NotFoundError(), RuntimeError()])
    reader = nvml.Nvml()
    reader.lib = lib
    reader.handles = [0]
    assert reader.utilization() == [nvml.Utilization("GPU-0", 64, ((5, 50), (6, 10)))]
    assert reader.utilization() == [nvml.Utilization("GPU-0", 64, ())]
    assert reader.utilization() == [nvml.Utilization("GPU-0", 64, None)]
    assert lib.asked == [0, 200, 200], "each read asks for the samples after the newest seen"
