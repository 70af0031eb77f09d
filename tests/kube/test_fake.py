"""The fake API server's own devices, the ones the real one has no equivalent of and so the contract
test (tests/integration/test_fake_contract.py) cannot hold: injected failures before and after a
request is carried out, lost answers, expired watches and compaction, finishing deletions, paging,
generated names and bindings."""

from __future__ import annotations

import asyncio

import pytest

from sharegpu.api import paths, wire
from sharegpu.kube import client, errors, fake
from tests.builders import MakePod


@pytest.fixture
async def kube() -> client.KubeClient:
    return client.KubeClient(fake.FakeApiServer())


def server_of(kube: client.KubeClient) -> fake.FakeApiServer:
    transport = kube.transport
    assert isinstance(transport, fake.FakeApiServer)
    return transport


async def test_an_injected_failure_answers_instead_or_after_the_write(kube: client.KubeClient) -> None:
    server = server_of(kube)
    server.fail(429, method="POST", retry_after=7)
    with pytest.raises(errors.BusyError) as busy:
        await kube.create(paths.pods("ns"), MakePod("a", "ns").obj())
    assert busy.value.status == 429 and busy.value.retry_after == 7
    assert server.get_object(paths.pod("ns", "a")) is None, "answered instead of carrying it out"
    server.fail(500, method="POST", after_commit=True)
    with pytest.raises(errors.BusyError):
        await kube.create(paths.pods("ns"), MakePod("a", "ns").obj())
    assert server.get_object(paths.pod("ns", "a")) is not None, "carried out, then the answer failed"
    await kube.create(paths.pods("ns"), MakePod("b", "ns").obj())  # one failure each, as asked


async def test_a_lost_answer_is_a_transport_error_after_or_before_the_write(kube: client.KubeClient) -> None:
    server = server_of(kube)
    server.lose(method="POST")
    with pytest.raises(errors.TransportError):
        await kube.create(paths.pods("ns"), MakePod("a", "ns").obj())
    assert server.get_object(paths.pod("ns", "a")) is not None
    server.lose(method="POST", after_commit=False)
    with pytest.raises(errors.TransportError):
        await kube.create(paths.pods("ns"), MakePod("b", "ns").obj())
    assert server.get_object(paths.pod("ns", "b")) is None


async def test_expired_watches_get_410_and_no_one_resumes_from_compacted_history(kube: client.KubeClient) -> None:
    server = server_of(kube)
    listed = await kube.get(paths.pods("ns"))
    version = listed["metadata"]["resourceVersion"]

    async def watch() -> None:
        async for _ in kube.watch(paths.pods("ns"), wire.Pod, version):
            pass

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.05)
    seen = await kube.create(paths.pods("ns"), MakePod("a", "ns").obj())
    await kube.create(paths.pods("ns"), MakePod("b", "ns").obj())
    server.expire_watches()
    with pytest.raises(errors.GoneError):
        await asyncio.wait_for(task, 5)
    version = seen["metadata"]["resourceVersion"]  # older than the compaction
    with pytest.raises(errors.GoneError):
        await asyncio.wait_for(watch(), 5)


async def test_finishing_deletions_removes_what_is_being_deleted(kube: client.KubeClient) -> None:
    server = server_of(kube)
    await kube.create(paths.pods("ns"), MakePod("bound", "ns").node("n1").obj())
    await kube.delete(paths.pod("ns", "bound"))
    assert (server.get_object(paths.pod("ns", "bound")) or {})["metadata"].get("deletionTimestamp")
    server.finish_deletions()
    assert server.get_object(paths.pod("ns", "bound")) is None


async def test_lists_page_with_continue_and_names_are_generated(kube: client.KubeClient) -> None:
    for _ in range(5):
        body = MakePod("", "ns").obj()
        body["metadata"] = {"generateName": "w-", "namespace": "ns"}
        made = await kube.create(paths.pods("ns"), body)
        assert made["metadata"]["name"].startswith("w-") and len(made["metadata"]["name"]) > 2
    first = await kube.get(paths.pods("ns"), limit=2)
    assert len(first["items"]) == 2 and first["metadata"]["continue"]
    names = [item["metadata"]["name"] for item in first["items"]]
    page = first
    while page["metadata"].get("continue"):
        page = await kube.get(paths.pods("ns"), limit=2, **{"continue": page["metadata"]["continue"]})
        names += [item["metadata"]["name"] for item in page["items"]]
    assert len(names) == len(set(names)) == 5


async def test_a_binding_lands_its_annotations_and_a_second_is_409(kube: client.KubeClient) -> None:
    server = server_of(kube)
    await kube.create(paths.pods("ns"), MakePod("a", "ns").obj())
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "a", "annotations": {"k": "v"}},
               "target": {"kind": "Node", "name": "n1"}}  # fmt: skip
    await kube.create(paths.binding("ns", "a"), binding)
    bound = server.get_object(paths.pod("ns", "a")) or {}
    assert bound["spec"]["nodeName"] == "n1" and bound["metadata"]["annotations"]["k"] == "v"
    with pytest.raises(errors.ConflictError, match="already assigned to node n1"):
        await kube.create(paths.binding("ns", "a"), binding)
