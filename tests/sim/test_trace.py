from __future__ import annotations

from pathlib import Path

import pytest

from sharegpu.core import errors
from sharegpu.sim import trace

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn1,32000,65536,2,T4\nn2,8000,16384,0,\n"
PODS = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
    "p1,1000,2048,1,500,T4|A10,LS,Running,10,100,10\n"
    "p2,4000,1024,0,0,,BE,Running,20,30,20\n"
    "p3,8000,4096,2,1000,,LS,Pending,30,40,\n"
)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_reads_nodes_and_drops_cpu_only_ones(tmp_path: Path) -> None:
    nodes = trace.load_nodes(_write(tmp_path, "n.csv", NODES))
    assert [n.name for n in nodes] == ["n1"]
    assert nodes[0].gpu_count == 2
    assert nodes[0].gpus[0].memory_mib == trace.MODEL_MEMORY_MIB["T4"]
    assert len(trace.load_nodes(tmp_path / "n.csv", gpu_only=False)) == 2


def test_reads_pods_with_models_and_times(tmp_path: Path) -> None:
    loaded = trace.load_pods(_write(tmp_path, "openb_pod_list_x.csv", PODS))
    assert loaded.name == "x"
    first = loaded.pods[0]
    assert first.models == frozenset({"T4", "A10"})
    assert (first.creation_time, first.deletion_time) == (10, 100)
    assert loaded.pods[1].gpu_milli_total == 0
    assert loaded.pods[2].gpu_milli_total == 2000
    assert loaded.timed
    assert loaded.pods[0].request().demand.models == frozenset({"T4", "A10"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name,cpu_milli\np,1\n", "missing column"),
        (
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,one,1\n",
            r":2: column num_gpu must be an integer, got 'one'",
        ),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,1001\n", r":2: column gpu_milli must be in 0..1000"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,0\n", "num_gpu is 1 but gpu_milli is 0"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,2,500\n", "must take whole GPUs"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1\n", "wrong number of fields"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n", "no pods in the file"),
    ],
)
def test_malformed_pod_files_name_file_line_and_column(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(errors.InvalidTraceError, match=message):
        trace.load_pods(_write(tmp_path, "p.csv", text))


def test_missing_file_and_bad_nodes(tmp_path: Path) -> None:
    with pytest.raises(errors.InvalidTraceError, match="no such file"):
        trace.load_pods(tmp_path / "absent.csv")
    with pytest.raises(errors.InvalidTraceError, match="has 2 GPU\\(s\\) but no model"):
        trace.load_nodes(_write(tmp_path, "n.csv", "sn,cpu_milli,memory_mib,gpu,model\nn,1,1,2,\n"))
    with pytest.raises(errors.InvalidTraceError, match="appears twice"):
        trace.load_nodes(_write(tmp_path, "d.csv", "sn,cpu_milli,memory_mib,gpu,model\nn,1,1,1,T4\nn,1,1,1,T4\n"))
    path = tmp_path / "bin.csv"
    path.write_bytes(b"sn,cpu_milli,memory_mib,gpu,model\n\xff\xfe,1,1,1,T4\n")
    with pytest.raises(errors.InvalidTraceError, match="not UTF-8"):
        trace.load_nodes(path)


def test_the_openb_trace_names_are_the_pod_lists_openb_ships(openb: Path) -> None:
    shipped = {p.name for p in openb.glob("openb_pod_list_*.csv")}
    assert {trace.pod_file(name) for name in trace.OPENB_TRACES} == shipped
    assert (openb / trace.NODE_FILE).is_file()
