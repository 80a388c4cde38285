"""Planning: the cluster described, the workload costed, and the planner's search over layouts and schedules."""

from stagewise.plan.cluster import Cluster, Device, parse_devices
from stagewise.plan.evaluate import evaluate
from stagewise.plan.option import Option, Plan
from stagewise.plan.planner import candidates, load_plan, plan
from stagewise.plan.workload import Workload, measure_optimizer, workload

__all__ = [
    "Cluster",
    "Device",
    "Option",
    "Plan",
    "Workload",
    "candidates",
    "evaluate",
    "load_plan",
    "measure_optimizer",
    "parse_devices",
    "plan",
    "workload",
]
