"""Names sharegpu defines in the Kubernetes API: resources, annotations, labels, namespaces.

The canonical request a sharegpu pod carries (the admission webhook translates every other format
into it):

    resources.limits (per container)
      sharegpu.io/gpu: N               GPUs for this container (absent: 1)
      sharegpu.io/gpu-milli: M         compute per GPU, 1..1000 (omitted or 1000: whole GPUs)
      sharegpu.io/gpu-memory: MiB      GPU memory per GPU
      nvidia.com/gpu: N                whole GPUs through the NVIDIA device plugin
    annotations (pod)
      sharegpu.io/gpu-limit-milli      burst limit per GPU for fractional containers
      sharegpu.io/gpu-memory-permille  GPU memory as a fraction of the GPU's memory
      sharegpu.io/gpu-models           allowed models, comma-separated
      sharegpu.io/affinity, anti-affinity, exclusion, group   co-tenancy rules

Only the system writes `sharegpu.io/allocation` (in the binding), `sharegpu.io/gpu-uuid` (a
reservation pod's report) and `sharegpu.io/handoff-configmap` (set by the webhook).
"""

from __future__ import annotations

from typing import Final

DOMAIN: Final = "sharegpu.io"
SCHEDULER_NAME: Final = "sharegpu-scheduler"
REPLACED_SCHEDULERS: Final = (
    "default-scheduler",
    "koord-scheduler",
    "kai-scheduler",
    "volcano",
    "hami-scheduler",
    "kubeshare-scheduler",
    "deviceshare-scheduler",
)
"""Schedulers whose GPU pods sharegpu takes over by default (the webhook's `--take-over`): without
it a pod written for another GPU system stays Pending for ever once that system is gone."""
SYSTEM_NAMESPACE: Final = "sharegpu-system"
HOLDING_NAMESPACE: Final = "sharegpu-gpus"
"""Where sharegpu's GPU-holding pods run (reservation pods, SharedDeviceGroups' holders), at
PodSecurity `restricted`, apart from the privileged agent of SYSTEM_NAMESPACE: only sharegpu creates
pods there, so only there does a pod's `LABEL_ROLE` mean anything (`api.pods.role`)."""
COMPONENTS: Final = ("scheduler", "extender", "webhook", "controller", "agent", "reserve")
"""The chart's components, each with its own ServiceAccount `sharegpu-<component>` in its namespace
(`account_namespace`)."""


def account(component: str) -> str:
    """A component's ServiceAccount (in `account_namespace(component)`)."""
    return f"sharegpu-{component}"


def account_namespace(component: str) -> str:
    """Where a component's ServiceAccount is: the GPU-holding pods' (`reserve`) beside them in
    HOLDING_NAMESPACE, the others in SYSTEM_NAMESPACE."""
    return HOLDING_NAMESPACE if component == "reserve" else SYSTEM_NAMESPACE


def account_user(component: str) -> str:
    """The user name a component's ServiceAccount token authenticates as (what RBAC and the
    admission policies name)."""
    return f"system:serviceaccount:{account_namespace(component)}:{account(component)}"


def account_groups(component: str) -> tuple[str, ...]:
    """The groups a component's ServiceAccount token carries (every ServiceAccount's, and its namespace's)."""
    return ("system:serviceaccounts", f"system:serviceaccounts:{account_namespace(component)}")


# ----------------------------------------------------------------- resources
GPU: Final = f"{DOMAIN}/gpu"
GPU_MILLI: Final = f"{DOMAIN}/gpu-milli"
GPU_MEMORY: Final = f"{DOMAIN}/gpu-memory"
NVIDIA_GPU: Final = "nvidia.com/gpu"
NVIDIA_MIG_PREFIX: Final = "nvidia.com/mig-"
"""The NVIDIA device plugin's MIG resources with `mig-strategy: mixed` (`nvidia.com/mig-1g.10gb`...):
the device plugin gives such a container its MIG devices, and sharegpu does not place them."""
MANAGED_RESOURCES: Final = (GPU, GPU_MILLI, GPU_MEMORY)
"""sharegpu's own resources: kube-scheduler leaves them to the extender (ignoredByScheduler)."""
GPU_RESOURCES: Final = (*MANAGED_RESOURCES, NVIDIA_GPU)
"""Any of these in a container makes the pod a GPU pod."""
GPU_MILLI_TOTAL: Final = f"{DOMAIN}/gpu-milli-total"
GPU_MEMORY_TOTAL: Final = f"{DOMAIN}/gpu-memory-total"
QUOTA_RESOURCES: Final = (GPU_MILLI_TOTAL, GPU_MEMORY_TOTAL)
"""Written by the webhook on every GPU container: its whole GPU use (count x per-GPU compute in
milli-GPU, whole GPUs at 1000; count x per-GPU memory in MiB when given in MiB), so that a
ResourceQuota on `requests.<name>` counts a pod of 3 GPUs at 500 milli as 1500, not 500.
Nothing schedules by them (ignoredByScheduler; the kubelet ignores resources its node lacks)."""
DRA_GPU_MILLI_TOTAL: Final = f"{DOMAIN}/dra-gpu-milli-total"
DRA_GPU_MEMORY_TOTAL: Final = f"{DOMAIN}/dra-gpu-memory-total"
DRA_QUOTA_RESOURCES: Final = (DRA_GPU_MILLI_TOTAL, DRA_GPU_MEMORY_TOTAL)
"""The same totals on a container of the DRA path (its GPUs come from claims), under names of their own:
kube-scheduler calls the extender for any pod asking for a QUOTA_RESOURCES name, and a pod of the DRA
path is kube-scheduler's and the DRA allocator's alone; the sharegpu profile's NodeResourcesFit ignores
these (`ignoredResources`), the kubelet ignores resources its node lacks. What a ResourceQuota or
Kueue counts (Kueue: a `transformations` entry maps them onto QUOTA_RESOURCES, docs/queues.md)."""

VOLUMES_DRIVER: Final = f"volumes.{DOMAIN}"
"""The agent's CSI driver: the node-side folders a sharing pod mounts, as inline volumes (`agent.volumes`)."""

# ----------------------------------------------------------------- annotations
ALLOCATION: Final = f"{DOMAIN}/allocation"
LIMIT_MILLI: Final = f"{DOMAIN}/gpu-limit-milli"
MEMORY_PERMILLE: Final = f"{DOMAIN}/gpu-memory-permille"
MODELS: Final = f"{DOMAIN}/gpu-models"
AFFINITY: Final = f"{DOMAIN}/affinity"
ANTI_AFFINITY: Final = f"{DOMAIN}/anti-affinity"
EXCLUSION: Final = f"{DOMAIN}/exclusion"
GROUP: Final = f"{DOMAIN}/group"
HANDOFF: Final = f"{DOMAIN}/handoff-configmap"
GPU_UUID: Final = f"{DOMAIN}/gpu-uuid"
CDI_CLAIM: Final = f"{DOMAIN}/claim"
"""On a CDI spec sharegpu's DRA plugin wrote: the claim it was prepared for and what it holds, as JSON
(`api.cdi.PreparedClaim`)."""
TRANSLATED: Final = f"{DOMAIN}/translated"
ISOLATION: Final = f"{DOMAIN}/isolation"
"""On a pod: the isolation mode it demands (hami-core, mps, mig); only nodes offering it take it."""
COMPUTE_GUARANTEE: Final = f"{DOMAIN}/compute-guarantee"
"""On a pod: "true" places it only where its demanded isolation mode enforces its compute share
(the node's Device says so per mode: mps and mig do, hami-core where its operator measured it)."""
GROUP_PLACEMENT: Final = f"{DOMAIN}/group-placement"
"""On a group's holder pod: the digest of the group's placement it was made for
(`api.groups.placement_digest`); a holder of a group not bound yet whose group's placement has
changed since is replaced."""
PLACEMENT: Final = f"{DOMAIN}/placement"
"""On a pod: binpack or spread, overriding the extender's policy for it (a group's holder pod)."""
DEMOTED: Final = f"{DOMAIN}/demoted"
"""On a pod: the exhausted GPUBudget that moved it to the budget's demotion PriorityClass."""
PATH: Final = f"{DOMAIN}/path"
"""On a pod (annotation) or a namespace (label): `dra` or `extender`, the way its GPUs are asked for
and placed (docs/dra.md); the webhook's --default-path otherwise."""
PATH_DRA: Final = "dra"
PATH_EXTENDER: Final = "extender"
PATHS: Final = (PATH_EXTENDER, PATH_DRA)
GANG: Final = f"{DOMAIN}/gang"
"""On a pod: the gang (of the pod's namespace) it belongs to; its members are placed all or nothing
(`api.gangs`)."""
GANG_MIN: Final = f"{DOMAIN}/gang-min"
"""On a gang's member: how many members must be placed together before any is bound."""
GANG_TIMEOUT: Final = f"{DOMAIN}/gang-timeout"
"""On a gang's member: seconds a placed gang's members have to reach their binding before the GPUs
planned for them are given back (`api.gangs.DEFAULT_TIMEOUT` when absent)."""
GANG_TOPOLOGY: Final = f"{DOMAIN}/gang-topology"
"""On a gang's member: a node label; the gang is placed on nodes that share one value of it (a rack,
a zone)."""
SYSTEM_ONLY_ANNOTATIONS: Final = (ALLOCATION, GPU_UUID, HANDOFF)
"""Set by sharegpu only; the webhook refuses them from anyone else."""

# ----------------------------------------------------------------- scheduling gates
DRA_GATE: Final = f"{DOMAIN}/dra-allocation"
"""The scheduling gate a pod whose GPUs come from DRA claims waits behind until sharegpu's allocator
has allocated them (and lifts it). kube-scheduler does not look at a gated pod."""

# ----------------------------------------------------------------- labels
LABEL_ROLE: Final = f"{DOMAIN}/role"
ROLE_RESERVATION: Final = "reservation"
ROLE_HANDOFF: Final = "handoff"
ROLE_GROUP_HOLDER: Final = "group-holder"
"""The pod that holds a SharedDeviceGroup's GPUs on its node (whole, `nvidia.com/gpu: N`, or a share
of each through sharegpu's resources)."""
ROLE_GROUP_SHARE: Final = "group-share-holder"
"""In the container of a group's holder pod that holds a share of each GPU (sharegpu's own
resources, placed and handed off like a sharing pod): nothing to report, it only holds."""
ROLE_ENV: Final = "SHAREGPU_ROLE"
"""In the container of sharegpu's GPU-holding pods: which kind of pod it runs in (`sharegpu reserve` reads it)."""
RESERVE_ACCOUNT: Final = "sharegpu-reserve"
"""The ServiceAccount of sharegpu's GPU-holding pods (reservations, group holders): `sharegpu reserve`
reports the GPUs it got on its own pod (the chart's files/rbac/reserve.yaml)."""
ROLE_GROUP_HANDOFF: Final = "group-handoff"
"""The ConfigMap that tells a group's members its GPUs (in each namespace that has members)."""
ROLE_GROUP_GUARD: Final = "group-guard"
"""The PodDisruptionBudget that keeps a bound group's holder pod from being evicted while members run
on its GPUs (`api.groups.holder_guard`)."""
ROLE_CLAIM_TEMPLATE: Final = "claim-template"
"""A ResourceClaimTemplate sharegpu made for one shape of GPU request (the DRA path)."""
ROLE_POD_CLAIM: Final = "pod-claim"
"""A ResourceClaim sharegpu made for the one pod that names it (the DRA path, `api.dra.pod_claim`)."""
ROLE_GANG_PLAN: Final = "gang-plan"
"""A released gang's plan, kept by the extender in the system namespace (`api.gangs.plan_configmap`)."""
LABEL_GROUP_NAMESPACE: Final = f"{DOMAIN}/group-namespace"
LABEL_GROUP_NAME: Final = f"{DOMAIN}/group-name"
"""On a group's holder pod, its hand-off ConfigMaps and its member pods: the group they belong to."""
LABEL_NODE: Final = f"{DOMAIN}/node"
LABEL_SLOT: Final = f"{DOMAIN}/gpu-index"
LABEL_ADMISSION: Final = f"{DOMAIN}/admission"
"""On a namespace, `skip` keeps the webhook out of it (the chart labels sharegpu-system and sharegpu-gpus; setting it
takes the verb skip-admission: files/policies/admission-skip.yaml)."""

# ----------------------------------------------------------------- the Device resource
DEVICE_PLURAL: Final = "devices"
DEVICE_KIND: Final = "Device"
USAGE_PLURAL: Final = "gpuusages"
USAGE_KIND: Final = "GpuUsage"
"""One per node, named after it: what the node's pods use of its GPUs (`api.usage`), written by its agent."""

# ----------------------------------------------------------------- sharegpu's other custom resources
API_VERSION: Final = "v1alpha1"
"""The version of sharegpu's own custom resources, in its group `DOMAIN` (the Device resource's too)."""
GROUP_VERSION: Final = f"{DOMAIN}/{API_VERSION}"
"""Their apiVersion."""
CATEGORY: Final = "sharegpu"
"""`kubectl get sharegpu` lists every sharegpu resource."""
DEVICE_GROUP_ANNOTATION: Final = f"{DOMAIN}/device-group"
"""On a pod: the SharedDeviceGroup (of the pod's namespace, or `namespace/name`) it joins."""
DEVICESHARE_GROUP_ANNOTATION: Final = "deviceshare.io/group"
"""On a pod: the shared-device-group project's way to join a group (its `deviceshare.io/v1alpha1`
SharedDeviceGroup, which the controller mirrors into sharegpu's of the same name: `api.deviceshare`)."""
GROUP_FINALIZER: Final = f"{DOMAIN}/group-cleanup"
"""On a SharedDeviceGroup: the controller removes its holder pod, node label and ConfigMaps first."""

# ----------------------------------------------------------------- the hand-off ConfigMap and reservation pods
HANDOFF_PREFIX: Final = "sharegpu-handoff-"
"""A pod's hand-off ConfigMap (the webhook names it; the extender writes it)."""
GROUP_PREFIX: Final = "sharegpu-group-"
"""A SharedDeviceGroup's holder pod, and its members' hand-off ConfigMap (the controller writes it)."""
GANG_PLAN_PREFIX: Final = "sharegpu-gangplan-"
"""A released gang's plan: a ConfigMap in SYSTEM_NAMESPACE only the extender writes (the chart's
admission policy sharegpu-handoff keeps it so)."""
HANDOFF_POLICY: Final = "sharegpu-handoff"
"""The ValidatingAdmissionPolicy (and its binding) that lets only sharegpu write the hand-offs
(the chart's files/policies/handoff.yaml)."""
RESERVATION_PREFIX: Final = "sharegpu-reserve-"
EXTENDER_LEASE: Final = "sharegpu-extender"
"""The Lease whose holder runs the extender's background reconcilers."""
CONTROLLER_LEASE: Final = "sharegpu-controller"
"""The Lease whose holder runs the controller's reconcilers (budgets, groups, SharePods)."""
CONTROLLER: Final = "sharegpu-controller"
"""The component name on the events the controller records."""


def reservation_name(node: str, slot: int, suffix: str) -> str:
    """The name of a reservation pod for GPU `slot` of `node` (a DNS subdomain: at most 253 characters)."""
    tail = f"-{slot}-{suffix}"
    return f"{RESERVATION_PREFIX}{node}"[: 253 - len(tail)] + tail
