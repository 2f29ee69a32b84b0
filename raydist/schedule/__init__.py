"""The pipeline scheduler: schedules as data (`actions`), pure generators for GPipe, 1F1B and interleaved
1F1B (`generators`) and for the zero-bubble ZB-H1 and ZB-V, which split the backward into B and W
(`zero_bubble`), one entry per kind holding everything the rest of raydist asks of it (`registry`), a
validator (`validate`), a time simulation with the bubble theory and a Gantt chart (`timeline`), and the
executor that runs a schedule on the pipeline ranks (`executor`, imports torch)."""

from raydist.schedule.actions import BACKWARD, FORWARD, PLACEMENTS, WEIGHT, Action, Schedule, Transfer
from raydist.schedule.generators import gpipe, interleaved, one_f_one_b
from raydist.schedule.registry import KINDS, SCHEDULE_KINDS, SPLIT_BACKWARD_KINDS, ScheduleKind, make_schedule
from raydist.schedule.timeline import Timeline, ideal_step_time, simulate, theoretical_bubble
from raydist.schedule.validate import ScheduleError, ScheduleReport, validate
from raydist.schedule.zero_bubble import zbh1, zbv

__all__ = ["BACKWARD", "FORWARD", "KINDS", "PLACEMENTS", "SCHEDULE_KINDS", "SPLIT_BACKWARD_KINDS", "WEIGHT", "Action",
           "Schedule", "ScheduleKind", "Transfer", "gpipe", "interleaved", "make_schedule", "one_f_one_b", "Timeline",
           "ideal_step_time", "simulate", "theoretical_bubble", "ScheduleError", "ScheduleReport", "validate", "zbh1",
           "zbv"]
