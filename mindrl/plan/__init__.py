"""Dry-run planner: from a validated config, without starting a worker or building a model, where every rank sits, each
model's layout and the memory of every phase per device, with a verdict (docs/plan.md)."""

from mindrl.plan.devices import CHOICES, Device, pick_device
from mindrl.plan.params import PlanError, StageParams, adapter_params, stage_params, total_params
from mindrl.plan.planner import PHASES, Plan, rank_coords
from mindrl.plan.report import to_json, to_text
from mindrl.plan.separate import make_plan

__all__ = [
    "CHOICES",
    "PHASES",
    "Device",
    "Plan",
    "PlanError",
    "StageParams",
    "adapter_params",
    "make_plan",
    "pick_device",
    "rank_coords",
    "stage_params",
    "to_json",
    "to_text",
    "total_params",
]
