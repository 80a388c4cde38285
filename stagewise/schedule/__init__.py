"""Schedules as pure data: actions, builders, dependencies, validation, simulation, holdings, pictures; no torch."""

from stagewise.schedule.actions import Action, Kind, Schedule
from stagewise.schedule.builders import BUILDERS, Builder, ScheduleName, build
from stagewise.schedule.dependencies import Event, ScheduleError
from stagewise.schedule.holdings import FREE, Holding, Pool, Pooling, PoolPolicy, free_pool, holdings, rank_pool
from stagewise.schedule.render import render, to_chrome_trace
from stagewise.schedule.simulate import SimulationResult, StageCosts, simulate
from stagewise.schedule.spans import Span
from stagewise.schedule.synthesis import Synthesis, synthesise
from stagewise.schedule.validate import ScheduleReport, peak_in_flight, validate

__all__ = [
    "BUILDERS",
    "FREE",
    "Action",
    "Builder",
    "Event",
    "Holding",
    "Kind",
    "Pool",
    "PoolPolicy",
    "Pooling",
    "Schedule",
    "ScheduleError",
    "ScheduleName",
    "ScheduleReport",
    "SimulationResult",
    "Span",
    "StageCosts",
    "Synthesis",
    "build",
    "free_pool",
    "holdings",
    "peak_in_flight",
    "rank_pool",
    "render",
    "simulate",
    "synthesise",
    "to_chrome_trace",
    "validate",
]
