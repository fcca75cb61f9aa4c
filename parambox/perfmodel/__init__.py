"""The analytic scalability model behind ``parambox predict`` (after Keuper & Pfreundt, 2016).

T_iter(n) = T_comp(B/n) + T_comm(n) - overlap: T_comp measured here over local batch sizes (or given),
T_comm from alpha-beta models of ring and tree allreduce, one or k parameter servers and the box.
See :mod:`parambox.perfmodel.topology` for the formulas and :mod:`parambox.perfmodel.scaling` for the curves.
"""

from parambox.perfmodel.compute import ComputeProfile, measure_profile, parse_comp_table
from parambox.perfmodel.scaling import DEFAULT_WORKER_COUNTS, ScalingCurve, iteration_time_s, predict_curve
from parambox.perfmodel.topology import TOPOLOGIES, Network, comm_time_s, parse_topologies

__all__ = [
    "DEFAULT_WORKER_COUNTS",
    "TOPOLOGIES",
    "ComputeProfile",
    "Network",
    "ScalingCurve",
    "comm_time_s",
    "iteration_time_s",
    "measure_profile",
    "parse_comp_table",
    "parse_topologies",
    "predict_curve",
]
