"""yutu.sched: the conductor's placement policies and cost models.

Pure: no I/O, no clock reads (``now`` is passed in), no asyncio, no torch; a simulator drives the
same code. The caller builds a :class:`ClusterView` and a :class:`RequestView`, asks a policy
(:func:`policy_by_name`) to ``place`` the request, and gets a :class:`Placement` or a
:class:`Rejection`; it feeds its measurements to the :class:`CostModels` the policy consults.

Modules: ``view`` (snapshot types), ``prefix`` (prefix matching), ``regression`` (the online fit),
``costs`` (cost models), ``forecast`` (decode load at a future instant), ``estimate`` (per-instance
prefix plan and TTFT), ``options``, ``outcome`` (placement and rejection), ``placer`` (the shared
placement steps), ``policies`` (the policies and their registry).
"""

from yutu.sched.costs import CostModels, DecodeCostModel, PrefillCostModel, TransferCostModel
from yutu.sched.estimate import Estimate
from yutu.sched.options import PolicyOptions
from yutu.sched.outcome import Placement, PrefixPlan, RejectCause, Rejection
from yutu.sched.placer import DecodeCandidate, Placer, Policy
from yutu.sched.policies import (
    POLICIES,
    CacheAware,
    KVCentric,
    KVCentricAffinity,
    LeastLoaded,
    RoundRobin,
    policy_by_name,
)
from yutu.sched.view import (
    ClusterView,
    DecodeView,
    IncomingDecode,
    KeySet,
    PrefillView,
    QueuedPrefill,
    RequestView,
    RunningDecode,
)

__all__ = [
    "POLICIES",
    "CacheAware",
    "ClusterView",
    "CostModels",
    "DecodeCandidate",
    "DecodeCostModel",
    "DecodeView",
    "Estimate",
    "IncomingDecode",
    "KVCentric",
    "KVCentricAffinity",
    "KeySet",
    "LeastLoaded",
    "Placement",
    "Placer",
    "Policy",
    "PolicyOptions",
    "PrefillCostModel",
    "PrefillView",
    "PrefixPlan",
    "QueuedPrefill",
    "RejectCause",
    "Rejection",
    "RequestView",
    "RoundRobin",
    "RunningDecode",
    "TransferCostModel",
    "policy_by_name",
]
