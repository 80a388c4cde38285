"""Planning: the cluster described, the workload costed, and the planner's search over layouts and schedules."""

from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.evaluate import evaluate
from stagewise.plan.option import Option, Plan
from stagewise.plan.planner import plan
from stagewise.plan.workload import Workload, workload

__all__ = ["Cluster", "Device", "Option", "Plan", "Workload", "evaluate", "plan", "workload"]
