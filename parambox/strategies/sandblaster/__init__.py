"""``sandblaster``: DistBelief's distributed batch L-BFGS. The strategy (``strategy``), the coordinator's
messaging (``farm``), the dispatch policy (``portions``) and the L-BFGS maths (``lbfgs``)."""

from parambox.strategies.sandblaster.strategy import Sandblaster, SandblasterOptions

__all__ = ["Sandblaster", "SandblasterOptions"]
