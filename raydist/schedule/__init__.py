"""The pipeline scheduler: schedules as data (`actions`), pure generators for GPipe, 1F1B and interleaved
1F1B (`generators`), a validator (`validate`), a time simulation with the bubble theory and a Gantt chart
(`timeline`), and the executor that runs a schedule on the pipeline ranks (`executor`, imports torch)."""

from raydist.schedule.actions import BACKWARD, FORWARD, KINDS, Action, Schedule, Transfer
from raydist.schedule.generators import gpipe, interleaved, make_schedule, one_f_one_b
from raydist.schedule.timeline import Timeline, ideal_step_time, simulate, theoretical_bubble
from raydist.schedule.validate import ScheduleError, ScheduleReport, validate

__all__ = ["BACKWARD", "FORWARD", "KINDS", "Action", "Schedule", "Transfer", "gpipe", "interleaved",
           "make_schedule", "one_f_one_b", "Timeline", "ideal_step_time", "simulate", "theoretical_bubble",
           "ScheduleError", "ScheduleReport", "validate"]
