"""kube-scheduler's extender protocol (k8s.io/kube-scheduler/extender/v1) as typed messages.

The JSON keys are the Go field names (the Go types have no json tags): filter gets {Pod, Nodes,
NodeNames} and answers {NodeNames, FailedNodes, FailedAndUnresolvableNodes, Error}; prioritize
answers [{Host, Score}] with scores 0..10; bind gets {PodName, PodNamespace, PodUID, Node} and
answers {Error}.

A node that nothing can help is put in FailedAndUnresolvableNodes (kube-scheduler then skips
preemption on it) and in FailedNodes too: kube-scheduler lets the first map take precedence, and a
reader of FailedNodes alone (a log, an older tool) still sees every node that failed.
"""

from __future__ import annotations

from typing import Final

import msgspec

from sharegpu.api import wire

MAX_SCORE: Final = 10
"""extenderv1.MaxExtenderPriority."""


class _Go(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Go field names are given per field."""


class NodeItem(msgspec.Struct, kw_only=True, frozen=True):
    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)


class NodeList(msgspec.Struct, kw_only=True, frozen=True):
    items: list[NodeItem] = []


class Args(_Go, kw_only=True, frozen=True):
    """ExtenderArgs: the pod and its candidate nodes (names only when nodeCacheCapable).

    The names stay as the JSON text kube-scheduler sent (`msgspec.Raw`) until someone needs them:
    the same candidate list comes pod after pod, and a repeat of a text is recognised by one
    comparison, far cheaper than decoding and looking up thousands of names each time."""

    pod: wire.Pod = msgspec.field(default_factory=wire.Pod, name="Pod")
    nodes: NodeList | None = msgspec.field(default=None, name="Nodes")
    node_names: msgspec.Raw = msgspec.field(default=msgspec.Raw(b"null"), name="NodeNames")

    @classmethod
    def of(cls, pod: wire.Pod, node_names: list[str]) -> Args:
        return cls(pod=pod, node_names=msgspec.Raw(msgspec.json.encode(node_names)))

    def names_text(self) -> bytes:
        """The candidate names as a compact JSON array."""
        text = bytes(self.node_names)
        if text != b"null":
            return text
        return msgspec.json.encode([n.metadata.name for n in (self.nodes.items if self.nodes else [])])


class FilterResult(_Go, kw_only=True, frozen=True):
    """ExtenderFilterResult."""

    node_names: list[str] = msgspec.field(default_factory=list, name="NodeNames")
    failed_nodes: dict[str, str] = msgspec.field(default_factory=dict, name="FailedNodes")
    failed_and_unresolvable: dict[str, str] = msgspec.field(default_factory=dict, name="FailedAndUnresolvableNodes")
    error: str = msgspec.field(default="", name="Error")


class HostPriority(_Go, kw_only=True, frozen=True):
    host: str = msgspec.field(name="Host")
    score: int = msgspec.field(name="Score")


class BindingArgs(_Go, kw_only=True, frozen=True):
    """ExtenderBindingArgs."""

    pod_name: str = msgspec.field(default="", name="PodName")
    pod_namespace: str = msgspec.field(default="", name="PodNamespace")
    pod_uid: str = msgspec.field(default="", name="PodUID")
    node: str = msgspec.field(default="", name="Node")


class BindingResult(_Go, kw_only=True, frozen=True):
    """ExtenderBindingResult: an empty Error means bound."""

    error: str = msgspec.field(default="", name="Error")


ENCODER: Final = msgspec.json.Encoder()
_NAMES: Final = msgspec.json.Decoder(list[str])


def decode_names(text: bytes) -> list[str]:
    """A JSON array of node names (`Args.names_text`)."""
    return _NAMES.decode(text)
