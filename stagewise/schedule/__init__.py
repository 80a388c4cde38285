"""Schedules as pure data: actions, builders, dependencies, validation, simulation, holdings, pictures; no torch."""

from stagewise.schedule.actions import Action, Kind, Schedule
from stagewise.schedule.builders import ScheduleName, build
from stagewise.schedule.dependencies import ScheduleError
from stagewise.schedule.holdings import holdings
from stagewise.schedule.render import render, to_chrome_trace
from stagewise.schedule.shared_cores import SharedCores
from stagewise.schedule.simulate import SimulationResult, StageCosts, simulate
from stagewise.schedule.synthesis import synthesise
from stagewise.schedule.validate import peak_in_flight, validate

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "ScheduleName",
    "SharedCores",
    "SimulationResult",
    "StageCosts",
    "build",
    "holdings",
    "peak_in_flight",
    "render",
    "simulate",
    "synthesise",
    "to_chrome_trace",
    "validate",
]
