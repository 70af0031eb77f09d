"""DRA device selectors evaluated as kube-scheduler evaluates them (`api.selectors`); the same selectors
run through kube-scheduler's own allocator in tests/integration/test_dra_selectors.py."""

from __future__ import annotations

from typing import Any

import pytest

from sharegpu.api import dra, selectors, wire

DOMAIN = dra.DRIVER
A = f'device.attributes["{DOMAIN}"]'
C = f'device.capacity["{DOMAIN}"]'


def gpu(**attributes: Any) -> selectors.Device:
    published: dict[str, Any] = {
        "productName": {"string": "NVIDIA A100-SXM4-40GB"},
        "index": {"int": 1},
        "mig": {"bool": False},
        "cudaComputeCapability": {"version": "8.0.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
    }
    published.update(attributes)
    device = {
        "name": "gpu-1",
        "attributes": published,
        "capacity": {"memory": {"value": "40960Mi"}, "milli": {"value": "1000"}},
        "allowMultipleAllocations": True,
    }
    return selectors.Device.of(DOMAIN, device)


def judge(expression: str, device: selectors.Device | None = None) -> selectors.Verdict:
    compiled = selectors.compile_selector(expression)
    assert isinstance(compiled, selectors.Selector), compiled
    return compiled.judge(device or gpu())


@pytest.mark.parametrize(
    ("expression", "matches"),
    [
        (f'device.driver == "{DOMAIN}"', True),
        (f'{A}.productName == "NVIDIA A100-SXM4-40GB"', True),
        (f'{A}.productName.startsWith("NVIDIA H")', False),
        (f"{A}.index == 1 && !{A}.mig", True),
        (f"{A}.index < 1.5", True),  # numbers of different types compare
        (f'{A}.cudaComputeCapability.isGreaterThan(semver("7.5.0"))', True),
        (f'{A}.cudaComputeCapability.compareTo(semver("8.0.0")) == 0', True),
        (f'{A}.cudaComputeCapability == semver("8.0.0+build.5")', True),  # build metadata is not compared
        (f'{C}.memory.compareTo(quantity("40Gi")) == 0', True),
        (f'{C}.memory == quantity("40Gi")', True),  # values, not spellings
        (f'{C}.memory.isGreaterThan(quantity("80Gi"))', False),
        (f'{C}.milli.isLessThan(quantity("1001"))', True),
        ('device.attributes["resource.kubernetes.io"].pcieRoot == "pci0000:00"', True),
        ('"model" in device.attributes["other.example.com"]', False),  # an absent domain is an empty map
        (f'"productName" in {A} && !("pcieSwitch" in {A})', True),
        (f"{A}.?pcieSwitch.orValue(-1) == -1", True),
        (f'cel.bind(g, {A}, g.productName.lowerAscii().contains("a100") && g.index > 0)', True),
        ("device.allowMultipleAllocations", True),
        ('sign(quantity("-2")) == -1 && quantity("1.5").add(2) == quantity("3500m")', True),
        ('quantity("1.5").isInteger() || quantity("2k").sub(quantity("1k")).asInteger() != 1000', False),
        ('semver("v1.2", true) == semver("1.2.0") && semver("01.02.3", true).minor() == 2', True),
        ('semver("1.0.0-alpha").isLessThan(semver("1.0.0"))', True),
        ('semver("1.0.0-alpha.2").isLessThan(semver("1.0.0-alpha.10"))', True),  # numeric identifiers by value
        ('semver("1.0.0-alpha.beta").isGreaterThan(semver("1.0.0-alpha.1"))', True),  # numbers before words
        ('semver("1.0.0-alpha").isLessThan(semver("1.0.0-alpha.1"))', True),  # fewer identifiers first
        ('isSemver("1.2.3") && !isSemver("01.2.3") && !isSemver("v1.2.3") && isSemver("v1.2", true)', True),
        ('!isSemver("1.2.3-01") && isSemver("1.2.3-0a") && !isSemver("1.2")', True),
        ('isQuantity("1.5Gi") && !isQuantity("1.5GB")', True),
    ],
)
def test_a_selector_reads_the_device_as_kubernetes_does(expression: str, matches: bool) -> None:
    assert judge(expression) == selectors.Verdict(matches)


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        (f"{A}.pcieSwitch == 1", 'Key not found in map : "pcieSwitch"'),
        ('device.attributes["other.example.com"].model == "x"', 'Key not found in map : "model"'),
        ('quantity("1.5").asInteger() == 1', "cannot convert value to integer"),
        ('quantity("lots") == quantity("1")', "'lots' is not a Kubernetes quantity"),
        ('semver("1.0") == semver("1.0.0")', "'1.0' is not a semantic version"),
        (f"{A}.productName", "CEL result of type STRING could not be converted to bool"),
    ],
)
def test_a_selector_that_fails_on_a_device_says_why(expression: str, error: str) -> None:
    verdict = judge(expression)
    assert not verdict.matches
    assert error in verdict.error


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ('"a".find("a") == "a"', "undeclared reference to 'find'"),
        ('quantity("1").sign() == 1', "undeclared reference to 'sign'"),  # a function, not a method, in Kubernetes
        ('quantity("1").isGreaterThan(semver("1.0.0"))', "no matching overload for 'isGreaterThan'"),
        ("device.driver ==", "Syntax error"),
        ("1 + 2", "must evaluate to bool, not int"),
    ],
)
def test_an_expression_that_does_not_compile_here_is_a_problem_naming_why(expression: str, problem: str) -> None:
    compiled = selectors.compile_selector(expression)
    assert isinstance(compiled, selectors.Problem)
    assert problem in compiled.message


def test_a_version_attribute_that_is_not_a_version_is_refused_when_the_device_is_read() -> None:
    with pytest.raises(ValueError, match="attribute cudaComputeCapability: parse semantic version"):
        gpu(cudaComputeCapability={"version": "8.0"})


def test_the_slice_a_node_publishes_is_read_back_by_the_selectors_it_was_written_for() -> None:
    spec = wire.GpuSpec(index=2, uuid="GPU-2", model="NVIDIA H100 80GB HBM3", memory_mib=81559)
    device = dra.device(spec, [(2, 3)])
    seen = selectors.Device.of(dra.DRIVER, device)
    assert judge(f'{A}.index == 2 && {A}.nvlinkPeers == "3"', seen).matches
    assert judge(f'{C}.memory == quantity("81559Mi")', seen).matches
