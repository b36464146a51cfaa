"""Pipeline parallelism: schedules as data, a simulator, an engine and a Lightning strategy.

``schedule(name, num_stages, num_microbatches, stage)`` gives one stage's instruction list for
"naive", "gpipe", "1f1b" or "interleaved"; ``simulate`` runs all stages' lists on paper;
``PipelineEngine`` executes a list on ``torch.distributed`` point-to-point ops; and
``PipelineStrategy`` (registered with Lightning as ``"pipeline"``) runs it inside ``Trainer``.
"""

from llmlab.parallel.pipeline.engine import PipelineEngine, StepResult
from llmlab.parallel.pipeline.grad_sync import GradientReducer
from llmlab.parallel.pipeline.partition import balanced_boundaries, split_ranges
from llmlab.parallel.pipeline.schedules import (
    SCHEDULES,
    Instruction,
    Op,
    all_schedules,
    schedule,
    theoretical_bubble,
)
from llmlab.parallel.pipeline.simulator import (
    DeadlockError,
    SimulationResult,
    TimelineEvent,
    check_programs,
    simulate,
)
from llmlab.parallel.pipeline.stage import (
    StageModules,
    build_tie_groups,
    cut_stage,
    prune_to_stage,
)
from llmlab.parallel.pipeline.timeline import measured_bubble, plot_timeline


def __getattr__(name: str):
    # The strategy pulls in Lightning (seconds to import); schedules and the engine do not need it.
    if name == "PipelineStrategy":
        from llmlab.parallel.pipeline import preset

        return getattr(preset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SCHEDULES",
    "DeadlockError",
    "GradientReducer",
    "Instruction",
    "Op",
    "PipelineEngine",
    "PipelineStrategy",
    "SimulationResult",
    "StageModules",
    "StepResult",
    "TimelineEvent",
    "all_schedules",
    "balanced_boundaries",
    "build_tie_groups",
    "check_programs",
    "cut_stage",
    "measured_bubble",
    "plot_timeline",
    "prune_to_stage",
    "schedule",
    "simulate",
    "split_ranges",
    "theoretical_bubble",
]
