"""What can propose draft tokens (spec_jax.drafting.base.Drafter: every hook the loop, the API,
sharding and gamma=auto use), one module per drafter, and `build(kind, target, settings)`, the
one place drafters are made (spec_jax.drafting.build)."""

from spec_jax.drafting.base import UNBOUNDED_CONTEXT, Drafter, Proposal, TreeProposal, check_gamma
from spec_jax.drafting.build import DRAFTERS, Settings, as_drafter, build
from spec_jax.drafting.none import NoDrafter

__all__ = [
    "DRAFTERS",
    "UNBOUNDED_CONTEXT",
    "Drafter",
    "NoDrafter",
    "Proposal",
    "TreeProposal",
    "Settings",
    "as_drafter",
    "build",
    "check_gamma",
]
