"""The simulator's policies: sharegpu's own (`core.policies.REGISTRY`, what the components accept)
and the peers' emulations (`sim.peers`), which only the simulator and its benchmarks run. `check`
and `make` are `core.policies`' over both."""

from __future__ import annotations

from sharegpu.core import errors, frag, policies
from sharegpu.core.scoring import Policy
from sharegpu.sim import peers

REGISTRY: dict[str, type[Policy]] = {**policies.REGISTRY, **{cls.name: cls for cls in peers.PEERS}}
"""Every policy the simulator runs, by name: sharegpu's and the paper's, then the peers'."""


def names() -> list[str]:
    return list(REGISTRY)


def check(name: str) -> str:
    """The policy `name` stands for (`default`: the extender's default); UnknownPolicyError naming the
    simulator's choices if none."""
    name = policies.ALIASES.get(name, name)
    if name not in REGISTRY:
        choices = ", ".join([*REGISTRY, *policies.ALIASES])
        raise errors.UnknownPolicyError(f"unknown policy {name!r}; choose from: {choices}")
    return name


def make(name: str, shapes: tuple[frag.WeightedShape, ...] = ()) -> Policy:
    """A fresh policy by name, sharegpu's or a peer's."""
    return REGISTRY[check(name)].create(shapes)
