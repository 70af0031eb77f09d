"""The oracle's reading of sharegpu's ResourceClaims: one ledger with the pods' shares, and the claims
checked against the pods that use them."""

from __future__ import annotations

import uuid

from sharegpu.api import dra, paths, wire
from sharegpu.devcluster import oracle
from sharegpu.kube import client, fake
from tests.builders import MakeAllocation, MakeClaim, MakeDevice, MakePod

SERVED = frozenset({"resource.k8s.io/v1"})


async def claim(kube: client.KubeClient, name: str, node: str, index: int, milli: int, memory: int) -> None:
    made = await kube.create(dra.claim_path("ns"), MakeClaim(name, "ns").ask(milli, f"{memory}Mi").obj())
    placed = MakeAllocation(f"ns/{name}#claim", node).grant(index, milli, memory, container="gpu").obj()
    made["status"] = {"allocation": dra.claim_allocation(placed, [str(uuid.uuid4())], wire.timestamp(1e9))}
    await kube.replace(f"{dra.claim_path('ns', name)}/status", made)


async def pod_using(kube: client.KubeClient, name: str, claim_name: str, node: str | None) -> None:
    made = MakePod(name, "ns").container(image="busybox").claim(claim_name)
    if node:
        made.node(node)
    await kube.create(paths.pods("ns"), made.obj())


async def test_claims_and_shares_count_in_one_ledger_and_are_checked_against_their_pods() -> None:
    kube = client.KubeClient(fake.FakeApiServer(served=SERVED))
    await kube.create(paths.DEVICES, MakeDevice("n1").dra().gpus(2).obj())
    await kube.create(paths.DEVICES, MakeDevice("n2").dra().gpus(1).obj())
    await claim(kube, "a", "n1", 0, 600, 4096)
    await claim(kube, "b", "n1", 0, 400, 4096)
    await pod_using(kube, "pa", "a", "n1")
    await pod_using(kube, "pb", "b", "n1")
    found = await oracle.inspect(kube, claims=True)
    assert found.problems() == [] and found.claims_bound == 2 and found.gpus_in_use == 1
    assert (await oracle.inspect(kube)).gpus_in_use == 0, "claims are read only when asked"

    await claim(kube, "c", "n1", 0, 100, 1024)  # one more on the full GPU: over its 1000
    await pod_using(kube, "pc", "c", "n2")  # and its pod bound elsewhere
    await claim(kube, "d", "n2", 0, 100, 1024)  # allocated, used by nobody
    await kube.create(dra.claim_path("ns"), MakeClaim("e", "ns").ask(100, "1Gi").obj())
    await pod_using(kube, "pe", "e", "n2")  # bound, its claim not allocated
    found = await oracle.inspect(kube, claims=True)
    assert found.overcommits == ["n1/gpu0: 1100 milli and 9216 MiB allocated of 1000 and 16384"]
    assert sorted(found.missing_allocations) == [
        "ns/pc: bound to n2, its claim c allocated on n1",
        "ns/pe: bound to n2, its claim e holds no GPU",
    ]
    assert found.orphan_allocations == ["ns/d on n2"]
    assert found.unheld == [], "a GPU shared by claims needs no reservation pod"
    only_n2 = await oracle.inspect(kube, nodes={"n2"}, claims=True)
    assert only_n2.overcommits == [] and only_n2.orphan_allocations == ["ns/d on n2"]
