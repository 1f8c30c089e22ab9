"""What can propose draft tokens (spec_jax.drafting.base.Drafter: what every round needs, and the
optional capabilities with their defaults: TreeDrafting, TargetFeatures, Resumption,
MeshPlacement, CostMeasurement), one module per drafter, and `build(kind, target, settings)`,
the one place drafters are made (spec_jax.drafting.build)."""

from spec_jax.drafting.base import (
    AUTO_GAMMA_MAX,
    AUTO_TREE_MAX,
    AUTO_TREE_SIZES,
    UNBOUNDED_CONTEXT,
    CostMeasurement,
    Drafter,
    MeshPlacement,
    Proposal,
    Resumption,
    TargetFeatures,
    TimedCall,
    TreeDrafting,
    TreeProposal,
    check_gamma,
)
from spec_jax.drafting.build import DRAFTERS, Settings, as_drafter, build
from spec_jax.drafting.none import NoDrafter

__all__ = [
    "AUTO_GAMMA_MAX",
    "AUTO_TREE_MAX",
    "AUTO_TREE_SIZES",
    "DRAFTERS",
    "UNBOUNDED_CONTEXT",
    "CostMeasurement",
    "Drafter",
    "MeshPlacement",
    "NoDrafter",
    "Proposal",
    "Resumption",
    "TargetFeatures",
    "TimedCall",
    "TreeDrafting",
    "TreeProposal",
    "Settings",
    "as_drafter",
    "build",
    "check_gamma",
]
