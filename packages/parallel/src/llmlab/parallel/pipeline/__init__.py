"""Pipeline parallelism: schedules as data, a simulator, an engine and a Lightning strategy.

``schedule(name, num_stages, num_microbatches, stage)`` gives one stage's instruction list for
"naive", "gpipe", "1f1b", "interleaved" or the split-backward "zb1", "zbv", "dualpipev";
``validate_programs`` checks all stages' lists and ``simulate`` runs them on paper;
``PipelineEngine`` executes a list on ``torch.distributed`` point-to-point ops; the N-D strategy
runs it inside ``Trainer`` (``PipelineStrategy``, registered with Lightning as ``"pipeline"``, is
its preset in :mod:`llmlab.parallel.presets`).
"""

from llmlab.parallel.pipeline.engine import PipelineEngine, StepResult
from llmlab.parallel.pipeline.grad_sync import GradientReducer
from llmlab.parallel.pipeline.partition import balanced_boundaries, chunk_owner, split_ranges
from llmlab.parallel.pipeline.recompute import checkpoint_shared, share_recompute
from llmlab.parallel.pipeline.schedules import (
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPED,
    Instruction,
    Op,
    ScheduleError,
    all_schedules,
    placement,
    schedule,
    theoretical_bubble,
)
from llmlab.parallel.pipeline.simulator import (
    DeadlockError,
    SimulationResult,
    TimelineEvent,
    simulate,
)
from llmlab.parallel.pipeline.split_backward import backward_input, backward_weight
from llmlab.parallel.pipeline.stage import (
    StageModules,
    build_tie_groups,
    cut_stage,
    prune_to_stage,
)
from llmlab.parallel.pipeline.timeline import measured_bubble, plot_timeline
from llmlab.parallel.pipeline.validate import check_programs, validate_programs

__all__ = [
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "V_SHAPED",
    "DeadlockError",
    "GradientReducer",
    "Instruction",
    "Op",
    "PipelineEngine",
    "ScheduleError",
    "SimulationResult",
    "StageModules",
    "StepResult",
    "TimelineEvent",
    "all_schedules",
    "backward_input",
    "backward_weight",
    "balanced_boundaries",
    "build_tie_groups",
    "check_programs",
    "checkpoint_shared",
    "chunk_owner",
    "cut_stage",
    "measured_bubble",
    "placement",
    "plot_timeline",
    "prune_to_stage",
    "schedule",
    "share_recompute",
    "simulate",
    "split_ranges",
    "theoretical_bubble",
    "validate_programs",
]
