"""Pipeline schedules as validated data, a simulator that times them, and pictures of them."""

from stagewise.pipeline import schedules
from stagewise.pipeline.actions import Action, Kind, Schedule
from stagewise.pipeline.engine import Event, ScheduleError
from stagewise.pipeline.render import render, to_chrome_trace
from stagewise.pipeline.schedules import ScheduleName, build
from stagewise.pipeline.simulate import SimulationResult, StageCosts, simulate
from stagewise.pipeline.validate import ScheduleReport, peak_in_flight, validate

__all__ = [
    "Action",
    "Event",
    "Kind",
    "Schedule",
    "ScheduleError",
    "ScheduleName",
    "ScheduleReport",
    "SimulationResult",
    "StageCosts",
    "build",
    "peak_in_flight",
    "render",
    "schedules",
    "simulate",
    "to_chrome_trace",
    "validate",
]
